"""StateCache on the real Valkey: versions and snapshots written, the latest state read back, TTL'd nodes left out
once expired (through the `expiring` sorted set), and a cache of the older layout rebuilt."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import orjson
import pytest

from processors.state.cache import LAYOUT, StateCache, connect, epoch_key
from processors.state.graph import MemoryStore, SessionState, StateFold
from processors.state.model import GraphEdge, GraphNode, StateGraph
from tests.factories import envelope
from topics.names import STATE_DELTA
from topics.settings import Settings

SECOND = 1_000_000
HOUR = 3600 * SECOND


def ahead() -> int:
    """An event time an hour after now: Valkey's own field expiry (HPEXPIREAT, wall clock) must not drop a TTL'd
    node before the reader's `now_micros` says it expired."""
    return int(time.time() * SECOND) + HOUR


def delta(
    session: str,
    seq: int,
    t: int,
    upserts: Sequence[dict[str, Any]] = (),
    deletes: Sequence[str] = (),
    edges: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    env = envelope(session, f"{session}-d{seq}", seq, event_time=t)
    return {"envelope": env, "node_upserts": list(upserts), "node_deletes": list(deletes),
            "edge_upserts": list(edges), "edge_deletes": [], "rollback_to": None}  # fmt: skip


def node(node_id: str, ttl: int | None = None, **data: Any) -> dict[str, Any]:
    return {"id": node_id, "type": "note", "data_json": orjson.dumps(data).decode(), "ttl_seconds": ttl}


class Session:
    """One session folded by the real StateFold in memory: its versions, and its nodes and edges at the end."""

    def __init__(self, name: str) -> None:
        self.name, self.fold, self.store, self.state = name, StateFold(), MemoryStore(), SessionState(name)

    def apply(self, record: dict[str, Any]) -> dict[str, Any]:
        return self.fold.apply(self.state, self.store, STATE_DELTA, record)

    def snapshot(self) -> tuple[dict[str, Any], list, list]:
        meta = {"ordinal": self.state.ordinal, "version_id": self.state.version_id, "time": self.state.time,
                "node_count": self.state.node_count, "edge_count": self.state.edge_count}  # fmt: skip
        nodes = [(nid, rec) for (s, nid), rec in self.store.nodes.items() if s == self.name]
        edges = [(key, rec) for (s, key), rec in self.store.edges.items() if s == self.name]
        return meta, nodes, edges


@pytest.fixture
def run() -> Iterator[Callable[[Awaitable[Any]], Any]]:
    """Runs a coroutine to its end, on one loop for the whole test (the Redis client is bound to it)."""
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


@pytest.fixture
def cache(deployment: Settings, run: Callable[[Awaitable[Any]], Any]) -> Iterator[StateCache]:
    client = connect(deployment)
    yield StateCache(client, deployment.topic_prefix)
    run(client.aclose())


def content(graph: StateGraph | None) -> tuple[dict[str, tuple[str, Any, Any]], set[tuple[str, str, str, str]]]:
    assert graph is not None
    nodes = {nid: (n.type, n.data, n.expires_at) for nid, n in graph.nodes.items()}
    return nodes, {(e.src, e.dst, e.type, orjson.dumps(e.data).decode()) for e in graph.edges}


def test_expired_nodes_are_left_out_until_a_version_overwrites_or_deletes_them(cache, run):
    t0 = ahead()
    s = Session("ttl")
    versions = [
        s.apply(delta("ttl", 0, t0, [node("keep", v=1), node("short", ttl=10, v=2), node("long", ttl=100, v=3)])),
        s.apply(delta("ttl", 1, t0 + SECOND, [node("again", ttl=10, v=4)])),
    ]
    assert run(cache.apply_versions(versions)) == set()

    def ids(at: int) -> list[str]:
        graph = run(cache.read("ttl", now_micros=at))
        return sorted(graph.nodes)

    assert ids(t0 + 5 * SECOND) == ["again", "keep", "long", "short"]
    assert ids(t0 + 10 * SECOND) == ["again", "keep", "long"]  # expires_at <= now: gone at its expiry
    assert ids(t0 + 11 * SECOND) == ["keep", "long"]
    assert ids(t0 + 100 * SECOND) == ["keep"]
    # "short" rewritten without a TTL, "long" deleted: neither is in the expiring set any more
    more = [s.apply(delta("ttl", 2, t0 + 2 * SECOND, [node("short", v=5)], deletes=["long"]))]
    assert run(cache.apply_versions(more)) == set()
    assert ids(t0 + 1000 * SECOND) == ["keep", "short"]
    graph = run(cache.read("ttl", now_micros=t0 + 1000 * SECOND))
    assert graph.nodes["short"] == GraphNode("short", "note", {"v": 5}, None, "")
    expiring = run(cache.client.zrange(f"{cache.prefix}:state:ttl:expiring", 0, -1, withscores=True))
    assert expiring == [(b"again", float(t0 + 11 * SECOND))]


def test_a_snapshot_reads_back_as_the_versions_did(cache, run):
    t0 = ahead()
    s = Session("snap")
    edge = {"src": "a", "dst": "b", "type": "links", "data_json": '{"w": 1}'}
    versions = [
        s.apply(delta("snap", 0, t0, [node("a", v=1), node("b", ttl=30, v=2)], edges=[edge])),
        s.apply(delta("snap", 1, t0 + SECOND, [node("c", ttl=5, v=3), node("a", v=6)])),
    ]
    run(cache.apply_versions(versions))
    at = t0 + 10 * SECOND  # c expired, b not yet
    from_versions = content(run(cache.read("snap", now_micros=at)))
    run(cache.write_snapshot("other", *s.snapshot()))
    from_snapshot = content(run(cache.read("other", now_micros=at)))
    assert from_versions == from_snapshot
    assert sorted(from_versions[0]) == ["a", "b"] and from_versions[0]["a"] == ("note", {"v": 6}, None)
    assert from_versions[1] == {("a", "b", "links", '{"w":1}')}
    assert content(run(cache.read("other", now_micros=t0 + 40 * SECOND)))[0].keys() == {"a"}


def test_the_views_build_only_what_is_touched_and_equal_the_whole_state(cache, run):
    t0 = ahead()
    s = Session("big")
    ups = [node(f"n{i}", v=i) for i in range(500)]
    edges = [{"src": f"n{i}", "dst": f"n{i + 1}", "type": "next", "data_json": "{}"} for i in range(499)]
    run(cache.apply_versions([s.apply(delta("big", 0, t0, ups, edges=edges))]))
    graph = run(cache.read("big", now_micros=t0))
    assert len(graph.nodes) == 500 and "n7" in graph.nodes and "n500" not in graph.nodes and 7 not in graph.nodes
    assert graph.nodes["n7"] is graph.nodes["n7"]  # built once, kept
    assert graph.nodes._built.keys() == {"n7"}  # nothing else parsed yet
    with pytest.raises(KeyError):
        graph.nodes["n500"]
    assert graph.nodes.get("n500") is None
    assert len(graph.edges) == 499 and graph.edges[-1] == graph.edges[498] and len(graph.edges[10:20]) == 10
    with pytest.raises(IndexError):
        graph.edges[499]
    assert dict(graph.nodes) == {f"n{i}": GraphNode(f"n{i}", "note", {"v": i}) for i in range(500)}
    assert sorted(graph.edges, key=lambda e: e.src) == sorted(
        (GraphEdge(f"n{i}", f"n{i + 1}", "next", {}) for i in range(499)), key=lambda e: e.src
    )
    assert graph.version_id == s.state.version_id and graph.ordinal == 1


def test_a_cache_filled_in_the_older_layout_counts_as_not_filled(cache, run):
    assert not run(cache.filled())
    run(cache.client.set(epoch_key(cache.prefix), b"1"))  # layout 1: no expiring sets
    assert not run(cache.filled())
    run(cache.mark_filled())
    assert run(cache.filled()) and run(cache.client.get(epoch_key(cache.prefix))) == LAYOUT
