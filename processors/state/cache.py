"""Latest state per session in Redis (or the bundled Valkey), for agents that need it in O(1).

Layout per session: `<prefix>:state:<session>:meta` (hash: version_id, ordinal, time, counts),
`…:nodes` (hash: node id -> {"type", "data", "expires_at", "caused_by_tool"} JSON), `…:edges` (hash:
"src\\x1fdst\\x1ftype" -> data JSON). A version is applied by one Lua script, atomically and only on top of
its parent (ordinal = stored + 1): older versions (a replay) are ignored, and a gap (Redis was wiped or is
behind) is reported so the worker rewrites the session from its tables. The versions a commit made for one
session go in one call: their changes merged (the last value of each node and edge), applied when the stored
ordinal is anywhere from just below the first to just below the last (what the run adds on top of any of
those is the same final state). `<prefix>:state:epoch` marks a
cache the worker has filled; when it disappears (FLUSHALL, a new Redis) the worker rebuilds every session it owns.
TTL'd nodes also get a hash-field expiry (HPEXPIREAT, Redis >= 7.4 / Valkey >= 9) and readers drop expired ones.
"""

from __future__ import annotations

import time as _time
from collections.abc import Iterable
from typing import Any

import orjson
import redis.asyncio as aioredis

from processors.state.graph import EdgeKey, EdgeRec, NodeRec
from processors.state.model import GraphEdge, GraphNode, StateGraph
from topics.settings import Settings

_SEP = "\x1f"
GAP = -1

_APPLY = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'ordinal') or '0')
local ord = tonumber(ARGV[1])
if cur >= ord then return 0 end
if cur < tonumber(ARGV[7]) - 1 then return -1 end
local ch = cjson.decode(ARGV[6])
for _, n in ipairs(ch[1]) do
  if n[2] == '' then redis.call('HDEL', KEYS[2], n[1]) else
    redis.call('HSET', KEYS[2], n[1], n[2])
    if n[3] > 0 then redis.pcall('HPEXPIREAT', KEYS[2], n[3], 'FIELDS', 1, n[1]) end
  end
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
    return [f"{base}:meta", f"{base}:nodes", f"{base}:edges"]


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
    return _SEP.join(key)


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
                        nodes[c["node_id"]] = [c["node_id"], "", 0]
                    else:
                        expires = after["expires_at"]
                        nodes[c["node_id"]] = [c["node_id"], _node_json(after), expires // 1000 if expires else 0]
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
        meta_key, nodes_key, edges_key = _keys(self.prefix, session)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(meta_key, nodes_key, edges_key)
        node_map = {node_id: node_value(rec) for node_id, rec in nodes}
        edge_map = {edge_field(key): rec.data_json for key, rec in edges}
        if node_map:
            pipe.hset(nodes_key, mapping=node_map)
        if edge_map:
            pipe.hset(edges_key, mapping=edge_map)
        pipe.hset(meta_key, mapping={k: str(v) for k, v in meta.items()})
        await pipe.execute()

    async def expire(self, session: str, seconds: float) -> None:
        """Let an ended session's latest state go after `seconds` (no version will refresh it)."""
        pipe = self.client.pipeline(transaction=False)
        for key in _keys(self.prefix, session):
            pipe.pexpire(key, max(1, int(seconds * 1000)))
        await pipe.execute()

    async def mark_filled(self) -> None:
        await self.client.set(epoch_key(self.prefix), b"1")

    async def filled(self) -> bool:
        return bool(await self.client.exists(epoch_key(self.prefix)))

    async def read(self, session: str, now_micros: int | None = None) -> StateGraph | None:
        """The latest cached state, expired nodes removed; None when the session has no cached state."""
        meta_key, nodes_key, edges_key = _keys(self.prefix, session)
        pipe = self.client.pipeline(transaction=True)
        pipe.hgetall(meta_key)
        pipe.hgetall(nodes_key)
        pipe.hgetall(edges_key)
        meta, nodes, edges = await pipe.execute()
        if not meta:
            return None
        now = now_micros if now_micros is not None else int(_time.time() * 1_000_000)
        graph_nodes = {}
        for node_id, raw in nodes.items():
            doc = orjson.loads(raw)
            if doc["expires_at"] is not None and doc["expires_at"] <= now:
                continue
            nid = node_id.decode()
            graph_nodes[nid] = GraphNode(nid, doc["type"], doc["data"], doc["expires_at"], doc["caused_by_tool"])
        graph_edges = []
        for name, raw in edges.items():
            src, dst, kind = name.decode().split(_SEP)
            graph_edges.append(GraphEdge(src, dst, kind, orjson.loads(raw)))
        return StateGraph(
            session_id=session,
            version_id=meta[b"version_id"].decode(),
            ordinal=int(meta[b"ordinal"]),
            time=int(meta[b"time"]),
            nodes=graph_nodes,
            edges=graph_edges,
        )
