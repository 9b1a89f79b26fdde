"""Latest state per session in Redis (or the bundled Valkey), for agents that need it in O(1).

Layout per session: `<prefix>:state:<session>:meta` (hash: version_id, ordinal, time, counts),
`…:nodes` (hash: node id -> {"type", "data", "expires_at", "caused_by_tool"} JSON), `…:edges` (hash:
"src\\x1fdst\\x1ftype" -> data JSON), `…:expiring` (sorted set: the id of each node with a TTL, scored by its
expiry in UTC micros, so a reader leaves expired nodes out without parsing every node). A version is applied by
one Lua script, atomically and only on top of
its parent (ordinal = stored + 1): older versions (a replay) are ignored, and a gap (Redis was wiped or is
behind) is reported so the worker rewrites the session from its tables. The versions a commit made for one
session go in one call: their changes merged (the last value of each node and edge), applied when the stored
ordinal is anywhere from just below the first to just below the last (what the run adds on top of any of
those is the same final state). `<prefix>:state:epoch` marks a
cache the worker has filled in this layout (its value is LAYOUT); when it disappears (FLUSHALL, a new Redis) or names
an older layout, the worker rebuilds every session it owns. TTL'd nodes also get a hash-field expiry (HPEXPIREAT,
Redis >= 7.4 / Valkey >= 9) and readers drop expired ones.

Reading a session parses nothing up front: its nodes and edges are views over the hashes' raw values that build a
GraphNode or GraphEdge when touched (StateCache.read).
"""

from __future__ import annotations

import time as _time
from collections.abc import Iterable
from typing import Any

import orjson
import redis.asyncio as aioredis

from processors.state.cache_views import EDGE_FIELD_SEP, CachedEdges, CachedNodes
from processors.state.graph import EdgeKey, EdgeRec, NodeRec
from processors.state.model import StateGraph
from topics.settings import Settings

GAP = -1
LAYOUT = b"2"  # 2: the `expiring` sorted set; a cache filled in layout 1 (without it) is rebuilt

_APPLY = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'ordinal') or '0')
local ord = tonumber(ARGV[1])
if cur >= ord then return 0 end
if cur < tonumber(ARGV[7]) - 1 then return -1 end
local ch = cjson.decode(ARGV[6])
for _, n in ipairs(ch[1]) do
  if n[2] == '' then redis.call('HDEL', KEYS[2], n[1]) else redis.call('HSET', KEYS[2], n[1], n[2]) end
  if n[3] > 0 then
    redis.pcall('HPEXPIREAT', KEYS[2], n[3], 'FIELDS', 1, n[1])
    redis.call('ZADD', KEYS[4], n[4], n[1])
  else redis.call('ZREM', KEYS[4], n[1]) end
end
for _, e in ipairs(ch[2]) do
  if e[2] == '' then redis.call('HDEL', KEYS[3], e[1]) else redis.call('HSET', KEYS[3], e[1], e[2]) end
end
redis.call('HSET', KEYS[1], 'ordinal', ARGV[1], 'version_id', ARGV[2], 'time', ARGV[3],
  'node_count', ARGV[4], 'edge_count', ARGV[5])
return 1
"""


def redis_url(settings: Settings) -> str:
    """REDIS_URL, or the bundled Valkey the local stack runs; the worker and the SDK both use this."""
    return settings.redis_url or f"redis://127.0.0.1:{settings.valkey_port}/0"


def connect(settings: Settings) -> aioredis.Redis:
    return aioredis.Redis.from_url(redis_url(settings))


def _keys(prefix: str, session: str) -> list[str]:
    base = f"{prefix}:state:{session}"
    return [f"{base}:meta", f"{base}:nodes", f"{base}:edges", f"{base}:expiring"]


def epoch_key(prefix: str) -> str:
    return f"{prefix}:state:epoch"


def node_value(rec: NodeRec) -> str:
    return orjson.dumps(
        {
            "type": rec.type,
            "data": orjson.Fragment(rec.data_json),
            "expires_at": rec.expires_at,
            "caused_by_tool": rec.caused_by_tool,
        }
    ).decode()


def _node_json(interval: dict[str, Any]) -> str:
    """node_value of a StateVersion's interval dict, without building the NodeRec."""
    return orjson.dumps(
        {
            "type": interval["type"],
            "data": orjson.Fragment(interval["data_json"]),
            "expires_at": interval["expires_at"],
            "caused_by_tool": interval["caused_by_tool"],
        }
    ).decode()


def _runs(versions: Iterable[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Versions grouped into runs of one session's consecutive ordinals, in order of their first version."""
    runs: list[list[dict[str, Any]]] = []
    open_runs: dict[str, list[dict[str, Any]]] = {}
    for v in versions:
        run = open_runs.get(v["session_id"])
        if run is not None and run[-1]["ordinal"] + 1 == v["ordinal"]:
            run.append(v)
        else:
            run = open_runs[v["session_id"]] = [v]
            runs.append(run)
    return runs


def edge_field(key: EdgeKey) -> str:
    return EDGE_FIELD_SEP.join(key)


class StateCache:
    """Writes versions and snapshots for one deployment (topic prefix) and reads them back."""

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self._apply = client.register_script(_APPLY)

    async def apply_versions(self, versions: Iterable[dict[str, Any]]) -> set[str]:
        """Apply StateVersion records in order, one call per run of a session's consecutive versions; returns the
        sessions that hit a gap (need a snapshot)."""
        pipe = self.client.pipeline(transaction=False)
        sessions = []
        for run in _runs(versions):
            nodes: dict[str, list[Any]] = {}
            edges: dict[str, list[Any]] = {}
            for v in run:
                for c in v["node_changes"]:
                    after = c["next"]
                    if after is None:
                        nodes[c["node_id"]] = [c["node_id"], "", 0, ""]
                    else:  # the expiry in ms for HPEXPIREAT, and in micros as text (Lua's numbers print 14 digits)
                        expires = after["expires_at"]
                        nodes[c["node_id"]] = [c["node_id"], _node_json(after), expires // 1000 if expires else 0,
                                               str(expires or "")]  # fmt: skip
                for c in v["edge_changes"]:
                    name = edge_field((c["src"], c["dst"], c["type"]))
                    edges[name] = [name, "" if c["next"] is None else c["next"]["data_json"]]
            last = run[-1]
            args = [last["ordinal"], last["version_id"], last["event_time"], last["node_count"], last["edge_count"]]
            changes = orjson.dumps([list(nodes.values()), list(edges.values())])
            await self._apply(
                keys=_keys(self.prefix, last["session_id"]), args=[*args, changes, run[0]["ordinal"]], client=pipe
            )
            sessions.append(last["session_id"])
        results = await pipe.execute() if sessions else []
        return {s for s, r in zip(sessions, results, strict=True) if r == GAP}

    async def write_snapshot(
        self,
        session: str,
        meta: dict[str, Any],
        nodes: Iterable[tuple[str, NodeRec]],
        edges: Iterable[tuple[EdgeKey, EdgeRec]],
    ) -> None:
        """Replace a session's cached state with a full snapshot (after a wipe or a gap)."""
        meta_key, nodes_key, edges_key, expiring_key = _keys(self.prefix, session)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(meta_key, nodes_key, edges_key, expiring_key)
        nodes = list(nodes)
        node_map = {node_id: node_value(rec) for node_id, rec in nodes}
        edge_map = {edge_field(key): rec.data_json for key, rec in edges}
        expiring = {node_id: rec.expires_at for node_id, rec in nodes if rec.expires_at}
        if node_map:
            pipe.hset(nodes_key, mapping=node_map)
        if edge_map:
            pipe.hset(edges_key, mapping=edge_map)
        if expiring:
            pipe.zadd(expiring_key, mapping=expiring)
        pipe.hset(meta_key, mapping={k: str(v) for k, v in meta.items()})
        await pipe.execute()

    async def expire(self, session: str, seconds: float) -> None:
        """Let an ended session's latest state go after `seconds` (no version will refresh it)."""
        pipe = self.client.pipeline(transaction=False)
        for key in _keys(self.prefix, session):
            pipe.pexpire(key, max(1, int(seconds * 1000)))
        await pipe.execute()

    async def mark_filled(self) -> None:
        await self.client.set(epoch_key(self.prefix), LAYOUT)

    async def filled(self) -> bool:
        """Whether this worker's sessions are in the cache, in this layout (else they are rebuilt)."""
        return await self.client.get(epoch_key(self.prefix)) == LAYOUT

    async def read(self, session: str, now_micros: int | None = None) -> StateGraph | None:
        """The latest cached state, expired nodes left out; None when the session has no cached state."""
        meta_key, nodes_key, edges_key, expiring_key = _keys(self.prefix, session)
        now = now_micros if now_micros is not None else int(_time.time() * 1_000_000)
        pipe = self.client.pipeline(transaction=True)
        pipe.hgetall(meta_key)
        pipe.hgetall(nodes_key)
        pipe.hgetall(edges_key)
        pipe.zrangebyscore(expiring_key, "-inf", now)
        meta, nodes, edges, expired = await pipe.execute()
        if not meta:
            return None
        return StateGraph(
            session_id=session,
            version_id=meta[b"version_id"].decode(),
            ordinal=int(meta[b"ordinal"]),
            time=int(meta[b"time"]),
            nodes=CachedNodes(nodes, set(expired)),
            edges=CachedEdges(edges),
        )
