"""The cached state's lazy views hold what parsing every raw value up front gives, whatever is touched first."""

from __future__ import annotations

import orjson
from hypothesis import given
from hypothesis import strategies as st

from processors.state.cache_views import EDGE_FIELD_SEP, CachedEdges, CachedNodes
from processors.state.model import GraphEdge, GraphNode

ids = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters=EDGE_FIELD_SEP), min_size=1, max_size=8)
data = st.recursive(st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                    max_leaves=6)  # fmt: skip
nodes = st.dictionaries(ids, st.tuples(st.sampled_from(["file", "note"]), data, st.none() | st.integers(0, 10**16),
                                       st.sampled_from(["", "write"])), max_size=20)  # fmt: skip
edges = st.dictionaries(st.tuples(ids, ids, st.sampled_from(["causes", "links"])), data, max_size=20)


def node_raw(kind: str, value: object, expires: int | None, tool: str) -> bytes:
    return orjson.dumps({"type": kind, "data": value, "expires_at": expires, "caused_by_tool": tool})


@given(nodes, st.data())
def test_cached_nodes_equal_the_eager_parse_without_the_expired(given_nodes, draw):
    raw = {nid.encode(): node_raw(*v) for nid, v in given_nodes.items()}
    expired = set(draw.draw(st.lists(st.sampled_from(sorted(raw)), unique=True))) if raw else set()
    expired.add(b"not-a-node")  # an expired id whose field is already gone
    view = CachedNodes(raw, expired)
    want = {nid: GraphNode(nid, *v) for nid, v in given_nodes.items() if nid.encode() not in expired}
    for nid in draw.draw(st.lists(st.sampled_from(sorted(given_nodes)))) if given_nodes else []:
        assert (nid in view) == (nid in want) and view.get(nid) == want.get(nid)  # touched first, in any order
    assert len(view) == len(want) and set(view) == set(want) and dict(view) == want


@given(edges, st.data())
def test_cached_edges_equal_the_eager_parse_in_hash_order(given_edges, draw):
    raw = {EDGE_FIELD_SEP.join(key).encode(): orjson.dumps(value) for key, value in given_edges.items()}
    view = CachedEdges(raw)
    want = [GraphEdge(*key, value) for key, value in given_edges.items()]
    if want:
        i = draw.draw(st.integers(-len(want), len(want) - 1))
        assert view[i] == want[i]
    assert len(view) == len(want) and list(view) == want and view[1:3] == want[1:3] and view == want
