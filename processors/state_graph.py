"""The versioned state graph as a pure fold: events in, immutable versions (with their changes) out.

Order. Deltas, dispatches and tool results of one session arrive on three topics, so their arrival order
is not the order the agent emitted them. Every event carries the session's `seq`, and one producer writes
each topic partition in seq order, so an event with seq s can be applied once each of the three topics has
shown a seq >= s for the session (the *watermark*): until then it waits in a reorder buffer. Applied order
is therefore (seq, event_id) whatever the arrival order. The buffer is released early only by (a) an idle
flush (the session was quiet for a while; the caller decides when), (b) a lifecycle event (everything
below its seq), or (c) the bound `max_buffer`. An event whose seq is below what was already applied is
*late*: it is applied at the head, in arrival order, flagged `late`, never dropped.

Versions. Each applied event makes one version `session.ordinal.hash`, where the hash is content-addressed
from the parent version id, the event's operations and the nodes its time expired. Replaying the same
events in the same order gives byte-identical versions.

TTL. A node with ttl_seconds expires at event_time + ttl; expiry is applied at the next version whose time
(max of event times so far) passes it, and recorded as an `expire` change of that version.

Rollback. The last `history` versions keep undo records, so `rollback_to` any of them (or the empty
genesis version while it is in the window) restores that state as a new version, then applies the delta.

Memory. The reorder buffer, undo window and node count are bounded (FoldConfig); nodes and edges live in a
`GraphStore` (RocksDB tables in the worker, dicts in tests).
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

DELTA = "treadle.events.StateDelta"
DISPATCH = "treadle.events.ActionDispatched"
RESULT = "treadle.events.ToolResult"
LIFECYCLE = "treadle.events.LifecycleEvent"
STATE_INPUTS = (DELTA, DISPATCH, RESULT, LIFECYCLE)
STATE_VERSION = "treadle.derived.StateVersion"
# Topics whose per-session seq heads make up the watermark.
ORDERED = (DELTA, DISPATCH, RESULT)
_FLUSHING_LIFECYCLE = frozenset({"EPISODE_ENDED", "SESSION_PAUSED", "SESSION_CLOSED", "SESSION_ARCHIVED"})
AUTO_TYPES = frozenset({"action", "tool_result"})


class StateError(ValueError):
    """An event that cannot be folded into the state (bad rollback target, too many nodes...)."""


@dataclass(frozen=True)
class FoldConfig:
    auto_nodes: bool = True
    max_buffer: int = 10_000
    max_nodes: int = 1_000_000
    history: int = 256


@dataclass(frozen=True)
class NodeRec:
    """A live node and the interval it opened (from_ordinal, valid_from)."""

    type: str
    data_json: str
    from_ordinal: int
    valid_from: int
    expires_at: int | None = None
    caused_by_tool: str = ""

    def content(self) -> tuple[str, str, int | None, str]:
        return (self.type, self.data_json, self.expires_at, self.caused_by_tool)

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "data_json": self.data_json,
            "from_ordinal": self.from_ordinal,
            "valid_from": self.valid_from,
            "expires_at": self.expires_at,
            "caused_by_tool": self.caused_by_tool,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeRec:
        return cls(**d)


@dataclass(frozen=True)
class EdgeRec:
    data_json: str
    from_ordinal: int
    valid_from: int

    def to_dict(self) -> dict[str, Any]:
        return {"data_json": self.data_json, "from_ordinal": self.from_ordinal, "valid_from": self.valid_from}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EdgeRec:
        return cls(**d)


EdgeKey = tuple[str, str, str]  # (src, dst, type)


class GraphStore(Protocol):
    """Where a session's nodes, edges and applied-event records live (keys are per session)."""

    def get_node(self, session: str, node_id: str) -> NodeRec | None: ...
    def put_node(self, session: str, node_id: str, rec: NodeRec | None) -> None: ...
    def get_edge(self, session: str, key: EdgeKey) -> EdgeRec | None: ...
    def put_edge(self, session: str, key: EdgeKey, rec: EdgeRec | None) -> None: ...
    def get_event(self, session: str, event_id: str) -> list[dict[str, Any]] | None: ...
    def put_event(self, session: str, event_id: str, outputs: list[dict[str, Any]]) -> None: ...


class MemoryStore:
    """A GraphStore in dicts, for tests, the bench and rebuilding."""

    def __init__(self) -> None:
        self.nodes: dict[tuple[str, str], NodeRec] = {}
        self.edges: dict[tuple[str, EdgeKey], EdgeRec] = {}
        self.events: dict[tuple[str, str], list[dict[str, Any]]] = {}

    def get_node(self, session: str, node_id: str) -> NodeRec | None:
        return self.nodes.get((session, node_id))

    def put_node(self, session: str, node_id: str, rec: NodeRec | None) -> None:
        if rec is None:
            self.nodes.pop((session, node_id), None)
        else:
            self.nodes[(session, node_id)] = rec

    def get_edge(self, session: str, key: EdgeKey) -> EdgeRec | None:
        return self.edges.get((session, key))

    def put_edge(self, session: str, key: EdgeKey, rec: EdgeRec | None) -> None:
        if rec is None:
            self.edges.pop((session, key), None)
        else:
            self.edges[(session, key)] = rec

    def get_event(self, session: str, event_id: str) -> list[dict[str, Any]] | None:
        return self.events.get((session, event_id))

    def put_event(self, session: str, event_id: str, outputs: list[dict[str, Any]]) -> None:
        self.events[(session, event_id)] = outputs


def genesis(session: str) -> str:
    """The id of a session's empty state, before any version."""
    return f"{session}.0.genesis"


@dataclass
class Pending:
    seq: int
    event_id: str
    schema: str
    record: dict[str, Any]


@dataclass
class Undo:
    """How to step back over one version: the values it replaced, kept in their serialized (dict) form so the
    session state (de)serializes in C (orjson) and records are only rebuilt when a rollback needs them."""

    version_id: str
    parent_id: str
    nodes: dict[str, dict[str, Any] | None]
    edges: list[list[Any]]  # [src, dst, type, EdgeRec dict | None]


@dataclass
class SessionState:
    """Per-session fold state besides nodes and edges; small and bounded."""

    session_id: str
    version_id: str = ""
    ordinal: int = 0
    time: int = 0
    applied_seq: int = -1
    node_count: int = 0
    edge_count: int = 0
    heads: dict[str, int] = field(default_factory=dict)
    buffer: list[Pending] = field(default_factory=list)
    undo: list[list[Any]] = field(default_factory=list)  # Undo fields as lists: loaded and saved by orjson alone
    ttl: list[tuple[int, str]] = field(default_factory=list)  # heap of (expires_at, node_id); stale entries skipped

    def __post_init__(self) -> None:
        if not self.version_id:
            self.version_id = genesis(self.session_id)

    def to_bytes(self) -> bytes:
        return orjson.dumps(
            {
                "s": self.session_id,
                "v": self.version_id,
                "o": self.ordinal,
                "t": self.time,
                "a": self.applied_seq,
                "n": self.node_count,
                "e": self.edge_count,
                "h": self.heads,
                "b": [[p.seq, p.event_id, p.schema, p.record] for p in self.buffer],
                "u": self.undo,
                "x": self.ttl,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> SessionState:
        d = orjson.loads(data)
        return cls(
            session_id=d["s"],
            version_id=d["v"],
            ordinal=d["o"],
            time=d["t"],
            applied_seq=d["a"],
            node_count=d["n"],
            edge_count=d["e"],
            heads=d["h"],
            buffer=[Pending(*p) for p in d["b"]],
            undo=d["u"],
            ttl=[(int(a), str(b)) for a, b in d["x"]],
        )


@dataclass(frozen=True)
class FoldOutput:
    """Versions made by one call (StateVersion records, in order) and events refused at apply time."""

    versions: list[dict[str, Any]]
    rejected: list[tuple[str, dict[str, Any], str]]  # (schema, record, reason)
    duplicate: bool = False


class StateFold:
    """Applies events to a SessionState + GraphStore; deterministic for a given event order."""

    def __init__(self, config: FoldConfig | None = None) -> None:
        self.config = config or FoldConfig()

    # -- intake and ordering ----------------------------------------------------------------------

    def accept(self, state: SessionState, store: GraphStore, schema: str, record: dict[str, Any]) -> FoldOutput:
        """Take one validated event: ignore a duplicate, buffer it, and apply what the watermark releases."""
        env = record["envelope"]
        event_id, seq = env["event_id"], int(env["seq"])
        if store.get_event(state.session_id, event_id) is not None or any(p.event_id == event_id for p in state.buffer):
            return FoldOutput(versions=[], rejected=[], duplicate=True)
        if schema == LIFECYCLE:
            store.put_event(state.session_id, event_id, [])
            if record.get("kind") in _FLUSHING_LIFECYCLE:
                return self._release(state, store, lambda p: p.seq < seq)
            return FoldOutput([], [])
        if schema in ORDERED:
            state.heads[schema] = max(state.heads.get(schema, -1), seq)
        if not self.config.auto_nodes and schema != DELTA:
            store.put_event(state.session_id, event_id, [])
            return FoldOutput([], [])
        if seq <= state.applied_seq:  # late: its place in the order has passed
            store.put_event(state.session_id, event_id, [])
            versions, rejected = [], []
            self._apply_one(state, store, Pending(seq, event_id, schema, record), versions, rejected, late=True)
            return FoldOutput(versions, rejected)
        state.buffer.append(Pending(seq, event_id, schema, record))
        state.buffer.sort(key=lambda p: (p.seq, p.event_id))
        mark = self.watermark(state)
        out = self._release(state, store, lambda p: p.seq <= mark)
        if len(state.buffer) > self.config.max_buffer:
            over = len(state.buffer) - self.config.max_buffer
            cut = state.buffer[over - 1].seq
            more = self._release(state, store, lambda p: p.seq <= cut)
            out = FoldOutput(out.versions + more.versions, out.rejected + more.rejected)
        return out

    def watermark(self, state: SessionState) -> int:
        """The highest seq every ordered topic has passed for this session (-1 until all have shown one)."""
        if not self.config.auto_nodes:
            return state.heads.get(DELTA, -1)
        return min(state.heads.get(topic, -1) for topic in ORDERED)

    def flush(self, state: SessionState, store: GraphStore, upto_seq: int | None = None) -> FoldOutput:
        """Release buffered events (up to `upto_seq`) after the session went idle."""
        return self._release(state, store, lambda p: upto_seq is None or p.seq <= upto_seq)

    def _release(self, state: SessionState, store: GraphStore, ready) -> FoldOutput:
        versions: list[dict[str, Any]] = []
        rejected: list[tuple[str, dict[str, Any], str]] = []
        while state.buffer and ready(state.buffer[0]):
            pending = state.buffer.pop(0)
            store.put_event(state.session_id, pending.event_id, [])
            self._apply_one(state, store, pending, versions, rejected, late=False)
        return FoldOutput(versions, rejected)

    def _apply_one(
        self,
        state: SessionState,
        store: GraphStore,
        pending: Pending,
        versions: list[dict[str, Any]],
        rejected: list[tuple[str, dict[str, Any], str]],
        *,
        late: bool,
    ) -> None:
        state.applied_seq = max(state.applied_seq, pending.seq)
        try:
            versions.append(self.apply(state, store, pending.schema, pending.record, late=late))
        except StateError as exc:
            rejected.append((pending.schema, pending.record, str(exc)))

    # -- one version ------------------------------------------------------------------------------

    def apply(
        self, state: SessionState, store: GraphStore, schema: str, record: dict[str, Any], *, late: bool = False
    ) -> dict[str, Any]:
        """Apply one event now, making one version; raises StateError (state unchanged) if it cannot."""
        popped: list[tuple[int, str]] = []
        try:
            return self._version(state, store, schema, record, late, popped)
        except StateError:
            for entry in popped:  # TTL entries taken before the refusal must still expire later
                heapq.heappush(state.ttl, entry)
            raise

    def _version(
        self,
        state: SessionState,
        store: GraphStore,
        schema: str,
        record: dict[str, Any],
        late: bool,
        popped: list[tuple[int, str]],
    ) -> dict[str, Any]:
        env = record["envelope"]
        session = state.session_id
        time = max(state.time, int(env["event_time"]))
        ordinal = state.ordinal + 1
        stage = _Stage(store, session)
        expired = self._expire(state, stage, time, popped)
        node_ops, edge_ops, tool, kind = self._operations(stage, schema, record, time)
        rollback_to = record.get("rollback_to") if schema == DELTA else None
        if rollback_to:
            self._rollback(state, stage, rollback_to, time)
        for node_id, upsert in node_ops:
            if upsert is None:
                stage.set_node(node_id, None, "delete")
                continue
            ttl = upsert.get("ttl_seconds")
            rec = NodeRec(
                type=upsert["type"],
                data_json=_canonical_json(upsert.get("data_json") or "{}"),
                from_ordinal=ordinal,
                valid_from=time,
                expires_at=(int(env["event_time"]) + int(ttl) * 1_000_000) if ttl is not None else None,
                caused_by_tool=upsert.get("caused_by_tool", tool),
            )
            stage.set_node(node_id, rec, "upsert")
        for key, data_json in edge_ops:
            stage.set_edge(key, None if data_json is None else EdgeRec(_canonical_json(data_json), ordinal, time))
        node_count = state.node_count + stage.node_delta
        if node_count > self.config.max_nodes:
            raise StateError(f"session {session} would hold {node_count} nodes, over max_nodes={self.config.max_nodes}")
        ops_doc = {
            "kind": kind,
            "nodes": [[i, u] for i, u in node_ops],
            "edges": [[list(k), d] for k, d in edge_ops],
            "rollback_to": rollback_to,
            "expired": expired,
        }
        digest = hashlib.blake2b(
            state.version_id.encode() + b"\n" + orjson.dumps(ops_doc, option=orjson.OPT_SORT_KEYS), digest_size=8
        ).hexdigest()
        version_id = f"{session}.{ordinal}.{digest}"
        node_changes, edge_changes, undo = stage.commit(ordinal, time)
        for node_id, rec in stage.nodes_after():
            if rec is not None and rec.expires_at is not None:
                heapq.heappush(state.ttl, (rec.expires_at, node_id))
        state.undo.append(
            [
                version_id,
                state.version_id,
                {k: (v.to_dict() if v else None) for k, v in undo[0].items()},
                [[*k, v.to_dict() if v else None] for k, v in undo[1].items()],
            ]
        )
        del state.undo[: max(0, len(state.undo) - self.config.history)]
        if len(state.ttl) > 2 * max(node_count, 16):
            state.ttl = [(t, n) for t, n in state.ttl if _expires(store.get_node(session, n)) == t]
            heapq.heapify(state.ttl)
        parent = state.version_id
        state.version_id, state.ordinal, state.time = version_id, ordinal, time
        state.node_count, state.edge_count = node_count, state.edge_count + stage.edge_delta
        return {
            "session_id": session,
            "version_id": version_id,
            "parent_id": parent,
            "ordinal": ordinal,
            "kind": kind,
            "event_id": env["event_id"],
            "seq": int(env["seq"]),
            "logical_event_id": env["logical_event_id"],
            "episode_id": env["episode_id"],
            "tool": tool or None,
            "step": record.get("step") if schema == DISPATCH else None,
            "event_time": time,
            "rollback_to": rollback_to,
            "late": late,
            "node_count": node_count,
            "edge_count": state.edge_count,
            "node_changes": node_changes,
            "edge_changes": edge_changes,
        }

    def _operations(
        self, stage: _Stage, schema: str, record: dict[str, Any], time: int
    ) -> tuple[list[tuple[str, dict[str, Any] | None]], list[tuple[EdgeKey, str | None]], str, str]:
        """(node ops, edge ops, tool, kind) of one event; auto nodes for dispatches and results."""
        env = record["envelope"]
        lid = env["logical_event_id"]
        if schema == DISPATCH:
            data = {"tool": record["tool"], "step": record["step"], "params": orjson.loads(record["params_json"])}
            node = {"type": "action", "data_json": orjson.dumps(data).decode(), "ttl_seconds": None}
            return [(f"action:{lid}", node)], [], record["tool"], "action"
        if schema == RESULT:
            data = {
                "tool": record["tool"],
                "status": record["status"],
                "output": record.get("output", ""),
                "error": record.get("error"),
                "latency_ms": record["latency_ms"],
            }
            node = {"type": "tool_result", "data_json": orjson.dumps(data).decode(), "ttl_seconds": None}
            edge = ((f"action:{lid}", f"result:{lid}", "causes"), "{}")
            return [(f"result:{lid}", node)], [edge], record["tool"], "result"
        nodes: list[tuple[str, dict[str, Any] | None]] = [(n["id"], dict(n)) for n in record.get("node_upserts") or []]
        nodes += [(node_id, None) for node_id in record.get("node_deletes") or []]
        edges: list[tuple[EdgeKey, str | None]] = [
            ((e["src"], e["dst"], e["type"]), e.get("data_json") or "{}") for e in record.get("edge_upserts") or []
        ]
        edges += [((e["src"], e["dst"], e["type"]), None) for e in record.get("edge_deletes") or []]
        tool = ""
        if self.config.auto_nodes and lid != env["event_id"]:  # tied to a step: its action caused these nodes
            action = stage.node(f"action:{lid}")
            if action is not None:
                tool = action.caused_by_tool
                edges += [((f"action:{lid}", node_id, "causes"), "{}") for node_id, up in nodes if up is not None]
        return nodes, edges, tool, "delta"

    def _expire(self, state: SessionState, stage: _Stage, time: int, popped: list[tuple[int, str]]) -> list[str]:
        expired: list[str] = []
        while state.ttl and state.ttl[0][0] <= time:
            expires_at, node_id = heapq.heappop(state.ttl)
            popped.append((expires_at, node_id))
            current = stage.node(node_id)
            if current is not None and current.expires_at == expires_at:
                stage.set_node(node_id, None, "expire")
                expired.append(node_id)
        return sorted(expired)

    def _rollback(self, state: SessionState, stage: _Stage, target: str, time: int) -> None:
        if target == state.version_id:
            return
        chain: list[Undo] = []
        for raw in reversed(state.undo):
            undo = Undo(*raw)
            chain.append(undo)
            if undo.parent_id == target:
                break
        else:
            raise StateError(
                f"rollback_to {target!r} is not among the last {len(state.undo)} versions of session "
                f"{state.session_id} (head {state.version_id})"
            )
        nodes: dict[str, NodeRec | None] = {}
        edges: dict[EdgeKey, EdgeRec | None] = {}
        for undo in chain:  # newest first: older entries overwrite, leaving the values at `target`
            nodes.update({k: (NodeRec.from_dict(v) if v else None) for k, v in undo.nodes.items()})
            edges.update({(a, b, c): (EdgeRec.from_dict(v) if v else None) for a, b, c, v in undo.edges})
        ordinal = state.ordinal + 1
        for node_id, rec in sorted(nodes.items()):
            if rec is not None and rec.expires_at is not None and rec.expires_at <= time:
                rec = None
            restored = None if rec is None else _reopen(rec, ordinal, time)
            stage.set_node(node_id, restored, "restore", only_if_changed=True)
        for key, edge in sorted(edges.items()):
            restored_edge = None if edge is None else EdgeRec(edge.data_json, ordinal, time)
            stage.set_edge(key, restored_edge, op="restore", only_if_changed=True)


def _reopen(rec: NodeRec, ordinal: int, time: int) -> NodeRec:
    return NodeRec(rec.type, rec.data_json, ordinal, time, rec.expires_at, rec.caused_by_tool)


def _expires(rec: NodeRec | None) -> int | None:
    return rec.expires_at if rec else None


def _canonical_json(text: str) -> str:
    """Data as canonical JSON (sorted keys), so equal data hashes and compares equal."""
    return orjson.dumps(orjson.loads(text), option=orjson.OPT_SORT_KEYS).decode()


class _Stage:
    """Changes of one version, staged over the store so a refused event leaves it untouched."""

    def __init__(self, store: GraphStore, session: str) -> None:
        self.store, self.session = store, session
        self._nodes: dict[str, tuple[NodeRec | None, NodeRec | None, str]] = {}  # id -> (before, after, op)
        self._edges: dict[EdgeKey, tuple[EdgeRec | None, EdgeRec | None, str]] = {}
        self.node_delta = 0
        self.edge_delta = 0

    def node(self, node_id: str) -> NodeRec | None:
        if node_id in self._nodes:
            return self._nodes[node_id][1]
        return self.store.get_node(self.session, node_id)

    def set_node(self, node_id: str, rec: NodeRec | None, op: str, only_if_changed: bool = False) -> None:
        before = self._nodes[node_id][0] if node_id in self._nodes else self.store.get_node(self.session, node_id)
        current = self.node(node_id)
        if current is None and rec is None:
            return
        if current is not None and rec is not None and current.content() == rec.content():
            return  # same content: the open interval continues
        if only_if_changed and current is None and rec is None:
            return
        self.node_delta += (rec is not None) - (current is not None)
        self._nodes[node_id] = (before, rec, op)

    def edge(self, key: EdgeKey) -> EdgeRec | None:
        if key in self._edges:
            return self._edges[key][1]
        return self.store.get_edge(self.session, key)

    def set_edge(self, key: EdgeKey, rec: EdgeRec | None, op: str | None = None, only_if_changed: bool = False) -> None:
        before = self._edges[key][0] if key in self._edges else self.store.get_edge(self.session, key)
        current = self.edge(key)
        if current is None and rec is None:
            return
        if current is not None and rec is not None and current.data_json == rec.data_json:
            return
        self.edge_delta += (rec is not None) - (current is not None)
        self._edges[key] = (before, rec, op or ("delete" if rec is None else "upsert"))

    def nodes_after(self) -> Iterable[tuple[str, NodeRec | None]]:
        return ((k, v[1]) for k, v in self._nodes.items())

    def commit(
        self, ordinal: int, time: int
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], tuple[dict[str, NodeRec | None], dict]]:
        node_changes, edge_changes = [], []
        undo_nodes: dict[str, NodeRec | None] = {}
        undo_edges: dict[EdgeKey, EdgeRec | None] = {}
        for node_id in sorted(self._nodes):
            before, after, op = self._nodes[node_id]
            if before is None and after is None:
                continue
            if before is not None and after is not None and before == after:
                continue
            self.store.put_node(self.session, node_id, after)
            undo_nodes[node_id] = before
            node_changes.append(
                {
                    "node_id": node_id,
                    "op": op,
                    "prev": _node_interval(before),
                    "next": _node_interval(after),
                }
            )
        for key in sorted(self._edges):
            before, after, op = self._edges[key]
            if before is None and after is None:
                continue
            self.store.put_edge(self.session, key, after)
            undo_edges[key] = before
            edge_changes.append(
                {
                    "src": key[0],
                    "dst": key[1],
                    "type": key[2],
                    "op": op,
                    "prev": None if before is None else before.to_dict(),
                    "next": None if after is None else after.to_dict(),
                }
            )
        return node_changes, edge_changes, (undo_nodes, undo_edges)


def _node_interval(rec: NodeRec | None) -> dict[str, Any] | None:
    return None if rec is None else rec.to_dict()


def state_of(store: MemoryStore, session: str) -> tuple[dict[str, NodeRec], dict[EdgeKey, EdgeRec]]:
    """A session's live nodes and edges in a MemoryStore."""
    nodes = {n: r for (s, n), r in store.nodes.items() if s == session}
    edges = {k: r for (s, k), r in store.edges.items() if s == session}
    return nodes, edges
