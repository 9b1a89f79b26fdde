"""State-graph benchmark: `python -m bench.state_bench [--nodes 100000] [--steps 4000] [--skip-worker|--skip-history]`.

1. Worker: a real `treadle worker` with TREADLE_PROCESSORS=state (sink off, own local stack) folds agent steps
   (dispatch + tool result + a delta of 5 node upserts, across sessions); the clock stops when every StateVersion
   is on the state_versions topic. Baseline, same run, same events: the worker with TREADLE_PROCESSORS=steps.
   Each prints its CPU per input event it reads, beside the CPU per input event the 10,000 deltas/s target leaves.
2. Fold on one core, in process: the same fold over an in-memory store, state serialized per batch of 100.
   Baseline: the same deltas applied to a plain dict.
3. History on chDB, one session grown to --nodes live nodes by the fold (updates and deletes, so there are more
   intervals than nodes; auto `causes` edges too), landed through sinks.rows into the migrated tables in sink-sized
   inserts. p50 of "state at version V" (treadle/state/history.py: nodes, edges, and the whole read_state) and
   "nodes caused by tool X in the last 5 minutes" (one session; all sessions). Baseline, same run, same data:
   the earlier cut's layout (one ReplacingMergeTree(closed) interval table read with FINAL, commit ba1d64d).
   Then the public reads (state_at, state_diff of the last 10 versions and of the second half, caused by tool X
   through /arrow) through the sink's endpoint in a process of its own: p50 and p99 of --public-runs, idle and
   while that process also inserts 10,000 state rows/s of other sessions (as a running worker's sink). Every read
   prints its p50 and p99.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from bench.common import loadavg, machine_facts
from processors.state.graph import FoldConfig, MemoryStore, SessionState, StateFold
from sinks.rows import TABLE_COLUMNS, rows_for
from sinks.sql_client import arrow_queries, run_sql, run_sql_arrow
from topics.names import DISPATCH, STATE_DELTA, TOOL_RESULT
from treadle.state.history import (
    caused_by_tool_sql,
    diff,
    edges_sql,
    nodes_sql,
    read_state,
    read_state_arrow,
    state_at,
    state_diff,
)

SESSION = "bench-session"
TOOLS = ["search", "write", "browse", "calc"]
OLD_NODES_DDL = """
CREATE TABLE old_state_nodes (
    session_id String, from_ordinal UInt64, node_id String, to_ordinal UInt64, type LowCardinality(String),
    data_json String, valid_from DateTime64(6, 'UTC'), valid_to DateTime64(6, 'UTC'),
    expires_at Nullable(DateTime64(6, 'UTC')), caused_by_tool LowCardinality(String), closed UInt8,
    INDEX idx_tool caused_by_tool TYPE set(256) GRANULARITY 1, INDEX idx_valid_from valid_from TYPE minmax GRANULARITY 1
) ENGINE = ReplacingMergeTree(closed) ORDER BY (session_id, from_ordinal, node_id)
"""
OPEN_ORDINAL = 2**64 - 1


def envelope(session: str, seq: int, t: int, lid: str | None = None) -> dict[str, Any]:
    event_id = f"{session}-e{seq}"
    return {"event_id": event_id, "session_id": session, "agent_id": "bench", "episode_id": "ep",
            "logical_event_id": lid or event_id, "seq": seq, "event_time": t, "policy_version": "",
            "trace_id": "", "attributes": {}}  # fmt: skip


def history_workload(total_nodes: int, per_delta: int, start: int, span_us: int, rng: random.Random):
    """(schema, record) in seq order for one session: dispatches, and deltas tied to them that upsert new nodes,
    update and delete a few older ones."""
    events, seq, created = [], 0, 0
    n_deltas = total_nodes // per_delta
    for k in range(n_deltas):
        t = start + span_us * k // n_deltas
        lid = f"step-{k}"
        events.append((DISPATCH, {"envelope": envelope(SESSION, seq, t, lid), "step": k, "tool": TOOLS[k % 4],
                                  "params_json": "{}", "deadline": None}))  # fmt: skip
        seq += 1
        ups = [
            {
                "id": f"n{i}",
                "type": "memory",
                "ttl_seconds": None,
                "data_json": orjson.dumps({"text": f"m{i}", "k": k}).decode(),
            }
            for i in range(created, created + per_delta)
        ]
        created += per_delta
        if created > per_delta:
            ups += [{"id": f"n{rng.randrange(created - per_delta)}", "type": "memory", "data_json": '{"upd":1}',
                     "ttl_seconds": None} for _ in range(per_delta // 10)]  # fmt: skip
        deletes = [f"n{rng.randrange(created)}" for _ in range(per_delta // 50)]
        events.append((STATE_DELTA, {"envelope": envelope(SESSION, seq, t + 1, lid), "node_upserts": ups,
                               "node_deletes": deletes, "edge_upserts": [], "edge_deletes": [],
                               "rollback_to": None}))  # fmt: skip
        seq += 1
    return events


def step_events(session: str, k: int, seq: int, t: int, upserts: int) -> list[tuple[str, dict[str, Any]]]:
    """One agent step: dispatch, tool result, and a delta of `upserts` nodes tied to the step."""
    lid = f"{session}-step-{k}"
    ups = [{"id": f"k{k}-{i}", "type": "note", "data_json": orjson.dumps({"k": k, "i": i}).decode(),
            "ttl_seconds": None} for i in range(upserts)]  # fmt: skip
    return [
        (DISPATCH, {"envelope": envelope(session, seq, t, lid), "step": k, "tool": TOOLS[k % 4],
                    "params_json": '{"q": 1}', "deadline": None}),
        (TOOL_RESULT, {"envelope": envelope(session, seq + 1, t + 1000, lid), "tool": TOOLS[k % 4], "status": "OK",
                  "output": "ok", "error": None, "latency_ms": 1.0, "cost_usd": 0.0, "tokens_in": 0, "tokens_out": 0,
                  "retries": 0}),
        (STATE_DELTA, {"envelope": envelope(session, seq + 2, t + 2000, lid), "node_upserts": ups, "node_deletes": [],
                 "edge_upserts": [], "edge_deletes": [], "rollback_to": None}),
    ]  # fmt: skip


# -- 2. fold ------------------------------------------------------------------------------------------------------


def bench_fold(n_deltas: int) -> tuple[float, float]:
    rng = random.Random(1)
    events = [
        e for e in history_workload(n_deltas * 5, 5, 1_760_000_000_000_000, 3_600_000_000, rng) if e[0] == STATE_DELTA
    ]
    fold = StateFold(FoldConfig(auto_nodes=False))
    state, store = SessionState(SESSION), MemoryStore()
    started = time.perf_counter()
    for i, (schema, record) in enumerate(events):
        fold.accept(state, store, schema, record)
        if i % 100 == 99:  # the worker writes the commit record once per batch
            state = SessionState.from_bytes(state.to_bytes())
    fold_rate = len(events) / (time.perf_counter() - started)
    plain: dict[str, str] = {}
    started = time.perf_counter()
    for _, record in events:
        for u in record["node_upserts"]:
            plain[u["id"]] = u["data_json"]
        for d in record["node_deletes"]:
            plain.pop(d, None)
    return fold_rate, len(events) / (time.perf_counter() - started)


# -- 3. history on chDB -------------------------------------------------------------------------------------------


def p50(run: Callable[[], Any], runs: int) -> tuple[float, float, int]:
    """Median and p99 wall milliseconds of `run` (after one warm-up) and the size of its last answer."""
    run()
    times, size = [], 0
    for _ in range(runs):
        started = time.perf_counter()
        result = run()
        times.append((time.perf_counter() - started) * 1000)
        size = _size(result)
    return statistics.median(times), _p99(times), size


def _p99(times: list[float]) -> float:
    """The 99th percentile (nearest rank): the largest of fewer than 100 runs."""
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _size(result: Any) -> int:
    if hasattr(result, "edges_added"):  # a StateDiff
        return (
            len(result.added)
            + len(result.removed)
            + len(result.changed)
            + len(result.edges_added)
            + len(result.edges_removed)
        )
    if hasattr(result, "nodes"):
        return len(result.nodes) + len(result.edges)
    if result and hasattr(result[0], "num_rows"):  # Arrow record batches
        return sum(batch.num_rows for batch in result)
    return len(result)


def interleaved(runs: list[Callable[[], Any]], n: int) -> list[tuple[float, float, int]]:
    """p50 and p99 of each of `runs`, taken in turns, so a change in machine load hits them alike."""
    sizes = [_size(run()) for run in runs]  # warm-up
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(n):
        for i, run in enumerate(runs):
            started = time.perf_counter()
            run()
            times[i].append((time.perf_counter() - started) * 1000)
    return [(statistics.median(t), _p99(t), size) for t, size in zip(times, sizes, strict=True)]


def old_rows(versions: list[dict[str, Any]]) -> list[list[Any]]:
    """The earlier cut's interval rows: an open row per interval, and a closed row replacing it."""
    rows = []
    for v in versions:
        at = v["event_time"]
        for c in v["node_changes"]:
            for interval, closed in ((c["prev"], 1), (c["next"], 0)):
                if interval is None:
                    continue
                exp = interval["expires_at"]
                end = (min(at, exp) if exp else at) if closed else (exp or 10_413_791_999_000_000)
                rows.append([SESSION, interval["from_ordinal"], c["node_id"], v["ordinal"] if closed else OPEN_ORDINAL,
                             interval["type"], interval["data_json"], interval["valid_from"], end, exp,
                             interval["caused_by_tool"], closed])  # fmt: skip
    return rows


def _state_parts(ch: Any) -> dict[str, int]:
    """Active parts per state table."""
    sql = (
        "SELECT table, count() FROM system.parts WHERE active AND database = currentDatabase() "
        "AND table LIKE 'state\\_%' GROUP BY table"
    )
    return dict(ch.query_sync(sql).result_rows)


def _wait_for_quiet_merge(ch: Any, timeout: float) -> float:
    """Seconds until each state table is one part and no merge runs, as a sink's tables are once it has been
    quiet for min_age_to_force_merge_seconds (migration 0014); merges compete with the timed queries."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        merging = ch.query_sync("SELECT count() FROM system.merges").result_rows[0][0]
        if not merging and all(n == 1 for n in _state_parts(ch).values()):
            break
        time.sleep(0.2)
    return time.perf_counter() - started


def bench_history(total_nodes: int, runs: int, batch: int, public_runs: int) -> list[tuple[str, float, float, int]]:
    from sinks.clickhouse import ClickHouseStore
    from sinks.migrations import apply_migrations
    from topics.settings import Settings

    now = int(time.time() * 1_000_000)
    events = history_workload(total_nodes, 100, now - 10 * 60_000_000, 10 * 60_000_000, random.Random(2))
    fold = StateFold(FoldConfig(history=16))
    state, store = SessionState(SESSION), MemoryStore()
    versions = [fold.apply(state, store, schema, record) for schema, record in events]
    rows: dict[str, list[list[Any]]] = {}
    for v in versions:
        for table, row in rows_for("state_versions", v):
            rows.setdefault(table, []).append([row[c] for c in TABLE_COLUMNS[table]])
    results: list[tuple[str, float, float, int]] = []
    with tempfile.TemporaryDirectory() as home, ClickHouseStore.open(settings := Settings(home=Path(home))) as ch:
        apply_migrations(ch)
        for table, data in rows.items():
            for i in range(0, len(data), batch):  # as the sink inserts: many parts
                ch.insert_sync(table, data[i : i + batch], TABLE_COLUMNS[table])
        ch.command_sync(OLD_NODES_DDL)
        old = old_rows(versions)
        names = ["session_id", "from_ordinal", "node_id", "to_ordinal", "type", "data_json", "valid_from",
                 "valid_to", "expires_at", "caused_by_tool", "closed"]  # fmt: skip
        for i in range(0, len(old), batch):
            ch.insert_sync("old_state_nodes", old[i : i + batch], names)
        last, middle = state.ordinal, state.ordinal // 2
        arrow = ch.read_only_queries_arrow_sync
        in_process = lambda: read_state_arrow(arrow, SESSION, last)  # noqa: E731
        tool_sql = caused_by_tool_sql("search", 5, SESSION)
        busy_parts = _state_parts(ch)
        (busy_state, busy_state99, size), (busy_tool, busy_tool99, tool_size) = interleaved(
            [in_process, lambda: arrow([tool_sql])], runs
        )
        quiet_s = _wait_for_quiet_merge(ch, 60.0)

        def q(sql: str) -> Callable[[], Any]:
            return lambda: ch.query_sync(sql).result_rows

        def arrow_table(sql: str) -> Callable[[], Any]:
            return lambda: ch.call_sync(lambda c: c.query_arrow(sql)).to_batches()

        count = ch.query_sync("SELECT (SELECT count() FROM state_nodes), (SELECT count() FROM state_edges)").result_rows
        opened, edges = count[0]
        results.append((f"{state.ordinal} versions, {state.node_count:,} live nodes, {opened:,} node intervals, "
                        f"{edges:,} edge intervals; measured once the tables had been quiet long enough to be "
                        f"merged into one part each ({quiet_s:.1f}s), as a sink's tables are between bursts",
                        0.0, 0.0, 0))  # fmt: skip
        results.append((f"right after the inserts ({max(busy_parts.values())} parts per table at most), "
                        "as while a sink keeps writing:", 0.0, 0.0, 0))  # fmt: skip
        results.append(("  state at V (last), in process", busy_state, busy_state99, size))
        results.append(("  nodes caused by tool X, as Arrow", busy_tool, busy_tool99, tool_size))
        old_at = (
            "SELECT node_id, type, data_json, toUnixTimestamp64Micro(expires_at), caused_by_tool FROM old_state_nodes "
            f"FINAL WHERE session_id = '{SESSION}' AND from_ordinal <= {{v}} AND to_ordinal > {{v}}"
        )
        results.append(("state at version V (last): nodes", *p50(q(nodes_sql(SESSION, last)), runs)))
        results.append(("  baseline: earlier cut, FINAL intervals", *p50(q(old_at.format(v=last)), runs)))
        results.append(("  same, as Arrow (columns, no tuples)", *p50(arrow_table(nodes_sql(SESSION, last)), runs)))
        results.append(("  baseline as Arrow", *p50(arrow_table(old_at.format(v=last)), runs)))
        plain = nodes_sql(SESSION, last).split(" AND from_ordinal")[0]  # same columns, every open row, no anti-join
        results.append(("  floor: every open row, no filter, tuples", *p50(q(plain), runs)))
        results.append(("state at version V (middle): nodes", *p50(q(nodes_sql(SESSION, middle)), runs)))
        results.append(("  baseline: earlier cut, FINAL intervals", *p50(q(old_at.format(v=middle)), runs)))
        results.append(("state at version V (last): edges", *p50(q(edges_sql(SESSION, last)), runs)))
        results.append(("nodes caused by tool X, last 5 min", *p50(q(caused_by_tool_sql("search", 5, SESSION)), runs)))
        old_tool = (
            "SELECT DISTINCT node_id, type FROM old_state_nodes FINAL WHERE session_id = '{s}' AND caused_by_tool = "
            "'search' AND valid_from >= now64(6) - INTERVAL 5 MINUTE"
        )
        results.append(("  baseline: earlier cut, FINAL intervals", *p50(q(old_tool.format(s=SESSION)), runs)))
        results.append(("  same, all sessions", *p50(q(caused_by_tool_sql("search", 5)), runs)))
        count_only = f"SELECT count() FROM ({caused_by_tool_sql('search', 5, SESSION)})"
        results.append(("  same, as Arrow", *p50(arrow_table(caused_by_tool_sql("search", 5, SESSION)), runs)))
        results.append(("  same, count() only (no rows to Python)", *p50(q(count_only), runs)))
        count_at = f"SELECT count() FROM ({nodes_sql(SESSION, last)})"
        results.append(("state at V (last), count() only", *p50(q(count_at), runs)))
        run = lambda sql: ch.query_sync(sql).result_rows  # noqa: E731
        one_by_one = lambda qs: [ch.read_only_query_arrow_sync(q) for q in qs]  # noqa: E731
        in_series = lambda: read_state_arrow(one_by_one, SESSION, last)  # noqa: E731
        (paired_ms, paired99, size), (series_ms, series99, _) = interleaved([in_process, in_series], runs)
        results.append(("state at V (last), in process: read_state_arrow", paired_ms, paired99, size))
        results.append(("  baseline: statements in series (interleaved)", series_ms, series99, size))
        results.append(("  baseline: read_state, rows to objects", *p50(lambda: read_state(run, SESSION, last), 5)))
        with _sql_endpoint(ch, settings):  # the sink's process owns chDB, as while a worker runs
            public = lambda: state_at(settings, SESSION, last)  # noqa: E731
            serial = lambda: _serial_state(settings, last)  # noqa: E731
            by_id = lambda: state_at(settings, SESSION, state.version_id)  # noqa: E731
            (public_ms, public99, size), (serial_ms, serial99, _), (by_id_ms, by_id99, _) = interleaved(
                [public, serial, by_id], runs
            )
            results.append(("state_at(V last): the public path", public_ms, public99, size))
            results.append(("  baseline: 3 statements in series (interleaved)", serial_ms, serial99, size))
            results.append(("  same, V by id (interleaved)", by_id_ms, by_id99, size))
            results.append(("  same, middle V", *p50(lambda: state_at(settings, SESSION, middle), runs)))
            touch = lambda: _touch(state_at(settings, SESSION, last))  # noqa: E731
            results.append(("  same, then every node and edge built", *p50(touch, max(3, runs // 4))))
            results.append(
                ("  baseline: earlier state_at, /sql JSON rows", *p50(lambda: _rows_state(settings, last), 3)),
            )
            tool_arrow = lambda: run_sql_arrow(settings, tool_sql).to_batches()  # noqa: E731
            results.append(("nodes caused by tool X: via /arrow endpoint", *p50(tool_arrow, runs)))
            tool_rows = lambda: run_sql(settings, tool_sql)[1]  # noqa: E731
            results.append(("  same via /sql (JSON rows, `treadle sql`)", *p50(tool_rows, runs)))
            arrow_diff = lambda: diff(state_at(settings, SESSION, last - 10), state_at(settings, SESSION, last))  # noqa: E731
            results.append(("diff V-10..V: two state_at, diff() as Arrow", *p50(arrow_diff, 5)))
            old_diff = lambda: diff(*(_as_objects(state_at(settings, SESSION, v)) for v in (last - 10, last)))  # noqa: E731
            results.append(("  baseline: two state_at, every object compared", *p50(old_diff, 3)))
            results.extend(_public_reads(settings, last, public_runs, "idle (the endpoint only serves reads)"))
        with _sql_endpoint(None, settings, write_rows_per_s=BUSY_ROWS_PER_S):
            busy = f"while the sink process inserts {BUSY_ROWS_PER_S:,} state rows/s (another session), as a worker's"
            results.extend(_public_reads(settings, last, public_runs, busy))
    return results


BUSY_ROWS_PER_S = 10_000


def _public_reads(settings: Any, last: int, runs: int, condition: str) -> list[tuple[str, float, float, int]]:
    """p50 and p99 of the three public reads (treadle state / AgentStream.state_at, treadle state --diff, a
    caused-by query through the sink's /arrow), taken in turns."""
    tool_sql = caused_by_tool_sql("search", 5, SESSION)
    reads = {
        "  state_at(V last)": lambda: state_at(settings, SESSION, last),
        "  state_diff(V-10..V)": lambda: state_diff(settings, SESSION, last - 10, last),
        "  state_diff(V/2..V)": lambda: state_diff(settings, SESSION, last // 2, last),
        "  caused by tool X, last 5 min (/arrow)": lambda: run_sql_arrow(settings, tool_sql).to_batches(),
    }
    measured = interleaved(list(reads.values()), runs)
    header = (f"public path, {runs} runs each in turns, {condition}; targets p50 20 / p99 50 / 5 ms; load {loadavg()}:",
              0.0, 0.0, 0)  # fmt: skip
    return [header, *[(label, *m) for label, m in zip(reads, measured, strict=True)]]


@contextmanager
def _sql_endpoint(store: Any, settings: Any, write_rows_per_s: int = 0) -> Iterator[None]:
    """The sink's SQL endpoint (sinks/service.py) in a process of its own, as a running worker serves it.

    chDB allows one process per path: `store` (if any) is closed while the endpoint process owns the data.
    With `write_rows_per_s`, that process also inserts state rows of other sessions, as a sink under load does.
    """
    import multiprocessing

    from streams.runtime.run_info import SqlEndpoint

    if store is not None:
        store.close()
    process = multiprocessing.get_context("spawn").Process(
        target=_serve_sql, args=(settings, write_rows_per_s), daemon=True
    )
    process.start()
    deadline = time.monotonic() + 60
    while SqlEndpoint.read(settings) is None:
        if time.monotonic() > deadline or not process.is_alive():
            raise RuntimeError("the bench's SQL endpoint did not start")
        time.sleep(0.1)
    try:
        yield
    finally:
        process.terminate()
        process.join()
        SqlEndpoint.path(settings).unlink(missing_ok=True)


def _serve_sql(settings: Any, write_rows_per_s: int = 0) -> None:
    from aiohttp import web

    from sinks.clickhouse import ClickHouseStore
    from sinks.service import sql_app
    from streams.runtime.run_info import SqlEndpoint

    async def serve() -> None:
        store = ClickHouseStore.open(settings)
        writing = [asyncio.create_task(_keep_writing(store, write_rows_per_s))] if write_rows_per_s else []
        runner = web.AppRunner(sql_app(store), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        SqlEndpoint(pid=os.getpid(), port=site._server.sockets[0].getsockname()[1]).write(settings)  # type: ignore[union-attr]
        await asyncio.gather(asyncio.Event().wait(), *writing)

    asyncio.run(serve())


async def _keep_writing(store: Any, rows_per_s: int) -> None:
    """Insert the state rows of fresh sessions (a 20,000-node history, renamed each round) at `rows_per_s`, in
    inserts of a tenth of a second's rows, as a sink landing other sessions' StateVersions does."""
    events = history_workload(20_000, 100, int(time.time() * 1_000_000), 60_000_000, random.Random(3))
    fold, state, store_ = StateFold(FoldConfig(history=16)), SessionState(SESSION), MemoryStore()
    rows = [(t, [row[c] for c in TABLE_COLUMNS[t]]) for s, r in events
            for t, row in rows_for("state_versions", fold.apply(state, store_, s, r))]  # fmt: skip
    per_insert, rounds = max(1, rows_per_s // 10), 0
    while True:
        rounds += 1
        for i in range(0, len(rows), per_insert):
            started = time.monotonic()
            by_table: dict[str, list[list[Any]]] = {}
            for table, row in rows[i : i + per_insert]:
                by_table.setdefault(table, []).append(
                    [
                        f"busy-{rounds}" if c == "session_id" else v
                        for c, v in zip(TABLE_COLUMNS[table], row, strict=True)
                    ]
                )
            for table, data in by_table.items():
                await store.insert(table, data, TABLE_COLUMNS[table])
            await asyncio.sleep(max(0.0, 0.1 - (time.monotonic() - started)))


def _serial_state(settings: Any, ordinal: int) -> Any:
    """The previous public path: version, nodes and edges one after another, a round trip each."""
    with arrow_queries(settings) as run:
        return read_state_arrow(lambda statements: [run(sql) for sql in statements], SESSION, ordinal)


def _touch(graph: Any) -> Any:
    """Build every node and edge object (what code that walks the whole graph pays)."""
    for node in graph.nodes.values():
        assert node.id
    for edge in graph.edges:
        assert edge.src
    return graph


def _as_objects(graph: Any) -> Any:
    """The graph as a dict of nodes and a list of edges (the earlier diff compared these object by object)."""
    from processors.state.model import StateGraph

    return StateGraph(
        graph.session_id, graph.version_id, graph.ordinal, graph.time, dict(graph.nodes), list(graph.edges)
    )


def _rows_state(settings: Any, ordinal: int) -> Any:
    """The earlier public path: rows as JSON through /sql, every object built."""
    return read_state(lambda sql: run_sql(settings, sql)[1], SESSION, ordinal)


# -- 1. worker ----------------------------------------------------------------------------------------------------


_TARGET_DELTAS_PER_CPU_S = 10_000  # issue #28's target, per worker core
# Input events each worker reads per step: the state processor reads the delta, the dispatch and the tool result;
# the steps processor the dispatch and the result (deltas are not its input). Its per-event CPU is the per-event
# cost of the project's most worked-on path on the same input, the floor the state worker's budget is set against.
_EVENTS_READ = {"state": 3, "steps": 2}


def bench_worker(steps: int, sessions: int, partitions: int, timeout: float, profile: Path | None = None) -> list[str]:
    """deltas/s through a real worker with the state processor; the steps-only worker is the baseline."""
    from bench.common import bench_settings, local_stack

    lines: list[str] = []
    with tempfile.TemporaryDirectory() as home:
        base = bench_settings(Path(home), f"statebench{int(time.time())}", partitions)
        if os.environ.get("STATE_BENCH_PORT_BASE"):  # beside another bench run on this machine
            port = int(os.environ["STATE_BENCH_PORT_BASE"])
            base = base.model_copy(
                update={"kafka_bootstrap_servers": f"127.0.0.1:{port}", "kafka_controller_port": port + 1,
                        "valkey_port": port + 2, "web_port": port + 3}
            )  # fmt: skip
        with local_stack(base) as took:
            lines.append(f"local stack up in {took:.1f}s; {steps} steps over {sessions} sessions, 3 events each")
            rates: dict[str, float] = {}
            for processors in (("state",), ("steps",)):
                name = f"{base.topic_prefix}{processors[0]}"
                settings = base.model_copy(
                    update={"processors": processors, "sink": "off", "topic_prefix": name, "app_id": name,
                            "home": Path(home) / processors[0]}
                )  # fmt: skip
                spy_to = profile if profile is not None and processors == ("state",) else None
                elapsed, cpu, done = asyncio.run(_drive(settings, steps, sessions, timeout, spy_to))
                rates[processors[0]] = steps / elapsed
                label = "state processor" if processors == ("state",) else "  baseline: steps processor"
                what = "StateVersions" if processors == ("state",) else "final Transitions"
                status = "" if done else f" (TIMED OUT, {done}/{what})"
                read = _EVENTS_READ[processors[0]] * steps
                lines.append(
                    f"{label:<40} {steps / elapsed:9,.0f} deltas/s  {3 * steps / elapsed:9,.0f} events/s "
                    f"({elapsed:.1f}s until every {what[:-1]}; {steps / cpu:,.0f} deltas per worker CPU second; "
                    f"{cpu / read * 1e6:,.0f} us of worker CPU per input event it reads){status}"
                )
                if processors == ("state",):
                    state_settings = settings
            raw = asyncio.run(_raw_consume(state_settings, 3 * steps))
            lines.append(
                f"{'  baseline: raw consume + decode':<40} {raw / 3:9,.0f} deltas/s  {raw:9,.0f} events/s "
                "(the same input topics, one aiokafka consumer + AvroCodec.decode)"
            )
            state_rate = rates["state"]
            ratios = f"state / steps {state_rate / rates['steps']:.3f}; state / raw {3 * state_rate / raw:.3f}"
            lines.append(f"{ratios}; target >= 10,000 deltas/s; load {loadavg()}")
            budget = 1e6 / (_TARGET_DELTAS_PER_CPU_S * _EVENTS_READ["state"])
            lines.append(f"the target leaves the state worker {budget:.0f} us of CPU per input event it reads")
    return lines


async def _raw_consume(settings: Any, events: int) -> float:
    """Events/s of a raw consume + decode of the input topics the worker read (bench.consume's loop)."""
    from bench.consume import consume

    measured, _ = await consume(settings, events, 120.0)
    return measured.rate


async def _drive(
    settings: Any, steps: int, sessions: int, timeout: float, profile: Path | None = None
) -> tuple[float, float, bool]:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    from bench.common import cpu_seconds
    from bench.worker_bench import BenchWorker, py_spy, stop_spy
    from streams.runtime.worker import prepare_cluster
    from streams.sdk.producer import producer_config
    from topics.catalog import TopicCatalog
    from topics.codec import AvroCodec

    await prepare_cluster(settings)
    catalog, codec = TopicCatalog(settings), AvroCodec()
    kinds = {DISPATCH: "actions", TOOL_RESULT: "tool_results", STATE_DELTA: "state_deltas"}
    encoded, t0 = [], 1_760_000_000_000_000
    for k in range(steps // sessions):
        for s in range(sessions):
            session = f"s{s}"
            for schema, record in step_events(session, k, 3 * k, t0 + k * 1_000_000, 5):
                encoded.append((catalog[kinds[schema]].name, session.encode(), codec.encode(schema, record)))
    state = settings.processors == ("state",)
    out_topic = catalog["state_versions" if state else "transitions"].name
    want = len(encoded) if state else steps // sessions * sessions
    worker = BenchWorker(settings, pin=False).start()
    spy = None
    try:
        await asyncio.to_thread(worker.wait_ready, 180)
        spy = py_spy(worker.pid, profile) if profile is not None else None
        cpu_before = cpu_seconds(worker.pid) or 0.0
        consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, auto_offset_reset="earliest")
        producer = AIOKafkaProducer(**producer_config(settings, client_id="state-bench"))
        await consumer.start()
        await producer.start()
        try:
            consumer.assign([TopicPartition(out_topic, p) for p in range(settings.partitions)])
            started = time.perf_counter()
            for topic, key, value in encoded:
                await producer.send(topic, value, key=key)
            await producer.flush()
            seen: set[tuple[str, int]] = set()
            deadline = started + timeout
            while len(seen) < want and time.perf_counter() < deadline:
                for messages in (await consumer.getmany(timeout_ms=200, max_records=5000)).values():
                    for message in messages:
                        record = codec.decode(message.value)[1]
                        seen.add(
                            (record["session_id"], record["ordinal"]) if state else (record["logical_event_id"], 0)
                        )
            elapsed = time.perf_counter() - started
            stop_spy(spy)
            return elapsed, (cpu_seconds(worker.pid) or 0.0) - cpu_before, len(seen) >= want
        finally:
            await producer.stop()
            await consumer.stop()
    finally:
        worker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100_000, help="live nodes of the history session (100,000)")
    parser.add_argument("--deltas", type=int, default=20_000, help="deltas for the in-process fold (20,000)")
    parser.add_argument("--steps", type=int, default=4_000, help="agent steps through the worker (4,000)")
    parser.add_argument("--sessions", type=int, default=40, help="sessions the worker's steps spread over (40)")
    parser.add_argument("--runs", type=int, default=21, help="timed runs per query; the median is shown (21)")
    parser.add_argument("--batch", type=int, default=5_000, help="rows per ClickHouse insert, as the sink (5,000)")
    parser.add_argument("--public-runs", type=int, default=100, help="timed runs per public read (p50, p99; 100)")
    parser.add_argument("--skip-worker", action="store_true", help="only the in-process sections (no Kafka)")
    parser.add_argument("--skip-history", action="store_true", help="no chDB history section")
    parser.add_argument("--profile", type=Path, help="py-spy the state worker (raw/collapsed) into this file")
    args = parser.parse_args()
    print(machine_facts())
    if not args.skip_worker:
        print("1. worker (own local stack, TREADLE_SINK=off, not pinned):")
        for line in bench_worker(args.steps, args.sessions, 4, 300.0, args.profile):
            print(f"  {line}")
    fold_rate, plain_rate = bench_fold(args.deltas)
    print("2. fold, in process, one core (5 upserts + deletes per delta, state serialized every 100 deltas):")
    print(f"  {'StateFold over a dict store':<40} {fold_rate:9,.0f} deltas/s")
    print(f"  {'  baseline: plain dict apply':<40} {plain_rate:9,.0f} deltas/s")
    if args.skip_history:
        return
    print(
        f"3. history on chDB, one session, {args.nodes:,} nodes created (p50 and p99 of {args.runs}; targets: "
        "state at V and diff p50 20 ms, p99 50 ms busy; caused by tool X p50 5 ms):"
    )
    for label, ms, ms99, rows in bench_history(args.nodes, args.runs, args.batch, args.public_runs):
        print(f"  {label}" if not ms else f"  {label:<44} p50 {ms:7.1f} ms  p99 {ms99:7.1f} ms  ({rows:,} rows)")


if __name__ == "__main__":
    main()
