"""A cached session's nodes and edges over the raw values Redis returned, turned into objects only when touched.

Parsing every node's JSON and building its GraphNode cost ~9 us a node (a second at 100,000 nodes, four times
the HGETALL itself), while an agent loop usually looks at a few nodes of its state: a lookup or an iteration builds
(and keeps) what it touches, and `len` and membership need only the ids.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import orjson

from processors.state.model import GraphEdge, GraphNode, LazySequence

EDGE_FIELD_SEP = "\x1f"  # an edge's field in its hash: src, dst and type joined by it


class CachedNodes(Mapping[str, GraphNode]):
    """node id -> GraphNode over a nodes hash (field -> {"type", "data", "expires_at", "caused_by_tool"} JSON),
    without the fields named in `expired`."""

    def __init__(self, raw: dict[bytes, bytes], expired: set[bytes]) -> None:
        self._raw = {k: v for k, v in raw.items() if k not in expired} if expired else raw
        self._built: dict[str, GraphNode] = {}

    def __getitem__(self, node_id: str) -> GraphNode:
        node = self._built.get(node_id)
        if node is not None:
            return node
        raw = self._raw.get(node_id.encode()) if isinstance(node_id, str) else None
        if raw is None:
            raise KeyError(node_id)
        doc = orjson.loads(raw)
        node = GraphNode(node_id, doc["type"], doc["data"], doc["expires_at"], doc["caused_by_tool"])
        self._built[node_id] = node
        return node

    def __iter__(self) -> Iterator[str]:
        return (field.decode() for field in self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __contains__(self, node_id: object) -> bool:
        return isinstance(node_id, str) and node_id.encode() in self._raw

    def __repr__(self) -> str:
        return f"CachedNodes({len(self._raw)} nodes)"


class CachedEdges(LazySequence[GraphEdge]):
    """GraphEdges over an edges hash (src, dst and type joined by EDGE_FIELD_SEP -> data JSON), in its order."""

    def __init__(self, raw: dict[bytes, bytes]) -> None:
        self._items = list(raw.items())
        self._built: dict[int, GraphEdge] = {}

    def _item(self, i: int) -> GraphEdge:
        edge = self._built.get(i)
        if edge is None:
            field, data = self._items[i]
            src, dst, kind = field.decode().split(EDGE_FIELD_SEP)
            edge = self._built[i] = GraphEdge(src, dst, kind, orjson.loads(data))
        return edge

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"CachedEdges({len(self._items)} edges)"
