"""Replay export to Parquet vs a direct chDB `SELECT ... FORMAT Parquet` of the same rows, and export peak RSS.

    python -m bench.export_bench --rows 1000000 [--home DIR] [--shape transitions]

One embedded chDB data path is filled with N synthetic transitions (10 steps per session, two reward components
each, one of them a credit share) by INSERT ... SELECT FROM numbers(). Then, each in a fresh child process (chDB
allows one process per data path, and a child's peak RSS is its own): the export (`sinks.export.export`, keyset
pages, pyarrow ParquetWriter) and the baseline (the shape's whole query, `FORMAT Parquet`, written to a file), each
timed REPEATS times on a store opened first (the median counts; chDB's start is not timed on either side).
Both read the same rows through transitions_latest (FINAL). Run it at two sizes to see whether RSS is flat.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from topics.settings import Settings

REPEATS = 3  # each side runs this many times in its child; the median counts (the machine is shared)

FILL = """
INSERT INTO transitions (session_id, step, logical_event_id, revision, agent_id, episode_id, trace_id, policy_version,
    tool, params_json, dispatched_at, tool_status, output, error, latency_ms, cost_usd, tokens_in, tokens_out,
    result_at, reward, reward_status, reward_revision, `reward_components.event_id`, `reward_components.source`,
    `reward_components.name`, `reward_components.value`, `reward_components.confidence`,
    `reward_components.weight`, `reward_components.annotator`, `reward_components.event_time`, updated_at)
SELECT
    concat('session-', leftPad(toString(intDiv(number, 10)), 9, '0')), number % 10, generateUUIDv7(), 4,
    concat('agent-', toString(number % 8)), concat('episode-', toString(intDiv(number, 10))), '',
    concat('v', toString(number % 3)), 'search', concat('{"q":"', toString(number), '"}'),
    now64(6) - toIntervalSecond(number), 'OK', concat('result ', toString(number)), NULL, 12.5, 0.001, 100, 20,
    now64(6), (number % 100) / 100, 'complete', 2, [toString(generateUUIDv7()), toString(generateUUIDv7())],
    ['judge', 'credit'], ['reward', 'return'], [0.5, 0.25], [0.9, 1.0], [1.0, 1.0], ['LLM', 'CODE'],
    [now64(6), now64(6)], now64(6)
FROM numbers({rows})
"""


def settings_for(home: Path) -> Settings:
    return Settings(home=home)


def child_fill(home: Path, rows: int) -> dict:
    from sinks.clickhouse import ClickHouseStore
    from sinks.migrations import apply_migrations

    with ClickHouseStore.open(settings_for(home)) as store:
        apply_migrations(store)
        started = time.perf_counter()
        store.command_sync(FILL.replace("{rows}", str(int(rows))), settings={"max_insert_block_size": 100_000})
        store.command_sync("OPTIMIZE TABLE transitions FINAL")
        return {"seconds": time.perf_counter() - started}


def child_export(home: Path, shape: str, out: Path, batch_rows: int | None) -> dict:
    """The export on a store opened first, like the baseline: both time the reading and writing, not chDB's start."""
    from sinks.clickhouse import ClickHouseStore
    from sinks.export import export

    with ClickHouseStore.open(settings_for(home)) as store:
        store.read_only_queries_arrow_sync(["SELECT 1", "SELECT 2"])  # both read-only sessions, opened on first use
        times = []
        for _ in range(REPEATS):
            started = time.perf_counter()
            manifest = export(settings_for(home), shape, out, overwrite=True, batch_rows=batch_rows,
                              runner=store.read_only_queries_arrow_sync)  # fmt: skip
            times.append(time.perf_counter() - started)
    return {"seconds": statistics.median(times), "all": times, "rows": manifest.rows, "bytes": out.stat().st_size}


def child_direct(home: Path, shape: str, out: Path) -> dict:
    from sinks.clickhouse import ClickHouseStore
    from sinks.export_sql import ExportFilters, shape_sql

    query = f"{shape_sql(shape, ExportFilters())} FORMAT Parquet"
    with ClickHouseStore.open(settings_for(home)) as store:
        times = []
        for _ in range(REPEATS):
            started = time.perf_counter()
            data = store.call_sync(lambda client: client.raw_query(query))
            out.write_bytes(data)
            times.append(time.perf_counter() - started)
            del data
    import pyarrow.parquet as pq

    rows = pq.ParquetFile(out).metadata.num_rows
    return {"seconds": statistics.median(times), "all": times, "rows": rows, "bytes": out.stat().st_size}


def run_child(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "bench.export_bench", "--child", *args], capture_output=True,
                          text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"child {args[0]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--shape", default="transitions")
    parser.add_argument("--home", type=Path, default=None, help="Reuse a filled data path (skips the fill).")
    parser.add_argument("--batch-rows", type=int, default=None, help="Rows per export page (default: the shape's).")
    parser.add_argument("--child", nargs="+", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, home, *rest = args.child
        if kind == "fill":
            result = child_fill(Path(home), int(rest[0]))
        elif kind == "export":
            result = child_export(Path(home), rest[0], Path(rest[1]), int(rest[2]) or None)
        else:
            result = child_direct(Path(home), rest[0], Path(rest[1]))
        result["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
        return
    home = args.home or Path(tempfile.mkdtemp(prefix="treadle-export-bench-"))
    if args.home is None:
        print(f"filling {args.rows:,} transitions under {home} ...", flush=True)
        fill = run_child("fill", str(home), str(args.rows))
        print(f"  filled in {fill['seconds']:.1f}s")
    direct = run_child("direct", str(home), args.shape, str(home / "direct.parquet"))
    export = run_child("export", str(home), args.shape, str(home / "export.parquet"), str(args.batch_rows or 0))
    assert export["rows"] == direct["rows"], (export, direct)
    direct_rate, export_rate = direct["rows"] / direct["seconds"], export["rows"] / export["seconds"]
    for name, run, rate in (("direct chDB SELECT ... FORMAT Parquet", direct, direct_rate),
                            ("treadle export (keyset pages)", export, export_rate)):  # fmt: skip
        print(f"{name:38} {run['rows']:,} rows in {run['seconds']:.2f}s = {rate:,.0f} rows/s, "
              f"{run['bytes'] / 1e6:.1f} MB, peak RSS {run['max_rss_mb']:.0f} MB")  # fmt: skip
    print(f"ratio export/direct: {export_rate / direct_rate:.2f}x (target >= 0.8x)")


if __name__ == "__main__":
    main()
