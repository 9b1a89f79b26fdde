"""Version ids pinned: the content hash of a version must not change when the fold is reworked (ids are
references downstream: rollback targets, parent links, rows in ClickHouse)."""

from __future__ import annotations

import random
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from processors.state.graph import FoldConfig, MemoryStore, SessionState, StateFold
from topics.names import DISPATCH, STATE_DELTA, TOOL_RESULT

SESSION = "pinned.session"  # a dot in the session id, as ordinal_of allows
T0 = 1_760_000_000_000_000


def env(seq: int, lid: str | None = None) -> dict[str, Any]:
    event_id = f"e{seq}"
    return {"event_id": event_id, "session_id": SESSION, "agent_id": "a", "episode_id": "ep",
            "logical_event_id": lid or event_id, "seq": seq, "event_time": T0 + seq * 1_000_000,
            "policy_version": "", "trace_id": "", "attributes": {}}  # fmt: skip


def delta(seq: int, lid: str | None = None, **fields: Any) -> tuple[str, dict[str, Any]]:
    record = {"envelope": env(seq, lid), "node_upserts": [], "node_deletes": [], "edge_upserts": [],
              "edge_deletes": [], "rollback_to": None, **fields}  # fmt: skip
    return STATE_DELTA, record


def events() -> list[tuple[str, dict[str, Any]]]:
    """Dispatch + result + tied delta (auto nodes and edges), unsorted and nested data, TTL expiry, deletes,
    edge data, caused_by_tool, and a rollback."""
    up = {"id": "n1", "type": "note", "data_json": '{"b": 1, "a": [3, {"z": "\\u00e9", "y": 1.5}]}', "ttl_seconds": 2}
    return [
        (DISPATCH, {"envelope": env(0, "step-0"), "step": 0, "tool": "search", "params_json": '{"q": "x", "k": 2}',
                    "deadline": None}),
        (TOOL_RESULT, {"envelope": env(1, "step-0"), "tool": "search", "status": "OK", "output": "found",
                       "error": None, "latency_ms": 1.25, "cost_usd": 0.0, "tokens_in": 0, "tokens_out": 0,
                       "retries": 0}),
        delta(2, "step-0", node_upserts=[up, {"id": "n2", "type": "doc", "data_json": "", "ttl_seconds": None,
                                              "caused_by_tool": "write"}],
              edge_upserts=[{"src": "n1", "dst": "n2", "type": "refs", "data_json": '{"w": 2, "v": 1}'}]),
        delta(3, node_upserts=[{"id": "n3", "type": "note", "data_json": "{}", "ttl_seconds": None}]),
        delta(6, node_deletes=["n3"], edge_deletes=[{"src": "n1", "dst": "n2", "type": "refs"}]),
    ]  # fmt: skip


# Made by the fold before its dict-free rework (commit 67e5096); the same events must give these ids forever.
PINNED = [
    "pinned.session.1.6645c21b27792093",
    "pinned.session.2.a0e1e5eac658ba25",
    "pinned.session.3.91b7538b83751ca9",
    "pinned.session.4.bf73c0eca4a90503",
    "pinned.session.5.2f28546882213f24",
    "pinned.session.6.131f376e8ed88be2",
]


def fold_ids() -> list[str]:
    fold, state, store = StateFold(FoldConfig(history=4)), SessionState(SESSION), MemoryStore()
    ids = []
    for event in [*events(), None]:
        schema, record = event or delta(7, rollback_to=ids[2])  # last, a rollback to the third version
        out = fold.accept(state, store, schema, record)
        if (request := fold.flush_request(state)) is not None:
            out.extend(fold.flush(state, store, request))
        ids += [v["version_id"] for v in out.versions]
    return ids


def test_version_ids_are_pinned() -> None:
    assert fold_ids() == PINNED


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 400)), max_size=60), st.integers(1, 6))
def test_buffer_bytes_is_the_sum_of_the_buffered_sizes(arrivals: list[tuple[int, int]], max_buffer: int) -> None:
    """SessionState keeps its buffer's byte count as events come and go (it is checked after every event)."""
    fold = StateFold(FoldConfig(auto_nodes=True, max_buffer=max_buffer, max_buffer_bytes=4_000))
    state, store = SessionState(SESSION), MemoryStore()
    rng = random.Random(len(arrivals))
    for seq, size in sorted(set(arrivals)):
        data = orjson.dumps({"pad": "x" * size}).decode()
        schema, record = delta(
            seq, node_upserts=[{"id": f"n{seq}", "type": "t", "ttl_seconds": None, "data_json": data}]
        )
        fold.accept(state, store, schema, record)
        if rng.random() < 0.3:
            fold.accept(state, store, DISPATCH, {"envelope": env(seq), "step": seq, "tool": "t", "params_json": "{}",
                                                 "deadline": None})  # fmt: skip
        assert state.buffer_bytes() == sum(p.size for p in state.buffer)
    if (request := fold.flush_request(state)) is not None:
        fold.flush(state, store, request)
    assert state.buffer_bytes() == sum(p.size for p in state.buffer)
    assert SessionState.from_bytes(state.to_bytes()).buffer_bytes() == state.buffer_bytes()
