"""State history from ClickHouse: the graph at a version or a time, and the diff between two versions.

Each read is a few SQL statements over the tables of sinks/migrations/0012_state_graph.up.sql, run through
sinks.sql_client.arrow_batches (so it works while a worker owns the embedded chDB) or any other runner. The
SQL builders are public so users can see, copy and adapt the queries. `state_at` reads Arrow columns and wraps
them lazily (at 100,000 nodes, building every object up front cost ~20x the query; bench/state_bench.py), and
sends its statements in one batch, which the store runs two at a time: the nodes and edges queries take about
the same time, so on two cores the read costs about the slower of the two, not their sum.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
import pyarrow.compute as pc

from processors.state.graph import ordinal_of
from processors.state.model import GraphEdge, GraphNode, StateGraph
from sinks.sql_client import ArrowBatchRunner
from sinks.sql_params import quote
from topics.settings import Settings
from treadle.state.columns import ColumnarEdges, ColumnarNodes, edge_changes, node_changes

_ORDINAL = re.compile(r"^\d+$")


class StateNotFoundError(LookupError):
    """The session or version is not (yet) in ClickHouse."""


@dataclass(frozen=True)
class At:
    """A point in a session's history: a version (id or ordinal) or a time (UTC micros)."""

    version_id: str | None = None
    ordinal: int | None = None
    time: int | None = None

    @classmethod
    def parse(cls, session: str, text: str | int | datetime) -> At:
        """A version id (`session.N.hash`), an ordinal (`12`), or a time (ISO 8601, `now`, a datetime)."""
        if isinstance(text, datetime):
            return cls(time=_micros(text))
        if isinstance(text, int):
            return cls(ordinal=text)
        if text.startswith(f"{session}."):
            return cls(version_id=text)
        if _ORDINAL.match(text):
            return cls(ordinal=int(text))
        if text == "now":
            return cls(time=_micros(datetime.now(UTC)))
        try:
            return cls(time=_micros(datetime.fromisoformat(text.replace("Z", "+00:00"))))
        except ValueError:
            raise ValueError(
                f"{text!r} is neither a version of {session!r} ({session}.N.hash), an ordinal, nor an ISO time"
            ) from None

    def version_filter(self, session: str) -> str:
        """WHERE clause picking the one version row this point denotes (the latest at or before a time)."""
        s = f"session_id = {quote(session)}"
        if self.version_id is not None:
            ordinal = ordinal_of(self.version_id)  # session.N.hash: the ordinal makes it a primary-key lookup
            by_ordinal = f" AND ordinal = {ordinal}" if ordinal is not None else ""
            return f"{s}{by_ordinal} AND version_id = {quote(self.version_id)}"
        if self.ordinal is not None:
            return f"{s} AND ordinal = {self.ordinal}"
        return f"{s} AND event_time <= fromUnixTimestamp64Micro({self.time}, 'UTC')"


def _micros(value: datetime) -> int:
    aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    return int(aware.timestamp() * 1_000_000)


Runner = Callable[[str], list[list[Any]] | list[tuple[Any, ...]]]


def version_sql(session: str, at: At) -> str:
    """The version row a point denotes. No FINAL: a replayed row is the same row, and LIMIT 1 keeps one."""
    return (
        "SELECT version_id, ordinal, toUnixTimestamp64Micro(event_time) FROM state_versions "
        f"WHERE {at.version_filter(session)} ORDER BY ordinal DESC LIMIT 1"
    )


def nodes_sql(session: str, ordinal: int, at_time: int | None = None) -> str:
    """Nodes live at version `ordinal`: opened by then and not ended by then (one session's key ranges).

    With `at_time` (a time after that version, before the next), nodes whose TTL passed by then are left out.
    No FINAL: a row the sink inserted twice (a replay) is the same row twice, which readers collapse by node_id
    (add `LIMIT 1 BY node_id` in SQL). Intervals are matched on a 64-bit hash of (node_id, from_ordinal): about
    5e-11 odds of a collision at 100,000 intervals of a session, and it halves the anti-join's cost.
    """
    s = quote(session)
    ended = (
        "SELECT cityHash64(node_id, from_ordinal) FROM state_node_ends "
        f"WHERE session_id = {s} AND to_ordinal <= {ordinal}"
    )
    ttl = ""
    if at_time is not None:
        ttl = f" AND (expires_at IS NULL OR expires_at > fromUnixTimestamp64Micro({at_time}, 'UTC'))"
    return (
        "SELECT node_id, type, data_json, toUnixTimestamp64Micro(expires_at) AS expires_us, caused_by_tool "
        "FROM state_nodes "
        f"WHERE session_id = {s} AND from_ordinal <= {ordinal} "
        f"AND cityHash64(node_id, from_ordinal) NOT IN ({ended}){ttl}"
    )


def edges_sql(session: str, ordinal: int) -> str:
    """Edges live at version `ordinal` (as nodes_sql).

    src and data_json repeat (an action causes many nodes; most edges carry `{}`): stored as LowCardinality
    (migration 0014), they reach Arrow as dictionaries, which halves the time to hand 100,000 edges over
    (measured on chDB); the src_lc and data_lc names are kept from when the query converted them.
    """
    s = quote(session)
    ended = (
        "SELECT cityHash64(src, dst, type, from_ordinal) FROM state_edge_ends "
        f"WHERE session_id = {s} AND to_ordinal <= {ordinal}"
    )
    return (
        "SELECT src AS src_lc, dst, type, data_json AS data_lc "
        f"FROM state_edges WHERE session_id = {s} "
        f"AND from_ordinal <= {ordinal} AND cityHash64(src, dst, type, from_ordinal) NOT IN ({ended})"
    )


def caused_by_tool_sql(tool: str, minutes: int = 5, session: str | None = None) -> str:
    """Nodes whose content a call of `tool` created in the last `minutes` (by version time).

    state_node_causes is sorted by (tool, time), for one session or all. `LIMIT 1 BY` every output column, not
    FINAL, collapses a node opened twice in the window and rows a replay inserted twice: the same rows as
    DISTINCT, about 2 ms sooner at 13,000 rows on chDB (bench/state_bench.py).
    """
    where = f"caused_by_tool = {quote(tool)} AND valid_from >= now64(6) - INTERVAL {int(minutes)} MINUTE"
    if session is not None:
        return (
            f"SELECT node_id, type FROM state_node_causes WHERE {where} AND session_id = {quote(session)} "
            "LIMIT 1 BY node_id, type"
        )
    return f"SELECT session_id, node_id, type FROM state_node_causes WHERE {where} LIMIT 1 BY session_id, node_id, type"


def node_changes_sql(session: str, lo: int, hi: int) -> str:
    """Node intervals live at version `lo` and not at `hi` (> lo), `side` 0, and live at `hi` and not at `lo`,
    `side` 1: what "diff lo..hi" reads, in place of both states.

    An interval live at one and not the other either ended in (lo, hi] having opened by lo, or opened in (lo, hi]
    and had not ended by hi; both are read by key ranges of one session, in one statement, and the answer is as
    large as the change, not the state. Columns and the interval hash as nodes_sql, then `side`.
    """
    columns = "node_id, type, data_json, toUnixTimestamp64Micro(expires_at) AS expires_us, caused_by_tool"
    return _changes_sql("state_nodes", "state_node_ends", "node_id", columns, session, lo, hi)


def edge_changes_sql(session: str, lo: int, hi: int) -> str:
    """Edge intervals live at `lo` only (`side` 0) and at `hi` only (`side` 1), hi > lo (as node_changes_sql)."""
    columns = "src AS src_lc, dst, type, data_json AS data_lc"
    return _changes_sql("state_edges", "state_edge_ends", "src, dst, type", columns, session, lo, hi)


def _changes_sql(table: str, ends: str, key: str, columns: str, session: str, lo: int, hi: int) -> str:
    """node_changes_sql / edge_changes_sql: intervals of `table` (closed in `ends`) named by `key`."""
    s, interval = quote(session), f"cityHash64({key}, from_ordinal)"
    ended = f"SELECT {interval} FROM {ends} WHERE session_id = {s} AND to_ordinal > {lo} AND to_ordinal <= {hi}"
    return (
        f"SELECT {columns}, 0 AS side FROM {table} WHERE session_id = {s} AND from_ordinal <= {lo} "
        f"AND {interval} IN ({ended} AND from_ordinal <= {lo}) UNION ALL "
        f"SELECT {columns}, 1 AS side FROM {table} WHERE session_id = {s} AND from_ordinal > {lo} "
        f"AND from_ordinal <= {hi} AND {interval} NOT IN ({ended})"
    )


def state_at(settings: Settings, session: str, at: str | int | datetime | At) -> StateGraph:
    """The session's graph at a version or time, from ClickHouse; StateNotFoundError if there is none.

    Three statements in one round trip (two when `at` is a time: the version is looked up first), answered as
    Arrow columns; nodes and edges become Python objects only when touched (treadle/state/columns.py).
    """
    from sinks.sql_client import arrow_batches

    with arrow_batches(settings) as run:
        return read_state_arrow(run, session, at)


def _version(rows: Any, session: str, at: str | int | datetime | At, point: At) -> tuple[str, int, int] | None:
    """(version id, ordinal, time) of the version row, None for the empty state; StateNotFoundError."""
    if not rows:
        if point.time is not None or point.ordinal == 0 or point.version_id == f"{session}.0.genesis":
            return None
        raise StateNotFoundError(f"no version {at!r} of session {session!r} in ClickHouse (yet)")
    version_id, ordinal, vtime = rows[0]
    return str(version_id), int(ordinal), int(vtime)


def read_state_arrow(run: ArrowBatchRunner, session: str, at: str | int | datetime | At) -> StateGraph:
    """state_at over any way of running SQL into Arrow tables (`run` returns one pyarrow.Table per statement).

    A version or an ordinal names its ordinal, so nodes, edges and the version row are asked for together
    (if the version is not there, the other two answers are dropped); a time needs its version first.
    """
    point = at if isinstance(at, At) else At.parse(session, at)
    known = point.ordinal if point.version_id is None else ordinal_of(point.version_id)
    if point.time is None and known:
        nodes_table, edges_table, version_table = run(
            [nodes_sql(session, known), edges_sql(session, known), version_sql(session, point)]
        )
        found = _version(_rows(version_table), session, at, point)
        assert found is not None and found[1] == known
        return StateGraph(session, *found, ColumnarNodes(nodes_table), ColumnarEdges(edges_table))
    (version_table,) = run([version_sql(session, point)])
    found = _version(_rows(version_table), session, at, point)
    if found is None:
        return StateGraph(session, f"{session}.0.genesis", 0, 0)
    version_id, ordinal, vtime = found
    nodes_table, edges_table = run([nodes_sql(session, ordinal, point.time), edges_sql(session, ordinal)])
    return StateGraph(session, version_id, ordinal, vtime, ColumnarNodes(nodes_table), ColumnarEdges(edges_table))


def _rows(table: Any) -> list[tuple[Any, ...]]:
    return [tuple(r.values()) for r in table.to_pylist()]


def read_state(run: Runner, session: str, at: str | int | datetime | At) -> StateGraph:
    """state_at over any way of running SQL into rows (`run` returns the rows of one query); builds every object."""
    point = at if isinstance(at, At) else At.parse(session, at)
    found = _version(run(version_sql(session, point)), session, at, point)
    if found is None:
        return StateGraph(session, f"{session}.0.genesis", 0, 0)
    version_id, ordinal, vtime = found
    node_rows = run(nodes_sql(session, int(ordinal), point.time))
    edge_rows = run(edges_sql(session, int(ordinal)))
    nodes = {
        r[0]: GraphNode(r[0], r[1], orjson.loads(r[2]), None if r[3] is None else int(r[3]), r[4]) for r in node_rows
    }
    edges = list({(r[0], r[1], r[2]): GraphEdge(r[0], r[1], r[2], orjson.loads(r[3])) for r in edge_rows}.values())
    return StateGraph(session, version_id, ordinal, vtime, nodes, edges)


@dataclass(frozen=True)
class StateDiff:
    """What changed from `before` to `after`: nodes and edges added, removed and changed, in id / key order (an
    edge whose data changed is in edges_added, after the new ones). From ClickHouse, the sequences are views over
    Arrow rows that build objects when touched (treadle/state/columns.py)."""

    before: StateGraph
    after: StateGraph
    added: Sequence[GraphNode] = field(default_factory=list)
    removed: Sequence[GraphNode] = field(default_factory=list)
    changed: Sequence[tuple[GraphNode, GraphNode]] = field(default_factory=list)
    edges_added: Sequence[GraphEdge] = field(default_factory=list)
    edges_removed: Sequence[GraphEdge] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        def node(n: GraphNode) -> dict[str, Any]:
            return {"id": n.id, "type": n.type, "data": n.data}

        def edge(e: GraphEdge) -> dict[str, Any]:
            return {"src": e.src, "dst": e.dst, "type": e.type, "data": e.data}

        return {
            "from": self.before.version_id,
            "to": self.after.version_id,
            "nodes_added": [node(n) for n in self.added],
            "nodes_removed": [node(n) for n in self.removed],
            "nodes_changed": [{"before": node(a), "after": node(b)} for a, b in self.changed],
            "edges_added": [edge(e) for e in self.edges_added],
            "edges_removed": [edge(e) for e in self.edges_removed],
        }


def diff(before: StateGraph, after: StateGraph) -> StateDiff:
    """What changed from `before` to `after`; two graphs read from ClickHouse are compared as Arrow columns."""
    graphs = (before.nodes, after.nodes, before.edges, after.edges)
    if all(isinstance(part, ColumnarNodes | ColumnarEdges) for part in graphs):
        return _change(before, after, *(part.arrow for part in graphs))  # type: ignore[attr-defined]
    a_nodes, a_edges = before.content()
    b_nodes, b_edges = after.content()
    edge_after = {(e.src, e.dst, e.type): e for e in after.edges}
    edge_before = {(e.src, e.dst, e.type): e for e in before.edges}
    return StateDiff(
        before=before,
        after=after,
        added=[after.nodes[i] for i in sorted(set(b_nodes) - set(a_nodes))],
        removed=[before.nodes[i] for i in sorted(set(a_nodes) - set(b_nodes))],
        changed=[
            (before.nodes[i], after.nodes[i]) for i in sorted(set(a_nodes) & set(b_nodes)) if a_nodes[i] != b_nodes[i]
        ],
        edges_added=[edge_after[k] for k in sorted(set(b_edges) - set(a_edges))]
        + [edge_after[k] for k in sorted(set(a_edges) & set(b_edges)) if a_edges[k] != b_edges[k]],
        edges_removed=[edge_before[k] for k in sorted(set(a_edges) - set(b_edges))],
    )


def state_diff(
    settings: Settings, session: str, first: str | int | datetime | At, second: str | int | datetime | At
) -> StateDiff:
    """diff(state_at(first), state_at(second)) read as the change between them, in one round trip.

    Between two versions (ids or ordinals) only the intervals that differ are read (node_changes_sql), so the
    cost follows the change, not the state; `before` and `after` read their whole graphs only when touched.
    A time on either side reads both states and compares them (TTL expiry is not an interval end).
    """
    from sinks.sql_client import arrow_batches, run_sql_arrow

    with arrow_batches(settings) as run:
        return read_diff_arrow(run, session, first, second, lambda sql: run_sql_arrow(settings, sql))


def read_diff_arrow(
    run: ArrowBatchRunner,
    session: str,
    first: str | int | datetime | At,
    second: str | int | datetime | At,
    read_later: Callable[[str], Any] | None = None,
) -> StateDiff:
    """state_diff over any way of running SQL into Arrow tables; `read_later` runs one statement when `before` or
    `after` is touched (default: `run`, which must then outlive the diff)."""
    points = [p if isinstance(p, At) else At.parse(session, p) for p in (first, second)]
    known = [p.ordinal if p.version_id is None else ordinal_of(p.version_id) for p in points]
    if any(p.time is not None for p in points) or None in known:
        return diff(read_state_arrow(run, session, first), read_state_arrow(run, session, second))
    o1, o2 = int(known[0] or 0), int(known[1] or 0)
    lo, hi = min(o1, o2), max(o1, o2)
    both = f"({points[0].version_filter(session)}) OR ({points[1].version_filter(session)})"
    versions_sql = (
        "SELECT version_id, ordinal, toUnixTimestamp64Micro(event_time) FROM state_versions "
        f"WHERE {both} LIMIT 1 BY version_id"
    )
    node_table, edge_table, version_table = run(  # the two large ones first: they run side by side
        [node_changes_sql(session, lo, hi), edge_changes_sql(session, lo, hi), versions_sql]
    )
    later = read_later or (lambda sql: run([sql])[0])
    rows = _rows(version_table)
    graphs = []
    for at, point, ordinal in zip((first, second), points, (o1, o2), strict=True):
        mine = [r for r in rows if int(r[1]) == ordinal and point.version_id in (None, r[0])]
        found = _version(mine, session, at, point)
        if found is None:
            graphs.append(StateGraph(session, f"{session}.0.genesis", 0, 0))
            continue
        nodes = ColumnarNodes(lambda o=ordinal: later(nodes_sql(session, o)))
        graphs.append(StateGraph(session, *found, nodes, ColumnarEdges(lambda o=ordinal: later(edges_sql(session, o)))))
    nodes_lo, nodes_hi = _sides(node_table)
    edges_lo, edges_hi = _sides(edge_table)
    if o1 > o2:  # read backwards: `first` is the later version
        return _change(graphs[0], graphs[1], nodes_hi, nodes_lo, edges_hi, edges_lo)
    return _change(graphs[0], graphs[1], nodes_lo, nodes_hi, edges_lo, edges_hi)


def _sides(table: Any) -> tuple[Any, Any]:
    """The rows of a *_changes_sql answer live at the earlier version only and at the later one only."""
    side = table.column("side")
    rows = table.drop_columns(["side"])
    return rows.filter(pc.equal(side, 0)), rows.filter(pc.equal(side, 1))


def _change(
    before: StateGraph, after: StateGraph, nodes_before: Any, nodes_after: Any, edges_before: Any, edges_after: Any
) -> StateDiff:
    """The StateDiff of two states from Arrow node and edge rows (whole states, or what is live on one side only)."""
    added, removed, changed = node_changes(nodes_before, nodes_after)
    edges_added, edges_removed = edge_changes(edges_before, edges_after)
    return StateDiff(before, after, added, removed, changed, edges_added, edges_removed)
