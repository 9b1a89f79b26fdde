"""What a reader gets back for a session's state graph, from Redis (latest) or ClickHouse (history)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar, overload

T = TypeVar("T")


@dataclass(frozen=True)
class GraphNode:
    id: str
    type: str
    data: Any
    expires_at: int | None = None  # UTC micros
    caused_by_tool: str = ""


@dataclass(frozen=True)
class GraphEdge:
    src: str
    dst: str
    type: str
    data: Any = None


class LazySequence(Sequence[T]):
    """A read-only sequence whose items are built from stored rows when first touched (`_item`): a large graph's
    edges or a diff's lists, read from Redis or ClickHouse, cost nothing until looked at. Equal to any sequence of
    the same items."""

    def _item(self, i: int) -> T:
        """Item `i`, 0 <= i < len(self)."""
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> list[T]: ...
    def __getitem__(self, i: int | slice) -> T | list[T]:
        n = len(self)
        if isinstance(i, slice):
            return [self._item(k) for k in range(n)[i]]
        if not -n <= i < n:
            raise IndexError(i)
        return self._item(i % n)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class StateGraph:
    """A session's graph at one version; `version_id` is session.0.genesis for the empty state.

    `nodes` and `edges` are a dict and a list, or (from ClickHouse history) read-only views over Arrow columns
    that build objects only when touched (treadle/state/columns.py).
    """

    session_id: str
    version_id: str
    ordinal: int
    time: int  # version time, UTC micros
    nodes: Mapping[str, GraphNode] = field(default_factory=dict)
    edges: Sequence[GraphEdge] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "version_id": self.version_id,
            "ordinal": self.ordinal,
            "time": self.time,
            "nodes": [asdict(n) for _, n in sorted(self.nodes.items())],
            "edges": [asdict(e) for e in sorted(self.edges, key=lambda e: (e.src, e.dst, e.type))],
        }

    def content(self) -> tuple[dict[str, tuple[str, str]], dict[tuple[str, str, str], str]]:
        """Nodes and edges as comparable canonical values (for tests and diffs)."""
        import orjson

        def canon(value: Any) -> str:
            return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()

        nodes = {n.id: (n.type, canon(n.data)) for n in self.nodes.values()}
        edges = {(e.src, e.dst, e.type): canon(e.data) for e in self.edges}
        return nodes, edges
