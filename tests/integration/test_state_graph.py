"""The state fold against an independent oracle: random deltas, auto nodes, rollbacks, TTL expiry, deletes,
duplicates and arrival orders that interleave the three topics differently (each topic in seq order, as
Kafka delivers one partition)."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from processors.state.graph import (
    FoldConfig,
    FoldOutput,
    MemoryStore,
    SessionState,
    StateFold,
    apply_changes,
    genesis,
    state_of,
)
from sinks.rows import rows_for
from topics.codec import AvroCodec
from topics.names import DISPATCH, LIFECYCLE, STATE_DELTA, TOOL_RESULT
from topics.node_types import NodeTypes, breaking_changes

SESSION = "sess-a"
T0 = 1_760_000_000_000_000
NODE_IDS = [f"n{i}" for i in range(6)]


def env(seq: int, t: int, lid: str | None = None, session: str = SESSION) -> dict[str, Any]:
    event_id = f"{session}-e{seq:05d}"
    return {
        "event_id": event_id,
        "session_id": session,
        "agent_id": "a",
        "episode_id": "ep",
        "logical_event_id": lid or event_id,
        "seq": seq,
        "event_time": t,
        "policy_version": "",
        "trace_id": "",
        "attributes": {},
    }


def delta(
    seq: int, t: int, *, ups=(), dels=(), edges=(), edel=(), rollback=None, lid=None, session: str = SESSION
) -> dict[str, Any]:
    return {
        "envelope": env(seq, t, lid, session),
        "node_upserts": [
            {"id": i, "type": ty, "data_json": orjson.dumps(d).decode(), "ttl_seconds": ttl} for i, ty, d, ttl in ups
        ],
        "node_deletes": list(dels),
        "edge_upserts": [{"src": s, "dst": d, "type": k, "data_json": "{}"} for s, d, k in edges],
        "edge_deletes": [{"src": s, "dst": d, "type": k, "data_json": "{}"} for s, d, k in edel],
        "rollback_to": rollback,
    }


def dispatch(seq: int, t: int, lid: str, tool: str, session: str = SESSION) -> dict[str, Any]:
    return {
        "envelope": env(seq, t, lid, session),
        "step": seq,
        "tool": tool,
        "params_json": '{"q": 1}',
        "deadline": None,
    }


def result(seq: int, t: int, lid: str, tool: str, session: str = SESSION) -> dict[str, Any]:
    return {
        "envelope": env(seq, t, lid, session),
        "tool": tool,
        "status": "OK",
        "output": "out",
        "error": None,
        "latency_ms": 1.5,
        "cost_usd": 0.0,
        "tokens_in": 0,
        "tokens_out": 0,
        "retries": 0,
    }


# -- the oracle: full snapshots, written from the documented semantics --------------------------------


@dataclass
class Oracle:
    history: int
    nodes: dict[str, tuple[str, str, int | None]] = field(default_factory=dict)  # id -> (type, data, expires)
    edges: set[tuple[str, str, str]] = field(default_factory=set)
    time: int = 0
    snapshots: list[tuple[dict, set]] = field(default_factory=list)  # index = ordinal (0 = genesis)

    def __post_init__(self) -> None:
        self.snapshots.append(({}, set()))

    def apply(self, schema: str, record: dict[str, Any], target_ordinal: int | None) -> bool:
        e = record["envelope"]
        t = max(self.time, e["event_time"])
        nodes = {k: v for k, v in self.nodes.items() if v[2] is None or v[2] > t}
        edges = set(self.edges)
        if schema == DISPATCH:
            data = {"tool": record["tool"], "step": record["step"], "params": {"q": 1}}
            nodes[f"action:{e['logical_event_id']}"] = ("action", canon(data), None)
        elif schema == TOOL_RESULT:
            lid = e["logical_event_id"]
            data = {"tool": record["tool"], "status": "OK", "output": "out", "error": None, "latency_ms": 1.5}
            nodes[f"result:{lid}"] = ("tool_result", canon(data), None)
            edges.add((f"action:{lid}", f"result:{lid}", "causes"))
        else:
            if record["rollback_to"]:
                if target_ordinal is None or len(self.snapshots) - 1 - target_ordinal > self.history:
                    return False
                snap_nodes, snap_edges = self.snapshots[target_ordinal]
                nodes = {k: v for k, v in snap_nodes.items() if v[2] is None or v[2] > t}
                edges = set(snap_edges)
            for u in record["node_upserts"]:
                ttl = u["ttl_seconds"]
                nodes[u["id"]] = (
                    u["type"],
                    canon(orjson.loads(u["data_json"])),
                    None if ttl is None else e["event_time"] + ttl * 1_000_000,
                )
            for i in record["node_deletes"]:
                nodes.pop(i, None)
            for x in record["edge_upserts"]:
                edges.add((x["src"], x["dst"], x["type"]))
            for x in record["edge_deletes"]:
                edges.discard((x["src"], x["dst"], x["type"]))
            lid = e["logical_event_id"]
            if lid != e["event_id"] and f"action:{lid}" in nodes:
                edges |= {(f"action:{lid}", u["id"], "causes") for u in record["node_upserts"]}
        self.nodes, self.edges, self.time = nodes, edges, t
        self.snapshots.append((dict(nodes), set(edges)))
        return True

    def view(self, ordinal: int) -> tuple[dict[str, tuple[str, str]], set]:
        nodes, edges = self.snapshots[ordinal]
        return {k: (v[0], v[1]) for k, v in nodes.items()}, edges


def canon(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


# -- workloads -----------------------------------------------------------------------------------------

op_strategy = st.lists(
    st.one_of(
        st.tuples(
            st.just("delta"),
            st.lists(
                st.tuples(
                    st.sampled_from(NODE_IDS),
                    st.sampled_from(["note", "doc"]),
                    st.integers(0, 3),
                    st.one_of(st.none(), st.integers(1, 20)),
                ),
                max_size=3,
            ),
            st.lists(st.sampled_from(NODE_IDS), max_size=2),
            st.lists(st.tuples(st.sampled_from(NODE_IDS), st.sampled_from(NODE_IDS)), max_size=2),
            st.lists(st.tuples(st.sampled_from(NODE_IDS), st.sampled_from(NODE_IDS)), max_size=1),
            st.booleans(),
        ),
        st.tuples(st.just("step"), st.sampled_from(["search", "write"]), st.booleans()),
        st.tuples(st.just("rollback"), st.integers(0, 6)),
        st.tuples(st.just("sleep"), st.integers(1, 15)),
    ),
    min_size=1,
    max_size=40,
)


def build(
    ops: list[tuple], history: int, session: str = SESSION, t0: int = T0
) -> tuple[list[tuple[str, dict]], Oracle, list[str]]:
    """Events in seq order, with rollback targets taken from a reference fold run in that order; and its ids."""
    ref_fold, ref_state, ref_store = StateFold(FoldConfig(history=history)), SessionState(session), MemoryStore()
    ids = [genesis(session)]
    oracle = Oracle(history)
    events: list[tuple[str, dict]] = []
    seq, t, last_lid = 0, t0, None

    def emit(schema: str, record: dict, target: int | None = None) -> None:
        nonlocal seq
        events.append((schema, record))
        seq += 1
        if oracle.apply(schema, record, target):
            version = ref_fold.apply(ref_state, ref_store, schema, record)
            ids.append(version["version_id"])
        else:
            ref_fold._apply_one(ref_state, ref_store, _pending(schema, record), FoldOutput(), late=False)

    for op in ops:
        t += 1_000_000
        if op[0] == "delta":
            _, ups, dels, edges, edel, tied = op
            ups = [(i, ty, {"v": v}, ttl) for i, ty, v, ttl in ups]
            emit(
                STATE_DELTA,
                delta(seq, t, ups=ups, dels=dels, edges=[(a, b, "references") for a, b in edges],
                      edel=[(a, b, "references") for a, b in edel], lid=last_lid if tied else None, session=session),
            )  # fmt: skip
        elif op[0] == "step":
            lid = f"{session}-step-{seq}"
            emit(DISPATCH, dispatch(seq, t, lid, op[1], session))
            if op[2]:
                emit(TOOL_RESULT, result(seq, t + 10, lid, op[1], session))
            last_lid = lid
        elif op[0] == "rollback":
            target = max(0, len(ids) - 1 - op[1])
            emit(STATE_DELTA, delta(seq, t, rollback=ids[target], session=session), target)
        else:
            t += op[1] * 1_000_000
    return events, oracle, ids


def _pending(schema: str, record: dict):
    from processors.state.graph import Pending

    return Pending(record["envelope"]["seq"], record["envelope"]["event_id"], schema, record)


def arrival(events: list[tuple[str, dict]], rng: random.Random, dup_rate: float) -> list[tuple[str, dict]]:
    """Interleave the three topics at random, each in seq order, with some duplicate deliveries."""
    queues = {s: [e for e in events if e[0] == s] for s in (STATE_DELTA, DISPATCH, TOOL_RESULT)}
    out = []
    while any(queues.values()):
        schema = rng.choice([s for s, q in queues.items() if q])
        item = queues[schema].pop(0)
        out.append(item)
        if rng.random() < dup_rate:
            out.append(item)
    return out


def run(arrived: list[tuple[str, dict]], history: int, roundtrip: bool = True):
    fold, state, store = StateFold(FoldConfig(history=history)), SessionState(SESSION), MemoryStore()
    versions, rejected = [], []
    for schema, record in arrived:
        out = fold.accept(state, store, schema, record)
        versions += out.versions
        rejected += out.rejected
        if roundtrip:
            state = SessionState.from_bytes(state.to_bytes())
    request = fold.flush_request(state)
    out = fold.flush(state, store, request) if request is not None else FoldOutput()
    return versions + out.versions, rejected + out.rejected, state, store


def replay_changes(versions: list[dict]) -> list[tuple[dict, set]]:
    """State at every ordinal rebuilt from the versions' changes alone (what Redis and ClickHouse get)."""
    nodes: dict[str, tuple[str, str]] = {}
    edges: set = set()
    states = [({}, set())]
    for v in versions:
        for c in v["node_changes"]:
            if c["next"] is None:
                nodes.pop(c["node_id"], None)
            else:
                nodes[c["node_id"]] = (c["next"]["type"], c["next"]["data_json"])
        for c in v["edge_changes"]:
            key = (c["src"], c["dst"], c["type"])
            edges.discard(key) if c["next"] is None else edges.add(key)
        states.append((dict(nodes), set(edges)))
    return states


def rows_at(versions: list[dict], ordinal: int) -> tuple[dict, set]:
    """State at an ordinal from the ClickHouse rows, evaluated as treadle/state/history.py's SQL does:
    intervals opened by then, less those ended by then (a replayed row is the same row)."""
    tables: dict[str, list[dict]] = {}
    for v in versions:
        for table, row in rows_for("state_versions", v):
            tables.setdefault(table, []).append(row)
    node_ends = {
        (r["node_id"], r["from_ordinal"]) for r in tables.get("state_node_ends", []) if r["to_ordinal"] <= ordinal
    }
    edge_ends = {
        (r["src"], r["dst"], r["type"], r["from_ordinal"])
        for r in tables.get("state_edge_ends", [])
        if r["to_ordinal"] <= ordinal
    }
    nodes = {
        r["node_id"]: (r["type"], r["data_json"])
        for r in tables.get("state_nodes", [])
        if r["from_ordinal"] <= ordinal and (r["node_id"], r["from_ordinal"]) not in node_ends
    }
    edges = {
        (r["src"], r["dst"], r["type"])
        for r in tables.get("state_edges", [])
        if r["from_ordinal"] <= ordinal and (r["src"], r["dst"], r["type"], r["from_ordinal"]) not in edge_ends
    }
    return nodes, edges


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=op_strategy, seed=st.integers(0, 2**32), history=st.sampled_from([3, 256]))
@example(  # a refused rollback once lost the TTL entries its version had already taken
    ops=[("delta", [], [], [], [], False), ("delta", [], [], [], [], False),
         ("delta", [("n0", "note", 0, 2)], [], [], [], False), ("rollback", 0), ("rollback", 4),
         ("delta", [], [], [], [], False)],
    seed=0,
    history=3,
)  # fmt: skip
def test_every_version_equals_the_oracle_whatever_the_arrival_order(ops, seed, history):
    events, oracle, _ = build(ops, history)
    rng = random.Random(seed)
    first, rejected, _, _ = run(arrival(events, rng, 0.1), history)
    second, _, _, _ = run(arrival(events, rng, 0.0), history, roundtrip=False)
    assert [v["version_id"] for v in first] == [v["version_id"] for v in second]
    assert [v["ordinal"] for v in first] == list(range(1, len(first) + 1))
    assert len(first) == len(oracle.snapshots) - 1
    assert all(not v["late"] for v in first)
    rebuilt = replay_changes(first)
    for ordinal in range(len(oracle.snapshots)):
        assert rebuilt[ordinal] == oracle.view(ordinal), f"ordinal {ordinal}"
        if ordinal:
            assert first[ordinal - 1]["node_count"] == len(oracle.snapshots[ordinal][0])
    for ordinal in range(1, len(oracle.snapshots)):
        assert rows_at(first, ordinal) == oracle.view(ordinal), f"rows at ordinal {ordinal}"
    assert len(rejected) == sum(1 for s, r in events if s == STATE_DELTA and r["rollback_to"]) - sum(
        1 for v in first if v["rollback_to"]
    )
    codec = AvroCodec()
    for v in first:  # every version is a valid StateVersion on the wire
        assert codec.decode(codec.encode("treadle.derived.StateVersion", v))[1]["version_id"] == v["version_id"]


def test_ttl_expiry_closes_the_interval_at_the_expiry_time():
    fold, state, store = StateFold(), SessionState(SESSION), MemoryStore()
    v1 = fold.apply(state, store, STATE_DELTA, delta(0, T0, ups=[("m", "memory", {"x": 1}, 5)]))
    v2 = fold.apply(state, store, STATE_DELTA, delta(1, T0 + 9_000_000, ups=[("k", "note", {}, None)]))
    assert v1["node_count"] == 1 and v2["node_count"] == 1
    (change,) = [c for c in v2["node_changes"] if c["node_id"] == "m"]
    assert change["op"] == "expire"
    ended = [r for t, r in rows_for("state_versions", v2) if t == "state_node_ends" and r["node_id"] == "m"]
    assert ended[0]["valid_to"] == T0 + 5_000_000 and ended[0]["to_ordinal"] == 2 and ended[0]["from_ordinal"] == 1
    opened = next(r for t, r in rows_for("state_versions", v1) if t == "state_nodes")
    assert opened["expires_at"] == T0 + 5_000_000 and state.next_expiry is None
    assert store.get_node(SESSION, "m") is None and store.expiries[SESSION] == []  # gone from the store too


def test_unknown_rollback_target_and_too_many_nodes_are_refused_without_changing_state():
    fold, state, store = StateFold(FoldConfig(max_nodes=2, auto_nodes=False)), SessionState(SESSION), MemoryStore()
    out = fold.accept(state, store, STATE_DELTA, delta(0, T0, rollback=f"{SESSION}.9.deadbeef"))
    assert out.versions == [] and "not among" in out.rejected[0][2]
    out = fold.accept(state, store, STATE_DELTA, delta(1, T0, ups=[(i, "n", {}, None) for i in "abc"]))
    assert out.versions == [] and "max_nodes" in out.rejected[0][2]
    assert store.nodes == {} and store.versions == {} and state.ordinal == 0


def test_rollback_reaches_exactly_history_versions_back():
    fold, state, store = StateFold(FoldConfig(history=2, auto_nodes=False)), SessionState(SESSION), MemoryStore()
    ids = [genesis(SESSION)]
    for seq in range(3):
        ids.append(
            fold.accept(state, store, STATE_DELTA, delta(seq, T0, ups=[(f"n{seq}", "n", {}, None)])).versions[0][
                "version_id"
            ]
        )
    assert sorted(o for _, o in store.versions) == [2, 3]  # older versions are dropped from the undo window
    assert "not among" in fold.accept(state, store, STATE_DELTA, delta(3, T0, rollback=ids[0])).rejected[0][2]
    (back,) = fold.accept(state, store, STATE_DELTA, delta(4, T0, rollback=ids[1])).versions
    assert back["rollback_to"] == ids[1] and set(state_of(store, SESSION)[0]) == {"n0"}


def test_late_event_is_applied_at_the_head_and_flagged():
    fold, state, store = StateFold(), SessionState(SESSION), MemoryStore()
    fold.accept(state, store, STATE_DELTA, delta(5, T0, ups=[("a", "n", {}, None)]))
    request = fold.flush_request(state)  # the dispatch topic is quiet: the delta is released anyway
    assert request is not None and len(fold.flush(state, store, request).versions) == 1
    out = fold.accept(state, store, DISPATCH, dispatch(2, T0, "step-2", "search"))
    assert [v["late"] for v in out.versions] == [True] and state.ordinal == 2


def test_a_replayed_flush_waits_for_the_events_it_saw():
    """Kafka may interleave the topics differently on a replay; the flush still releases the same events."""
    first_fold, first = StateFold(), SessionState(SESSION)
    store = MemoryStore()
    d3, a1 = delta(3, T0, ups=[("a", "n", {}, None)]), dispatch(1, T0, "step-1", "search")
    first_fold.accept(first, store, DISPATCH, a1)
    first_fold.accept(first, store, STATE_DELTA, d3)
    request = first_fold.flush_request(first)
    assert request is not None
    original = first_fold.flush(first, store, request).versions
    again, replay_store = SessionState(SESSION), MemoryStore()
    early = first_fold.flush(again, replay_store, request)  # the flush arrives before the events it saw
    assert early.versions == [] and again.flushes
    first_fold.accept(again, replay_store, STATE_DELTA, d3)
    replayed = first_fold.accept(again, replay_store, DISPATCH, a1).versions
    assert [v["version_id"] for v in replayed] == [v["version_id"] for v in original]


def test_redeliveries_are_recognised_by_seq_per_topic():
    fold, state, store = StateFold(), SessionState(SESSION), MemoryStore()
    record = delta(0, T0, ups=[("a", "n", {}, None)])
    assert not fold.accept(state, store, STATE_DELTA, record).duplicate
    assert fold.accept(state, store, STATE_DELTA, record).duplicate  # buffered, then redelivered
    assert not fold.accept(state, store, DISPATCH, dispatch(0, T0, "s", "search")).duplicate  # other topic


def test_lifecycle_end_releases_the_buffer_below_its_seq():
    fold, state, store = StateFold(), SessionState(SESSION), MemoryStore()
    assert fold.accept(state, store, STATE_DELTA, delta(0, T0, ups=[("a", "n", {}, None)])).versions == []
    end = {"envelope": env(3, T0), "kind": "EPISODE_ENDED", "done": True, "truncated": False, "reason": None}
    assert len(fold.accept(state, store, LIFECYCLE, end).versions) == 1


def lifecycle(seq: int, kind: str = "SESSION_CLOSED") -> dict[str, Any]:
    return {"envelope": env(seq, T0 + seq), "kind": kind, "done": True, "truncated": False, "reason": None}


def test_a_closed_session_applies_what_came_before_the_close_and_refuses_what_comes_after():
    fold, state, store = StateFold(), SessionState(SESSION), MemoryStore()
    fold.accept(state, store, STATE_DELTA, delta(2, T0, ups=[("b", "n", {}, None)]))
    # The close waits in seq order (no early release): a delta emitted before it may still be in flight.
    assert fold.accept(state, store, LIFECYCLE, lifecycle(4)).versions == [] and state.ended is None
    in_flight = fold.accept(state, store, DISPATCH, dispatch(0, T0, "step-0", "search"))
    assert in_flight.versions == []  # not late: applied before the delta with seq 2
    after = fold.accept(state, store, STATE_DELTA, delta(6, T0, ups=[("c", "n", {}, None)]))
    assert after.versions == [] and len(state.buffer) == 4
    out = fold.flush(state, store, fold.flush_request(state))
    assert [v["seq"] for v in out.versions] == [0, 2] and not any(v["late"] for v in out.versions)
    assert state.ended == 4
    assert [r[1]["envelope"]["seq"] for r in out.rejected] == [6] and "ended" in out.rejected[0][2]
    assert state.buffer == [] and set(state_of(store, SESSION)[0]) == {"action:step-0", "b"}
    late = fold.accept(state, store, DISPATCH, dispatch(7, T0, "step-7", "search"))
    assert late.versions == [] and "ended" in late.rejected[0][2]
    assert fold.accept(state, store, STATE_DELTA, delta(6, T0)).duplicate  # a redelivery is still just a duplicate
    assert fold.accept(state, store, LIFECYCLE, lifecycle(9, "SESSION_ARCHIVED")).rejected == []
    again = SessionState.from_bytes(state.to_bytes())
    assert again.ended == 4 and fold.accept(again, store, STATE_DELTA, delta(8, T0)).rejected


def test_a_close_after_higher_seqs_were_applied_ends_the_session_at_once():
    fold, state, store = StateFold(FoldConfig(auto_nodes=False)), SessionState(SESSION), MemoryStore()
    assert fold.accept(state, store, STATE_DELTA, delta(5, T0, ups=[("a", "n", {}, None)])).versions
    fold.accept(state, store, LIFECYCLE, lifecycle(3))
    assert state.ended == 3 and fold.accept(state, store, STATE_DELTA, delta(6, T0)).rejected
    # without auto nodes a dispatch is no state event: the step assembler takes it, the state graph refuses nothing
    assert fold.accept(state, store, DISPATCH, dispatch(7, T0, "step-7", "search")).rejected == []


def test_buffer_bounds_release_the_oldest():
    fold, state, store = StateFold(FoldConfig(max_buffer=2)), SessionState(SESSION), MemoryStore()
    outs = [fold.accept(state, store, STATE_DELTA, delta(s, T0, ups=[("a", "n", {"v": s}, None)])) for s in range(3)]
    assert [len(o.versions) for o in outs] == [0, 0, 1] and len(state.buffer) == 2


def test_versions_rematerialize_a_store_that_lost_them():
    fold, state, store = StateFold(FoldConfig(auto_nodes=False)), SessionState(SESSION), MemoryStore()
    versions = [
        fold.accept(
            state, store, STATE_DELTA, delta(s, T0, ups=[("a", "n", {"v": s}, None)], edges=[("a", "b", "x")])
        ).versions[0]
        for s in range(3)
    ]
    lost = MemoryStore()  # holds the first version's writes only: the last two were lost in a crash
    for v in [versions[0], *versions[-2:]]:
        apply_changes(lost, v)
    assert state_of(lost, SESSION)[0]["a"] == state_of(store, SESSION)[0]["a"]
    assert state_of(lost, SESSION)[1] == state_of(store, SESSION)[1]


OBJ = {"type": "object"}
CLOSED = {"type": "object", "additionalProperties": False}


def props(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties}


@pytest.mark.parametrize(
    ("old", "new", "breaks"),
    [
        # Confluent's rule for an open content model: old data may already carry the new property with any value.
        (OBJ, props(a={"type": "string"}), True),
        (CLOSED, {**CLOSED, "properties": {"a": {"type": "string"}}}, False),
        (OBJ, {**OBJ, "required": ["a"]}, True),
        (props(a={"type": ["string", "null"]}), props(a={"type": "string"}), True),
        (props(a={"enum": [1, 2]}), props(a={"enum": [1, 2, 3]}), False),
        (props(a={"enum": [1, 2]}), props(a={"enum": [1]}), True),
        (OBJ, CLOSED, True),
        (props(n={"type": "integer", "maximum": 5}), props(n={"type": "number"}), False),
        (props(n={"type": "integer"}), props(n={"type": "integer", "minimum": 0}), True),
    ],
)
def test_node_type_compatibility(old, new, breaks):
    assert bool(breaking_changes(old, new)) is breaks


def test_breaking_node_type_change_is_refused_with_a_readable_diff():
    from topics.node_types import IncompatibleNodeTypeError, NodeTypeSchema

    types = NodeTypes()
    types.add(NodeTypeSchema("memory", 1, {"type": "object", "properties": {"text": {"type": "string"}}}))
    with pytest.raises(IncompatibleNodeTypeError) as caught:
        types.next_version(
            "memory", {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}
        )
    assert "property 'text' became required" in str(caught.value)
    assert '+  "required": [' in caught.value.diff
    assert types.problem("memory", {"text": 3}) is not None and types.problem("memory", {"text": "x"}) is None


# -- the history SQL on chDB ----------------------------------------------------------------------------


_HISTORY_SESSIONS = itertools.count()


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory):
    """A chDB database with the migrations applied (one chDB path per process: this module's)."""
    from sinks.clickhouse import ClickHouseStore
    from sinks.migrations import apply_migrations
    from topics.settings import Settings

    with ClickHouseStore.open(Settings(home=tmp_path_factory.mktemp("state-history")), database="history") as store:
        apply_migrations(store)
        yield store


def insert_versions(store, versions: list[dict], rng: random.Random) -> None:
    """Land the rows as the sink would, in random batches, with some batches inserted twice (a replay)."""
    from sinks.rows import TABLE_COLUMNS

    rows = [tr for v in versions for tr in rows_for("state_versions", v)]
    start = 0
    while start < len(rows):
        end = start + rng.randint(1, 40)
        for _ in range(2 if rng.random() < 0.3 else 1):
            by_table: dict[str, list[list]] = {}
            for table, row in rows[start:end]:
                by_table.setdefault(table, []).append([row[c] for c in TABLE_COLUMNS[table]])
            for table, data in by_table.items():
                store.insert_sync(table, data, TABLE_COLUMNS[table])
        start = end


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(ops=op_strategy, seed=st.integers(0, 2**32))
def test_history_sql_gives_the_oracle_state_at_every_version_and_time(history, ops, seed):
    from treadle.state.history import At, StateNotFoundError, diff, read_diff_arrow, read_state, read_state_arrow

    session = f"h{next(_HISTORY_SESSIONS)}"  # examples share the database
    events, oracle, ids = build(ops, 256, session=session)
    fold, state, store = StateFold(), SessionState(session), MemoryStore()
    versions = [v for schema, record in events for v in fold.accept(state, store, schema, record).versions]
    request = fold.flush_request(state)
    versions += fold.flush(state, store, request).versions if request else []
    assert [v["version_id"] for v in versions] == ids[1:]
    insert_versions(history, versions, random.Random(seed))
    run = lambda sql: history.query_sync(sql).result_rows  # noqa: E731
    arrow = history.read_only_queries_arrow_sync  # what state_at() runs: Arrow columns, lazy objects
    for ordinal in range(len(oracle.snapshots)):
        graph = read_state(run, session, ordinal)
        nodes, edges = graph.content()
        assert (nodes, set(edges)) == oracle.view(ordinal), f"ordinal {ordinal}"
        assert graph.version_id == ids[ordinal]
        columnar = read_state_arrow(arrow, session, ordinal)
        assert columnar.content() == (nodes, edges) and columnar.version_id == ids[ordinal], f"ordinal {ordinal}"
        assert len(columnar.nodes) == len(nodes) and len(columnar.edges) == len(edges)
        assert columnar.to_json() == graph.to_json()
        by_id = read_state_arrow(arrow, session, ids[ordinal])  # nodes, edges and version row in one batch
        assert by_id.content() == (nodes, edges) and by_id.version_id == ids[ordinal]
    with pytest.raises(StateNotFoundError):  # the batch's nodes and edges are dropped when the version is not there
        read_state_arrow(arrow, session, f"{session}.{len(ids)}.0000000000000000")
    pairs = random.Random(seed).sample(
        [(a, b) for a in range(len(ids)) for b in range(len(ids))], min(12, len(ids) ** 2)
    )
    for a, b in [
        (0, len(ids) - 1),
        (len(ids) - 1, 0),
        *pairs,
    ]:  # the change read as intervals = the two states compared
        want = diff(read_state(run, session, a), read_state(run, session, b))
        got = read_diff_arrow(arrow, session, ids[a], b)
        assert got.to_json() == want.to_json(), f"diff {a}..{b}"
        whole = diff(read_state_arrow(arrow, session, a), read_state_arrow(arrow, session, b))  # Arrow compare
        assert whole.to_json() == want.to_json(), f"columnar diff {a}..{b}"
        assert (got.before.content(), got.after.content()) == (want.before.content(), want.after.content())
    with pytest.raises(StateNotFoundError):
        read_diff_arrow(arrow, session, 0, len(ids))
    if len(ids) > 1:  # a version id whose hash is not the one at its ordinal, beside that ordinal
        with pytest.raises(StateNotFoundError):
            read_diff_arrow(arrow, session, f"{session}.1.0000000000000000", 1)
    for v in versions:  # between two versions: the earlier one, less the nodes whose TTL passed by then
        moment = v["event_time"] + 500_000
        latest = max(u["ordinal"] for u in versions if u["event_time"] <= moment)
        snapshot, edges = oracle.snapshots[latest]
        want = {k: (t, d) for k, (t, d, exp) in snapshot.items() if exp is None or exp > moment}
        got, got_edges = read_state(run, session, At(time=moment)).content()
        assert (got, set(got_edges)) == (want, edges), f"time after version {v['ordinal']}"
        assert read_state_arrow(arrow, session, At(time=moment)).content() == (got, got_edges)


def test_caused_by_tool_sql_gives_each_node_and_type_once(history):
    """A node opened twice in the window, a row a replay inserted twice (another part), a node whose type changed:
    one row per (node, type), as DISTINCT would give; other tools, older rows and (per session) other sessions out.
    The tool has a name of its own: the module's tests share the database."""
    from treadle.state.history import caused_by_tool_sql

    columns = "(caused_by_tool, valid_from, session_id, node_id, type, from_ordinal)"
    rows = [
        ("probe", 60, "c1", "a", "memory", 1),
        ("probe", 30, "c1", "a", "memory", 3),  # a again, later, same tool
        ("probe", 50, "c1", "b", "memory", 2),
        ("probe", 50, "c1", "b", "memory", 2),  # replayed: the same row in a second part
        ("probe", 40, "c1", "c", "memory", 2),
        ("probe", 20, "c1", "c", "fact", 4),  # c's type changed: both pairs stay
        ("write", 20, "c1", "d", "memory", 4),  # another tool
        ("probe", 600, "c1", "e", "memory", 0),  # ten minutes ago
        ("probe", 10, "c2", "a", "memory", 1),  # another session
    ]
    for tool, ago, session, node, kind, ordinal in rows:
        history.command_sync(
            f"INSERT INTO state_node_causes {columns} VALUES "
            f"('{tool}', now64(6) - INTERVAL {ago} SECOND, '{session}', '{node}', '{kind}', {ordinal})"
        )
    one = history.read_only_query_sync(caused_by_tool_sql("probe", 5, "c1")).result_rows
    assert sorted(one) == [("a", "memory"), ("b", "memory"), ("c", "fact"), ("c", "memory")]
    every = history.read_only_query_sync(caused_by_tool_sql("probe", 5)).result_rows
    assert sorted(every) == sorted([("c1", n, t) for n, t in one] + [("c2", "a", "memory")])
