"""State-graph benchmark: `python -m bench.state_bench [--nodes 100000] [--deltas 20000]`.

1. Fold: deltas applied per second on one core by the state processor's fold (StateFold over a dict store,
   serializing SessionState per delta as the worker does), baseline: the same deltas applied to a plain dict.
2. History on chDB: one session grown to --nodes live nodes by the fold (with updates and deletes, so the
   interval tables hold more rows than nodes), landed through sinks.rows into the migrated tables; then p50 of
   "state at version V" (streams.state_history.nodes_sql) and "nodes caused by tool X in the last 5 minutes"
   (caused_by_tool_sql), each beside a baseline: the same answer from a plain full scan of the same rows
   (a MergeTree with no sort key, deduplicated with argMax).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import orjson

from processors.state_graph import DELTA, DISPATCH, FoldConfig, MemoryStore, SessionState, StateFold
from sinks.clickhouse import ClickHouseStore
from sinks.migrations import apply_migrations
from sinks.rows import TABLE_COLUMNS, rows_for
from streams.settings import Settings
from streams.state_history import At, caused_by_tool_sql, nodes_sql

SESSION = "bench-session"
TOOLS = ["search", "write", "browse", "calc"]


def envelope(seq: int, t: int, lid: str | None = None) -> dict:
    event_id = f"e{seq}"
    return {"event_id": event_id, "session_id": SESSION, "agent_id": "bench", "episode_id": "ep",
            "logical_event_id": lid or event_id, "seq": seq, "event_time": t, "policy_version": "",
            "trace_id": "", "attributes": {}}  # fmt: skip


def workload(total_nodes: int, per_delta: int, start: int, span_us: int, rng: random.Random):
    """(schema, record) in seq order: dispatches, and deltas tied to them, upserting/updating/deleting nodes."""
    events, seq, created = [], 0, 0
    n_deltas = total_nodes // per_delta
    for k in range(n_deltas):
        t = start + span_us * k // n_deltas
        lid = f"step-{k}"
        tool = TOOLS[k % len(TOOLS)]
        events.append((DISPATCH, {"envelope": envelope(seq, t, lid), "step": k, "tool": tool,
                                  "params_json": "{}", "deadline": None}))  # fmt: skip
        seq += 1
        ups = [{"id": f"n{created + i}", "type": "memory", "data_json": orjson.dumps({"text": f"m{created + i}",
                "k": k}).decode(), "ttl_seconds": None} for i in range(per_delta)]  # fmt: skip
        created += per_delta
        if created > per_delta:  # update and delete a few older nodes: more intervals than nodes
            ups += [{"id": f"n{rng.randrange(created - per_delta)}", "type": "memory", "data_json": '{"upd":1}',
                     "ttl_seconds": None} for _ in range(per_delta // 10)]  # fmt: skip
        deletes = [f"n{rng.randrange(created)}" for _ in range(per_delta // 50)]
        events.append((DELTA, {"envelope": envelope(seq, t + 1, lid), "node_upserts": ups, "node_deletes": deletes,
                               "edge_upserts": [], "edge_deletes": [], "rollback_to": None}))  # fmt: skip
        seq += 1
    return events


def bench_fold(n_deltas: int) -> tuple[float, float]:
    rng = random.Random(1)
    events = [e for e in workload(n_deltas * 5, 5, 1_760_000_000_000_000, 3_600_000_000, rng) if e[0] == DELTA]
    fold = StateFold(FoldConfig(auto_nodes=False))
    state, store = SessionState(SESSION), MemoryStore()
    started = time.perf_counter()
    for schema, record in events:
        fold.accept(state, store, schema, record)
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


def p50(store: ClickHouseStore, sql: str, runs: int) -> tuple[float, int]:
    store.query_sync(sql)  # warm
    times, rows = [], 0
    for _ in range(runs):
        started = time.perf_counter()
        rows = len(store.query_sync(sql).result_rows)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), rows


def bench_history(total_nodes: int, runs: int) -> list[tuple[str, float, int]]:
    rng = random.Random(2)
    now = int(time.time() * 1_000_000)
    events = workload(total_nodes, 100, now - 10 * 60_000_000, 10 * 60_000_000, rng)  # the last 10 minutes
    fold = StateFold(FoldConfig(history=16))
    state, store = SessionState(SESSION), MemoryStore()
    versions = [fold.apply(state, store, schema, record) for schema, record in events]
    columns: dict[str, list[list]] = {
        t: [[] for _ in TABLE_COLUMNS[t]] for t in ("state_versions", "state_nodes", "state_edges")
    }
    for v in versions:
        for table, row in rows_for("state_versions", v):
            for column, name in zip(columns[table], TABLE_COLUMNS[table], strict=True):
                column.append(row[name])
    with tempfile.TemporaryDirectory() as home, ClickHouseStore.open(Settings(home=Path(home))) as ch:
        apply_migrations(ch)
        for table, data in columns.items():
            ch.insert_sync(table, data, TABLE_COLUMNS[table], column_oriented=True)
        ch.command_sync("CREATE TABLE nodes_scan ENGINE = MergeTree ORDER BY tuple() AS SELECT * FROM state_nodes")
        middle = state.ordinal // 2
        results = [("versions / live nodes / interval rows", 0.0, 0)]
        interval_rows = ch.query_sync("SELECT count() FROM state_nodes").result_rows[0][0]
        results[0] = (f"{state.ordinal} versions, {state.node_count} live nodes, {interval_rows} node rows", 0, 0)
        results.append(("state at version V (last)", *p50(ch, nodes_sql(SESSION, At(ordinal=state.ordinal)), runs)))
        results.append(("state at version V (middle)", *p50(ch, nodes_sql(SESSION, At(ordinal=middle)), runs)))
        baseline = (
            "SELECT node_id, argMax(type, closed), argMax(data_json, closed) FROM nodes_scan "
            f"WHERE session_id = '{SESSION}' GROUP BY node_id, from_ordinal "
            f"HAVING min(from_ordinal) <= {state.ordinal} AND min(to_ordinal) > {state.ordinal}"
        )
        results.append(("  baseline: full scan + argMax dedup", *p50(ch, baseline, runs)))
        results.append(("nodes caused by tool X, last 5 min", *p50(ch, caused_by_tool_sql("search", 5, SESSION), runs)))
        scan = (
            "SELECT DISTINCT session_id, node_id, type FROM nodes_scan WHERE caused_by_tool = 'search' "
            "AND valid_from >= now64(6) - INTERVAL 5 MINUTE"
        )
        results.append(("  baseline: full scan, no FINAL", *p50(ch, scan, runs)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100_000)
    parser.add_argument("--deltas", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    fold_rate, plain_rate = bench_fold(args.deltas)
    print(f"fold: {fold_rate:,.0f} deltas/s on one core (5 upserts + deletes each, state serialized per delta)")
    print(f"  baseline: plain dict apply {plain_rate:,.0f} deltas/s")
    print(f"history on chDB, one session, {args.nodes:,} nodes created:")
    for label, ms, rows in bench_history(args.nodes, args.runs):
        print(f"  {label}" if not ms else f"  {label:<40} p50 {ms:7.1f} ms  ({rows:,} rows)")


if __name__ == "__main__":
    main()
