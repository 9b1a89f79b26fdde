"""A state graph's nodes and edges over Arrow columns, turned into Python objects only when touched.

A session can hold 100,000 nodes and as many edges; building a GraphNode (and parsing its JSON) for each
costs about a second, more than the query itself. `state_at` hands back these read-only views instead:
a lookup or an iteration builds (and caches) what it touches, `len` and membership need only the ids, and
`arrow` gives the columns to code that wants them whole (pandas, polars, a trainer).

Rows a replay inserted twice are the same row twice; the views keep one per node id / edge key. A view can
also be given a function that reads its table, called on first touch (the two sides of `state_diff`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import orjson
import pyarrow as pa

from processors.state.model import GraphEdge, GraphNode

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


class ColumnarEdges(_Columnar, Sequence[GraphEdge]):
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

    @overload
    def __getitem__(self, i: int) -> GraphEdge: ...
    @overload
    def __getitem__(self, i: slice) -> list[GraphEdge]: ...
    def __getitem__(self, i: int | slice) -> GraphEdge | list[GraphEdge]:
        rows = self._unique()
        if isinstance(i, slice):
            return [self._edge(row) for row in rows[i]]
        return self._edge(rows[i])

    def _edge(self, row: int) -> GraphEdge:
        edge = self._built.get(row)
        if edge is None:
            assert self._columns is not None
            src, dst, kind, data = (c[row] for c in self._columns)
            edge = self._built[row] = GraphEdge(src, dst, kind, orjson.loads(data))
        return edge

    def __len__(self) -> int:
        return len(self._unique())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return "ColumnarEdges(not read yet)" if self._table is None else f"ColumnarEdges({self._table.num_rows} rows)"
