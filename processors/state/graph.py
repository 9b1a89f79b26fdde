"""The versioned state graph as a pure fold: events in, immutable versions (with their changes) out.

Order. Deltas, dispatches and tool results of one session arrive on three topics, so their arrival order
is not the order the agent emitted them. Every event carries the session's `seq`, and the SDK's idempotent
producer writes each topic partition in seq order, so an event with seq s can be applied once each of the
three topics has shown a seq >= s for the session (the *watermark*): until then it waits in a reorder buffer.
Applied order is therefore (seq, event_id) whatever the arrival order. The buffer is released early only by
(a) a flush the caller decides (the oldest buffered event waited long enough; see `flush`), (b) a lifecycle
event other than an end (everything below its seq), or (c) the bounds `max_buffer` / `max_buffer_bytes`. An
event whose seq is below what was already applied is *late*: it is applied at the head, in arrival order,
flagged, never dropped.

End. SESSION_CLOSED / SESSION_ARCHIVED waits in the buffer like any event, so deltas the agent emitted before
it that are still in flight on the other topics are applied first (within the flush wait); once released it
marks the session ended (`SessionState.ended`, its seq). Events after the end make no version: they are
refused with a reason (dead letters), lifecycle events are ignored. The caller may then drop the session's
graph from its store (the worker does; processors/state/processor.py): only the small SessionState remains.

Duplicates. Because each topic delivers a session's events in seq order, an event whose seq is not above the
last seq seen on its topic (`heads`) is a redelivery: it is ignored. Dedup state is therefore a few integers
in SessionState, committed together with everything else.

Versions. Each applied event makes one version `session.ordinal.hash`, where the hash is content-addressed
from the parent version id, the event's operations and the nodes its time expired. Replaying the same
events in the same order gives byte-identical versions.

TTL. A node with ttl_seconds expires at event_time + ttl; expiry is applied at the next version whose time
(max of event times so far) passes it, and recorded as an `expire` change of that version.

Rollback. The last `history` versions are kept in the store (their changes are the undo records), so
`rollback_to` any of them (or the empty genesis version while it is in the window) restores that state as a
new version, then applies the delta.

Memory. SessionState is small and bounded (buffer bounds); nodes, edges, kept versions and the TTL heap
live in a `GraphStore` (RocksDB tables in the worker, dicts in tests and the bench).
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from topics.names import DISPATCH, LIFECYCLE, STATE_DELTA, TOOL_RESULT

STATE_INPUTS = (STATE_DELTA, DISPATCH, TOOL_RESULT, LIFECYCLE)
# Topics whose per-session seq heads make up the watermark.
ORDERED = (STATE_DELTA, DISPATCH, TOOL_RESULT)
_FLUSHING_LIFECYCLE = frozenset({"EPISODE_ENDED", "SESSION_PAUSED", "SESSION_CLOSED", "SESSION_ARCHIVED"})
ENDING_LIFECYCLE = frozenset({"SESSION_CLOSED", "SESSION_ARCHIVED"})


class StateError(ValueError):
    """An event that cannot be folded into the state (bad rollback target, too many nodes...)."""


class StateTooLargeError(StateError):
    """An event whose version record or the session's TTL heap would pass FoldConfig.max_value_bytes."""


@dataclass(frozen=True)
class FoldConfig:
    auto_nodes: bool = True
    max_buffer: int = 1_000
    max_buffer_bytes: int = 256 * 1024
    max_nodes: int = 1_000_000
    history: int = 256
    # Largest table value one event may write (a version record, the TTL heap): TREADLE_MAX_EVENT_BYTES, so every
    # value's changelog record fits the broker. An event that would pass it is refused (StateTooLargeError).
    max_value_bytes: int = 900_000


# NodeRec and EdgeRec are never changed once made, but not frozen=True: a frozen dataclass's __init__ sets each field
# through object.__setattr__ (~1.8 us for a NodeRec against ~1.2), and the fold makes one per changed node and edge.
# unsafe_hash keeps the field-wise hash frozen gave them.
@dataclass(slots=True, unsafe_hash=True)
class NodeRec:
    """A live node and the interval it opened (from_ordinal, valid_from); treat as immutable."""

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


@dataclass(slots=True, unsafe_hash=True)
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
Expiries = list[tuple[int, str]]  # heap of (expires_at, node_id); stale entries are skipped


class GraphStore(Protocol):
    """Where a session's nodes, edges, recent versions and TTL heap live (keys are per session)."""

    def get_node(self, session: str, node_id: str) -> NodeRec | None: ...
    def put_node(self, session: str, node_id: str, rec: NodeRec | None) -> None: ...
    def get_edge(self, session: str, key: EdgeKey) -> EdgeRec | None: ...
    def put_edge(self, session: str, key: EdgeKey, rec: EdgeRec | None) -> None: ...
    def get_version(self, session: str, ordinal: int) -> dict[str, Any] | None: ...
    def put_version(self, session: str, ordinal: int, version: dict[str, Any] | None) -> None: ...
    def get_expiries(self, session: str) -> Expiries: ...
    def put_expiries(self, session: str, heap: Expiries) -> None: ...


class MemoryStore:
    """A GraphStore in dicts, for tests, the bench and rebuilding."""

    def __init__(self) -> None:
        self.nodes: dict[tuple[str, str], NodeRec] = {}
        self.edges: dict[tuple[str, EdgeKey], EdgeRec] = {}
        self.versions: dict[tuple[str, int], dict[str, Any]] = {}
        self.expiries: dict[str, Expiries] = {}

    def get_node(self, session: str, node_id: str) -> NodeRec | None:
        return self.nodes.get((session, node_id))

    def put_node(self, session: str, node_id: str, rec: NodeRec | None) -> None:
        _put(self.nodes, (session, node_id), rec)

    def get_edge(self, session: str, key: EdgeKey) -> EdgeRec | None:
        return self.edges.get((session, key))

    def put_edge(self, session: str, key: EdgeKey, rec: EdgeRec | None) -> None:
        _put(self.edges, (session, key), rec)

    def get_version(self, session: str, ordinal: int) -> dict[str, Any] | None:
        return self.versions.get((session, ordinal))

    def put_version(self, session: str, ordinal: int, version: dict[str, Any] | None) -> None:
        _put(self.versions, (session, ordinal), version)

    def get_expiries(self, session: str) -> Expiries:
        return self.expiries.setdefault(session, [])

    def put_expiries(self, session: str, heap: Expiries) -> None:
        self.expiries[session] = heap


def _put(table: dict[Any, Any], key: Any, value: Any) -> None:
    if value is None:
        table.pop(key, None)
    else:
        table[key] = value


def genesis(session: str) -> str:
    """The id of a session's empty state, before any version."""
    return f"{session}.0.genesis"


def ordinal_of(version_id: str) -> int | None:
    """The ordinal inside `session.ordinal.hash` (session ids may contain dots), or None."""
    parts = version_id.rsplit(".", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


@dataclass
class Pending:
    seq: int
    event_id: str
    schema: str
    record: dict[str, Any]
    size: int = 0  # serialized bytes, for the buffer's byte bound

    def sort_key(self) -> tuple[int, str]:
        return (self.seq, self.event_id)


_SIZE = operator.attrgetter("size")


@dataclass
class Flush:
    """A decided early release: buffered events up to `upto` that had arrived when it was decided.

    `seen` is each ordered topic's head at that moment. On a replay the topics may interleave differently,
    so the flush waits until every head is back there, and then releases only events seen by then, which
    is exactly what it released the first time.
    """

    upto: int
    seen: dict[str, int]


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
    heads: dict[str, int] = field(default_factory=dict)  # last seq seen per input schema
    buffer: list[Pending] = field(default_factory=list)  # sorted by (seq, event_id); change it with buffer_*
    flushes: list[Flush] = field(default_factory=list)  # decided, waiting for their events (replays only)
    next_expiry: int | None = None  # earliest TTL in the store's heap, so the heap is read only when due
    ended: int | None = None  # seq of the SESSION_CLOSED/ARCHIVED that ended the session; nothing applies after

    def __post_init__(self) -> None:
        if not self.version_id:
            self.version_id = genesis(self.session_id)
        self._buffered = sum(map(_SIZE, self.buffer))  # kept by the buffer_* methods: checked after every event

    def to_dict(self) -> dict[str, Any]:
        return {
            "s": self.session_id,
            "v": self.version_id,
            "o": self.ordinal,
            "t": self.time,
            "a": self.applied_seq,
            "n": self.node_count,
            "e": self.edge_count,
            "h": self.heads,
            "b": [[p.seq, p.event_id, p.schema, p.record, p.size] for p in self.buffer],
            "f": [[f.upto, f.seen] for f in self.flushes],
            "x": self.next_expiry,
            "z": self.ended,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SessionState:
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
            flushes=[Flush(u, s) for u, s in d["f"]],
            next_expiry=d["x"],
            ended=d.get("z"),
        )

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.to_dict())

    @classmethod
    def from_bytes(cls, data: bytes) -> SessionState:
        return cls.from_dict(orjson.loads(data))

    def buffer_bytes(self) -> int:
        return self._buffered

    def buffer_insert(self, pending: Pending) -> None:
        bisect.insort(self.buffer, pending, key=Pending.sort_key)
        self._buffered += pending.size

    def buffer_pop(self) -> Pending:
        pending = self.buffer.pop(0)
        self._buffered -= pending.size
        return pending

    def buffer_replace(self, buffer: list[Pending]) -> None:
        self.buffer = buffer
        self._buffered = sum(map(_SIZE, buffer))

    def ended_reason(self) -> str:
        return (
            f"session {self.session_id} ended (closed at seq {self.ended}, final version {self.version_id}); "
            "events after the end are not applied"
        )


Rejected = tuple[str, dict[str, Any], str]  # (schema, record, reason)


@dataclass
class FoldOutput:
    """Versions made by one call (StateVersion records, in order) and events refused at apply time."""

    versions: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    duplicate: bool = False

    def extend(self, other: FoldOutput) -> FoldOutput:
        self.versions += other.versions
        self.rejected += other.rejected
        return self


class StateFold:
    """Applies events to a SessionState + GraphStore; deterministic for a given event order."""

    def __init__(self, config: FoldConfig | None = None) -> None:
        self.config = config or FoldConfig()

    # -- intake and ordering ----------------------------------------------------------------------

    def accept(
        self, state: SessionState, store: GraphStore, schema: str, record: dict[str, Any], *, apply: bool = True
    ) -> FoldOutput:
        """Take one validated event: ignore a redelivery, buffer it, and apply what the watermark releases.

        `apply=False` records that the event was seen (its topic passed its seq) without applying it: for an
        event refused before folding (it went to dead letters), so it neither holds the watermark back nor
        counts as new when redelivered.
        """
        env = record["envelope"]
        event_id, seq = env["event_id"], int(env["seq"])
        if seq <= state.heads.get(schema, -1):
            return FoldOutput(duplicate=True)
        state.heads[schema] = seq
        out = FoldOutput()
        if state.ended is not None:
            # Without auto nodes, dispatches and tool results are no state events: nothing to refuse.
            if apply and schema != LIFECYCLE and (self.config.auto_nodes or schema == STATE_DELTA):
                out.rejected.append((schema, record, state.ended_reason()))
            return out
        ending = schema == LIFECYCLE and record.get("kind") in ENDING_LIFECYCLE
        if schema == LIFECYCLE:
            if apply and record.get("kind") in _FLUSHING_LIFECYCLE and not ending:
                out.extend(self._release(state, store, lambda p: p.seq < seq))
            if not (apply and ending):
                return out.extend(self._after_heads(state, store))
        if apply and (self.config.auto_nodes or schema == STATE_DELTA or ending):
            pending = Pending(seq, event_id, schema, record, len(orjson.dumps(record)))
            if seq <= state.applied_seq:  # late: its place in the order has passed
                self._apply_one(state, store, pending, out, late=True)
            else:
                state.buffer_insert(pending)
        return out.extend(self._after_heads(state, store))

    def _after_heads(self, state: SessionState, store: GraphStore) -> FoldOutput:
        """Release what the new heads allow: waiting flushes, then the watermark, then the bounds."""
        out = FoldOutput()
        while state.flushes and _heads_reached(state, state.flushes[0].seen):
            out.extend(self._flush_now(state, store, state.flushes.pop(0)))
        mark = self.watermark(state)
        out.extend(self._release(state, store, lambda p: p.seq <= mark))
        while state.buffer and (
            len(state.buffer) > self.config.max_buffer or state.buffer_bytes() > self.config.max_buffer_bytes
        ):
            cut = state.buffer[0].seq
            out.extend(self._release(state, store, lambda p, cut=cut: p.seq <= cut))
        return out

    def watermark(self, state: SessionState) -> int:
        """The highest seq every ordered topic has passed for this session (-1 until all have shown one)."""
        if not self.config.auto_nodes:
            return state.heads.get(STATE_DELTA, -1)
        return min(state.heads.get(topic, -1) for topic in ORDERED)

    def flush_request(self, state: SessionState) -> Flush | None:
        """The flush to decide now for a session whose buffer waited too long (None if it is empty)."""
        if not state.buffer:
            return None
        return Flush(upto=state.buffer[-1].seq, seen={t: state.heads.get(t, -1) for t in (*ORDERED, LIFECYCLE)})

    def flush(self, state: SessionState, store: GraphStore, request: Flush) -> FoldOutput:
        """Apply a decided flush now if its events are all here, else keep it until they are."""
        if state.flushes or not _heads_reached(state, request.seen):
            state.flushes.append(request)
            return self._after_heads(state, store)
        return self._flush_now(state, store, request)

    def _flush_now(self, state: SessionState, store: GraphStore, request: Flush) -> FoldOutput:
        seen = request.seen
        out = self._release_matching(
            state, store, lambda p: p.seq <= request.upto and p.seq <= seen.get(p.schema, request.upto)
        )
        # Events still buffered below what is now applied arrived after the flush the first time: late.
        return out.extend(self._release_matching(state, store, lambda p: p.seq <= state.applied_seq, late=True))

    def _release(self, state: SessionState, store: GraphStore, ready: Callable[[Pending], bool]) -> FoldOutput:
        """Apply buffered events from the front while `ready` holds."""
        out = FoldOutput()
        while state.buffer and ready(state.buffer[0]):
            self._apply_one(state, store, state.buffer_pop(), out, late=False)
        return out

    def _release_matching(
        self, state: SessionState, store: GraphStore, ready: Callable[[Pending], bool], late: bool = False
    ) -> FoldOutput:
        """Apply every buffered event for which `ready` holds, in buffer order."""
        out = FoldOutput()
        chosen = [p for p in state.buffer if ready(p)]
        if chosen:
            state.buffer_replace([p for p in state.buffer if not ready(p)])
            for pending in chosen:
                self._apply_one(state, store, pending, out, late=late and pending.seq <= state.applied_seq)
        return out

    def _apply_one(self, state: SessionState, store: GraphStore, pending: Pending, out: FoldOutput, *, late: bool):
        if pending.schema == LIFECYCLE:  # an ending lifecycle event (the only kind buffered)
            if state.ended is None:  # what still waits came after the end: refused now, not kept
                state.ended = pending.seq
                reason = state.ended_reason()
                out.rejected += [(p.schema, p.record, reason) for p in state.buffer if p.schema != LIFECYCLE]
                state.flushes = []
                state.buffer_replace([])
            return
        if state.ended is not None:
            out.rejected.append((pending.schema, pending.record, state.ended_reason()))
            return
        state.applied_seq = max(state.applied_seq, pending.seq)
        try:
            out.versions.append(self.apply(state, store, pending.schema, pending.record, late=late))
        except StateError as exc:
            out.rejected.append((pending.schema, pending.record, str(exc)))

    # -- one version ------------------------------------------------------------------------------

    def apply(
        self, state: SessionState, store: GraphStore, schema: str, record: dict[str, Any], *, late: bool = False
    ) -> dict[str, Any]:
        """Apply one event now, making one version; raises StateError (state and store unchanged) if it cannot."""
        time = max(state.time, int(record["envelope"]["event_time"]))
        due = state.next_expiry is not None and state.next_expiry <= time
        heap = store.get_expiries(state.session_id) if due else None
        popped: Expiries = []
        try:
            return self._version(state, store, schema, record, time, heap, popped, late)
        except StateError:
            for entry in popped:  # TTL entries taken before the refusal must still expire later
                heapq.heappush(heap, entry)  # type: ignore[arg-type]
            raise

    def _version(
        self,
        state: SessionState,
        store: GraphStore,
        schema: str,
        record: dict[str, Any],
        time: int,
        heap: Expiries | None,
        popped: Expiries,
        late: bool,
    ) -> dict[str, Any]:
        env = record["envelope"]
        session = state.session_id
        ordinal = state.ordinal + 1
        stage = _Stage(store, session)
        expired = _expire(heap, stage, time, popped) if heap is not None else []
        node_ops, edge_ops, tool, kind, auto_data = self._operations(stage, schema, record)
        rollback_to = record.get("rollback_to") if schema == STATE_DELTA else None
        if rollback_to:
            self._rollback(state, stage, rollback_to, time)
        for node_id, upsert in node_ops:
            if upsert is None:
                stage.set_node(node_id, None, "delete")
                continue
            ttl = upsert.get("ttl_seconds")
            rec = NodeRec(
                type=upsert["type"],
                data_json=auto_data or _canonical_json(upsert.get("data_json") or "{}"),
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
        # orjson writes the (id, upsert) and (key, data) tuples as the arrays the hash has always covered.
        ops_doc = {"kind": kind, "nodes": node_ops, "edges": edge_ops, "rollback_to": rollback_to, "expired": expired}
        digest = hashlib.blake2b(
            state.version_id.encode() + b"\n" + orjson.dumps(ops_doc, option=orjson.OPT_SORT_KEYS), digest_size=8
        ).hexdigest()
        version_id = f"{session}.{ordinal}.{digest}"
        expiries = self._next_expiries(state, store, stage, heap, node_count)
        self._check_sizes(session, stage, expiries)
        # Nothing below raises: the store is written only for a version that is made.
        node_changes, edge_changes = stage.commit()
        if expiries is not None:
            store.put_expiries(session, expiries)
            state.next_expiry = expiries[0][0] if expiries else None
        parent = state.version_id
        state.version_id, state.ordinal, state.time = version_id, ordinal, time
        state.node_count, state.edge_count = node_count, state.edge_count + stage.edge_delta
        version = {
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
        store.put_version(session, ordinal, version)
        if ordinal > self.config.history:
            store.put_version(session, ordinal - self.config.history, None)
        return version

    def _next_expiries(
        self, state: SessionState, store: GraphStore, stage: _Stage, heap: Expiries | None, node_count: int
    ) -> Expiries | None:
        """The TTL heap to save with the new TTLs pushed (a copy; None when unchanged): it is read only when
        something expires or gets a TTL."""
        fresh = [(rec.expires_at, node_id) for node_id, rec in stage.nodes_after() if rec and rec.expires_at]
        if heap is None and not fresh:
            return None
        heap = list(heap if heap is not None else store.get_expiries(state.session_id))
        for entry in fresh:
            heapq.heappush(heap, entry)
        if len(heap) > 2 * max(node_count, 16):  # drop entries of nodes since replaced or deleted
            heap[:] = [(t, n) for t, n in heap if _expiry(stage.node(n)) == t]
            heapq.heapify(heap)
        return heap

    def _check_sizes(self, session: str, stage: _Stage, expiries: Expiries | None) -> None:
        """Refuse an event whose version record or TTL heap would pass max_value_bytes (before anything is
        written). Measured exactly only when a cheap upper bound could pass it."""
        limit = self.config.max_value_bytes
        if stage.size_bound() > limit and (size := stage.size()) > limit:
            raise StateTooLargeError(
                f"the version this event makes in session {session} would be {size:,} bytes, past the "
                f"{limit:,}-byte limit (TREADLE_MAX_EVENT_BYTES) of one state table value; the event is refused"
            )
        if expiries is not None and len(expiries) * 24 > limit // 2:  # entries: [time, "node id"]
            size = len(orjson.dumps(expiries))
            if size > limit:
                raise StateTooLargeError(
                    f"session {session}'s TTL index would be {size:,} bytes ({len(expiries):,} nodes with a TTL), "
                    f"past the {limit:,}-byte limit (TREADLE_MAX_EVENT_BYTES) of one state table value; the event "
                    "is refused"
                )

    def _operations(
        self, stage: _Stage, schema: str, record: dict[str, Any]
    ) -> tuple[list[tuple[str, dict[str, Any] | None]], list[tuple[EdgeKey, str | None]], str, str, str]:
        """(node ops, edge ops, tool, kind, auto data) of one event; auto nodes for dispatches and results.

        An auto node's data is encoded twice from the object (as hashed, and canonical for its NodeRec) rather
        than canonicalised by parsing it back; "" for a delta, whose upserts carry their own data_json.
        """
        env = record["envelope"]
        lid = env["logical_event_id"]
        if schema == DISPATCH:
            data = {"tool": record["tool"], "step": record["step"], "params": orjson.loads(record["params_json"])}
            node = {"type": "action", "data_json": orjson.dumps(data).decode(), "ttl_seconds": None}
            return [(f"action:{lid}", node)], [], record["tool"], "action", _canonical_dumps(data)
        if schema == TOOL_RESULT:
            data = {
                "tool": record["tool"],
                "status": record["status"],
                "output": record.get("output", ""),
                "error": record.get("error"),
                "latency_ms": record["latency_ms"],
            }
            node = {"type": "tool_result", "data_json": orjson.dumps(data).decode(), "ttl_seconds": None}
            edge = ((f"action:{lid}", f"result:{lid}", "causes"), "{}")
            return [(f"result:{lid}", node)], [edge], record["tool"], "result", _canonical_dumps(data)
        nodes: list[tuple[str, dict[str, Any] | None]] = [(n["id"], n) for n in record.get("node_upserts") or []]
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
        return nodes, edges, tool, "delta", ""

    def _rollback(self, state: SessionState, stage: _Stage, target: str, time: int) -> None:
        if target == state.version_id:
            return
        target_ordinal = ordinal_of(target)
        window = min(state.ordinal, self.config.history)
        if target_ordinal is None or not state.ordinal - window <= target_ordinal < state.ordinal:
            raise StateError(
                f"rollback_to {target!r} is not among the last {window} versions of session "
                f"{state.session_id} (head {state.version_id})"
            )
        nodes: dict[str, NodeRec | None] = {}
        edges: dict[EdgeKey, EdgeRec | None] = {}
        for ordinal in range(state.ordinal, target_ordinal, -1):  # newest first: older values overwrite
            version = stage.store.get_version(state.session_id, ordinal)
            if version is None:
                raise StateError(f"rollback_to {target!r}: version {ordinal} of {state.session_id} is not kept")
            if ordinal == target_ordinal + 1 and version["parent_id"] != target:
                raise StateError(
                    f"rollback_to {target!r} is not among the last {window} versions of session "
                    f"{state.session_id} (head {state.version_id})"
                )
            for c in version["node_changes"]:
                nodes[c["node_id"]] = NodeRec.from_dict(c["prev"]) if c["prev"] else None
            for c in version["edge_changes"]:
                edges[(c["src"], c["dst"], c["type"])] = EdgeRec.from_dict(c["prev"]) if c["prev"] else None
        ordinal = state.ordinal + 1
        for node_id, rec in sorted(nodes.items()):
            if rec is not None and rec.expires_at is not None and rec.expires_at <= time:
                rec = None
            restored = None if rec is None else _reopen(rec, ordinal, time)
            stage.set_node(node_id, restored, "restore")
        for key, edge in sorted(edges.items()):
            restored_edge = None if edge is None else EdgeRec(edge.data_json, ordinal, time)
            stage.set_edge(key, restored_edge, op="restore")


def _heads_reached(state: SessionState, seen: dict[str, int]) -> bool:
    return all(state.heads.get(topic, -1) >= seq for topic, seq in seen.items())


def _expire(heap: Expiries, stage: _Stage, time: int, popped: Expiries) -> list[str]:
    """Pop the TTL entries due by `time`; live nodes they still describe are staged as `expire` changes."""
    expired: list[str] = []
    while heap and heap[0][0] <= time:
        expires_at, node_id = heapq.heappop(heap)
        popped.append((expires_at, node_id))
        current = stage.node(node_id)
        if current is not None and current.expires_at == expires_at:
            stage.set_node(node_id, None, "expire")
            expired.append(node_id)
    return sorted(expired)


def _reopen(rec: NodeRec, ordinal: int, time: int) -> NodeRec:
    return NodeRec(rec.type, rec.data_json, ordinal, time, rec.expires_at, rec.caused_by_tool)


def _expiry(rec: NodeRec | None) -> int | None:
    return rec.expires_at if rec else None


def _canonical_json(text: str) -> str:
    """Data as canonical JSON (sorted keys), so equal data hashes and compares equal."""
    if text == "{}":  # most edges
        return text
    return orjson.dumps(orjson.loads(text), option=orjson.OPT_SORT_KEYS).decode()


def _canonical_dumps(data: Any) -> str:
    """`_canonical_json` of data still in hand (no parse)."""
    return orjson.dumps(data, option=orjson.OPT_SORT_KEYS).decode()


class _Stage:
    """Changes of one version, staged over the store so a refused event leaves it untouched."""

    def __init__(self, store: GraphStore, session: str) -> None:
        self.store, self.session = store, session
        self._nodes: dict[str, tuple[NodeRec | None, NodeRec | None, str]] = {}  # id -> (before, after, op)
        self._edges: dict[EdgeKey, tuple[EdgeRec | None, EdgeRec | None, str]] = {}
        self.node_delta = 0
        self.edge_delta = 0
        self._bound = 512  # size_bound's bytes, counted as changes are staged

    def node(self, node_id: str) -> NodeRec | None:
        if node_id in self._nodes:
            return self._nodes[node_id][1]
        return self.store.get_node(self.session, node_id)

    def set_node(self, node_id: str, rec: NodeRec | None, op: str) -> None:
        staged = self._nodes.get(node_id)
        if staged is None:
            before = current = self.store.get_node(self.session, node_id)
        else:
            before, current = staged[0], staged[1]
        if current is None and rec is None:
            return
        if current is not None and rec is not None and current.content() == rec.content():
            return  # same content: the open interval continues
        self.node_delta += (rec is not None) - (current is not None)
        self._grow_bound(len(node_id), before, staged is None, rec)
        self._nodes[node_id] = (before, rec, op)

    def edge(self, key: EdgeKey) -> EdgeRec | None:
        if key in self._edges:
            return self._edges[key][1]
        return self.store.get_edge(self.session, key)

    def set_edge(self, key: EdgeKey, rec: EdgeRec | None, op: str | None = None) -> None:
        staged = self._edges.get(key)
        if staged is None:
            before = current = self.store.get_edge(self.session, key)
        else:
            before, current = staged[0], staged[1]
        if current is None and rec is None:
            return
        if current is not None and rec is not None and current.data_json == rec.data_json:
            return
        self.edge_delta += (rec is not None) - (current is not None)
        self._grow_bound(len(key[0]) + len(key[1]) + len(key[2]), before, staged is None, rec)
        self._edges[key] = (before, rec, op or ("delete" if rec is None else "upsert"))

    def _grow_bound(
        self, key_bytes: int, before: NodeRec | EdgeRec | None, first: bool, rec: NodeRec | EdgeRec | None
    ) -> None:
        """size_bound's share of one staged change: the key and its data before, the first time the key is staged;
        the data it is set to, every time."""
        if first:
            self._bound += 512 + 2 * (key_bytes + (len(before.data_json) if before is not None else 0))
        if rec is not None:
            self._bound += 2 * len(rec.data_json)

    def nodes_after(self) -> Iterable[tuple[str, NodeRec | None]]:
        return ((k, v[1]) for k, v in self._nodes.items())

    def size_bound(self) -> int:
        """An upper bound of the staged changes' bytes in a version record (JSON may escape every data byte):
        every key and its data before and after each set, counted as staged (a key set twice counts both values,
        so it bounds what summing the final staged values would), instead of summed again per version."""
        return self._bound

    def size(self) -> int:
        """The staged changes' bytes in a version record (as `commit` will list them), measured."""
        changes = [_node_change(n, *staged) for n, staged in self._nodes.items() if staged[0] != staged[1]]
        changes += [_edge_change(k, *staged) for k, staged in self._edges.items() if staged[0] != staged[1]]
        return len(orjson.dumps(changes)) + 1024  # and the version's other fields

    def commit(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Write the staged changes to the store; returns (node changes, edge changes) sorted by key."""
        node_changes, edge_changes = [], []
        for node_id in sorted(self._nodes):
            before, after, op = self._nodes[node_id]
            if before == after:
                continue
            self.store.put_node(self.session, node_id, after)
            node_changes.append(_node_change(node_id, before, after, op))
        for key in sorted(self._edges):
            before, after, op = self._edges[key]
            if before == after:
                continue
            self.store.put_edge(self.session, key, after)
            edge_changes.append(_edge_change(key, before, after, op))
        return node_changes, edge_changes


def _node_change(node_id: str, before: NodeRec | None, after: NodeRec | None, op: str) -> dict[str, Any]:
    """A node's change as a StateVersion lists it."""
    return {"node_id": node_id, "op": op, "prev": before and before.to_dict(), "next": after and after.to_dict()}


def _edge_change(key: EdgeKey, before: EdgeRec | None, after: EdgeRec | None, op: str) -> dict[str, Any]:
    """An edge's change as a StateVersion lists it."""
    return {
        "src": key[0],
        "dst": key[1],
        "type": key[2],
        "op": op,
        "prev": before and before.to_dict(),
        "next": after and after.to_dict(),
    }


def apply_changes(store: GraphStore, version: dict[str, Any]) -> None:
    """Write one version's changes to a store (re-materializing a committed version after a crash)."""
    session = version["session_id"]
    for c in version["node_changes"]:
        store.put_node(session, c["node_id"], NodeRec.from_dict(c["next"]) if c["next"] else None)
    for c in version["edge_changes"]:
        store.put_edge(session, (c["src"], c["dst"], c["type"]), EdgeRec.from_dict(c["next"]) if c["next"] else None)


def state_of(store: MemoryStore, session: str) -> tuple[dict[str, NodeRec], dict[EdgeKey, EdgeRec]]:
    """A session's live nodes and edges in a MemoryStore."""
    nodes = {n: r for (s, n), r in store.nodes.items() if s == session}
    edges = {k: r for (s, k), r in store.edges.items() if s == session}
    return nodes, edges
