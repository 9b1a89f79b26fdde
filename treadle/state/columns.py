"""A state graph's nodes and edges over Arrow columns, turned into Python objects only when touched.

A session can hold 100,000 nodes and as many edges; building a GraphNode (and parsing its JSON) for each
costs about a second, more than the query itself. `state_at` hands back these read-only views instead:
a lookup or an iteration builds (and caches) what it touches, `len` and membership need only the ids, and
`arrow` gives the columns to code that wants them whole (pandas, polars, a trainer).

Rows a replay inserted twice are the same row twice; the views keep one per node id / edge key. A view can
also be given a function that reads its table, called on first touch (the two sides of `state_diff`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from processors.state.model import GraphEdge, GraphNode, LazySequence

NODE_COLUMNS = ("node_id", "type", "data_json", "expires_at", "caused_by_tool")
EDGE_COLUMNS = ("src", "dst", "type", "data_json")


TableSource = pa.Table | Callable[[], pa.Table]


def _column(table: pa.Table, i: int) -> list[Any]:
    return table.column(i).to_pylist()


class _Columnar:
    """The table of a view, read by its function on first touch when it was given one."""

    def __init__(self, table: TableSource) -> None:
        self._table: pa.Table | None = table if isinstance(table, pa.Table) else None
        self._read = table if self._table is None else None

    @property
    def arrow(self) -> pa.Table:
        if self._table is None:
            assert self._read is not None
            self._table, self._read = self._read(), None
        return self._table


class ColumnarNodes(_Columnar, Mapping[str, GraphNode]):
    """node id -> GraphNode over a table with NODE_COLUMNS (in that order)."""

    def __init__(self, table: TableSource) -> None:
        super().__init__(table)
        self._index: dict[str, int] | None = None
        self._columns: list[list[Any]] | None = None
        self._built: dict[str, GraphNode] = {}

    def _rows(self) -> dict[str, int]:
        if self._index is None:
            ids = _column(self.arrow, 0)
            self._index = dict(zip(ids, range(len(ids)), strict=True))  # a duplicate row: the last one wins
        return self._index

    def __getitem__(self, node_id: str) -> GraphNode:
        node = self._built.get(node_id)
        if node is not None:
            return node
        row = self._rows()[node_id]
        if self._columns is None:
            self._columns = [_column(self.arrow, i) for i in range(1, 5)]
        kind, data, expires_at, tool = (c[row] for c in self._columns)
        node = self._built[node_id] = GraphNode(node_id, kind, orjson.loads(data), expires_at, tool)
        return node

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows())

    def __len__(self) -> int:
        return len(self._rows())

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._rows()

    def __repr__(self) -> str:
        return "ColumnarNodes(not read yet)" if self._table is None else f"ColumnarNodes({self._table.num_rows} rows)"


class ColumnarEdges(_Columnar, LazySequence[GraphEdge]):
    """GraphEdges over a table with EDGE_COLUMNS (in that order), one per (src, dst, type)."""

    def __init__(self, table: TableSource) -> None:
        super().__init__(table)
        self._rows: list[int] | None = None
        self._columns: list[list[Any]] | None = None
        self._built: dict[int, GraphEdge] = {}

    def _unique(self) -> list[int]:
        if self._rows is None:
            self._columns = [_column(self.arrow, i) for i in range(4)]
            keys = zip(*self._columns[:3], strict=True)
            self._rows = list({key: row for row, key in enumerate(keys)}.values())
        return self._rows

    def _item(self, i: int) -> GraphEdge:
        row = self._unique()[i]
        edge = self._built.get(row)
        if edge is None:
            assert self._columns is not None
            src, dst, kind, data = (c[row] for c in self._columns)
            edge = self._built[row] = GraphEdge(src, dst, kind, orjson.loads(data))
        return edge

    def __len__(self) -> int:
        return len(self._unique())

    def __repr__(self) -> str:
        return "ColumnarEdges(not read yet)" if self._table is None else f"ColumnarEdges({self._table.num_rows} rows)"


class _RowList(LazySequence[Any]):
    """Objects built from the rows of a table, in its row order, when touched (the lists of a StateDiff)."""

    def __init__(self, table: pa.Table) -> None:
        self.arrow = table
        self._columns: list[list[Any]] | None = None
        self._built: dict[int, Any] = {}

    def _make(self, row: tuple[Any, ...]) -> Any:
        raise NotImplementedError

    def _item(self, i: int) -> Any:
        built = self._built.get(i)
        if built is None:
            if self._columns is None:
                self._columns = [_column(self.arrow, c) for c in range(self.arrow.num_columns)]
            built = self._built[i] = self._make(tuple(c[i] for c in self._columns))
        return built

    def __len__(self) -> int:
        return self.arrow.num_rows

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.arrow.num_rows} rows)"


class NodeList(_RowList):
    """GraphNodes over a table with NODE_COLUMNS, in row order."""

    def _make(self, row: tuple[Any, ...]) -> GraphNode:
        node_id, kind, data, expires_at, tool = row
        return GraphNode(node_id, kind, orjson.loads(data), expires_at, tool)


class EdgeList(_RowList):
    """GraphEdges over a table with EDGE_COLUMNS, in row order."""

    def _make(self, row: tuple[Any, ...]) -> GraphEdge:
        src, dst, kind, data = row
        return GraphEdge(src, dst, kind, orjson.loads(data))


class NodePairs(LazySequence[tuple[GraphNode, GraphNode]]):
    """(before, after) GraphNodes over two tables with NODE_COLUMNS whose rows pair up."""

    def __init__(self, before: pa.Table, after: pa.Table) -> None:
        self.before, self.after = NodeList(before), NodeList(after)

    def _item(self, i: int) -> tuple[GraphNode, GraphNode]:
        return self.before[i], self.after[i]

    def __len__(self) -> int:
        return len(self.before)


def node_changes(before: pa.Table, after: pa.Table) -> tuple[NodeList, NodeList, NodePairs]:
    """(added, removed, changed) from the node rows of two states (or of what is live on each side only), in
    node id order, as Arrow compute: no object per unchanged node.

    Stored node data is canonical JSON (sorted keys), so equal content is equal text: the comparison of
    StateGraph.content, on the strings. A row a replay inserted twice counts once.
    """
    a, b = _unique(before, ["node_id"]), _unique(after, ["node_id"])
    a_ids, b_ids = a.column(0), b.column(0)
    in_b, in_a = pc.is_in(a_ids, value_set=b_ids), pc.is_in(b_ids, value_set=a_ids)
    a_both, b_both = a.filter(in_b), b.filter(in_a)  # the same ids in the same order
    differ = pc.or_(pc.not_equal(a_both.column(1), b_both.column(1)), pc.not_equal(a_both.column(2), b_both.column(2)))
    return (
        NodeList(b.filter(pc.invert(in_a))),
        NodeList(a.filter(pc.invert(in_b))),
        NodePairs(a_both.filter(differ), b_both.filter(differ)),
    )


def edge_changes(before: pa.Table, after: pa.Table) -> tuple[EdgeList, EdgeList]:
    """(added then changed, removed) from the edge rows of two states, by (src, dst, type) (as node_changes)."""
    keys = ["src", "dst", "type"]
    a, b = _unique(before, keys), _unique(after, keys)
    a_keys, b_keys = _edge_keys(a), _edge_keys(b)
    in_b, in_a = pc.is_in(a_keys, value_set=b_keys), pc.is_in(b_keys, value_set=a_keys)
    a_both, b_both = a.filter(in_b), b.filter(in_a)
    changed = b_both.filter(pc.not_equal(a_both.column(3), b_both.column(3)))
    return EdgeList(pa.concat_tables([b.filter(pc.invert(in_a)), changed])), EdgeList(a.filter(pc.invert(in_b)))


def _edge_keys(table: pa.Table) -> pa.ChunkedArray:
    return pc.binary_join_element_wise(table.column(0), table.column(1), table.column(2), "\0")


def _unique(table: pa.Table, keys: list[str]) -> pa.Table:
    """Dictionary columns decoded and named by position (NODE_/EDGE_COLUMNS), sorted by `keys`, one row per key."""
    names = NODE_COLUMNS if table.num_columns == len(NODE_COLUMNS) else EDGE_COLUMNS
    columns = [_decoded(table.column(i)) for i in range(table.num_columns)]
    table = pa.table(columns, names=list(names))
    if table.num_rows < 2:
        return table
    table = table.take(pc.sort_indices(table, sort_keys=[(k, "ascending") for k in keys]))
    n = table.num_rows
    repeat = None
    for k in keys:
        column = table.column(k)
        same = pc.equal(column.slice(1), column.slice(0, n - 1))
        repeat = same if repeat is None else pc.and_(repeat, same)
    assert repeat is not None
    keep = pa.concat_arrays([pa.array([True]), pc.invert(repeat).combine_chunks()])
    return table.filter(keep)


def _decoded(column: pa.ChunkedArray) -> pa.ChunkedArray:
    if pa.types.is_dictionary(column.type):
        return pc.cast(column, column.type.value_type)
    return column
