"""Section 3: ClickHouseSink (add + flush) of N Transition records vs a direct chDB insert of the same rows.

chDB allows one data path per process, so this runs in its own process on a fresh path, with two databases
(bench_sink for the sink, bench_direct for the direct insert) created by the real migrations:
    python -m bench.sink_bench --rows N --home DIR --out FILE
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from bench.common import Measurement, median_run, write_measurements
from bench.workload import final_transitions, make_steps
from sinks.clickhouse import ClickHouseStore
from sinks.migrations import apply_migrations, apply_pending
from sinks.rows import TABLE_COLUMNS, rows_for
from sinks.writer import ClickHouseSink
from topics.codec import AvroCodec
from topics.settings import Settings

SECTION = "3. sink"
SINK_DB, DIRECT_DB = "bench_sink", "bench_direct"
SINK_COMMAND = "ClickHouseSink(batch_size={batch}).add('transitions', record) per record; flush() when full + at end"
DIRECT_COMMAND = "client.insert('transitions', prebuilt columns, column_oriented=True), {batch} rows per insert"
NAMES = TABLE_COLUMNS["transitions"]


def transitions(rows: int) -> list[dict[str, Any]]:
    """`rows` decoded final Transitions: up to 5,000 folded for real, the rest copies with their own keys."""
    codec = AvroCodec()
    distinct = min(rows, 5000)
    base = final_transitions(make_steps(distinct * 4, 200, seed=3), codec)[:distinct]
    while len(base) < distinct:  # make_steps stops on events, not steps: top up
        base += final_transitions(make_steps(4 * (distinct - len(base)), 50, seed=len(base)), codec)
    base = base[:distinct]
    out = []
    for i in range(rows):
        record = dict(base[i % distinct])
        if i >= distinct:
            record["session_id"] = f"{record['session_id']}-c{i // distinct}"
            record["logical_event_id"] = f"{record['logical_event_id']}-c{i // distinct}"
        out.append(record)
    return out


def column_batches(records: list[dict[str, Any]], batch: int) -> list[list[list[Any]]]:
    batches = []
    for start in range(0, len(records), batch):
        columns: list[list[Any]] = [[] for _ in NAMES]
        for record in records[start : start + batch]:
            for _, row in rows_for("transitions", record):
                for column, name in zip(columns, NAMES, strict=True):
                    column.append(row[name])
        batches.append(columns)
    return batches


async def _sink_once(store: ClickHouseStore, records: list[dict[str, Any]], batch: int) -> float:
    await store.command(f"TRUNCATE TABLE {SINK_DB}.transitions")
    sink = ClickHouseSink(store, batch_size=batch)
    started = time.perf_counter()
    for record in records:
        if sink.add("transitions", record):
            await sink.flush()
    await sink.flush()
    return time.perf_counter() - started


async def _direct_once(store: ClickHouseStore, batches: list[list[list[Any]]]) -> float:
    await store.command(f"TRUNCATE TABLE {DIRECT_DB}.transitions")
    started = time.perf_counter()
    for columns in batches:
        await store.call(
            lambda client, columns=columns: client.insert(
                "transitions", columns, column_names=list(NAMES), database=DIRECT_DB, column_oriented=True
            )
        )
    return time.perf_counter() - started


async def bench(store: ClickHouseStore, rows: int, batch: int, repeats: int) -> list[Measurement]:
    records = transitions(rows)
    batches = column_batches(records, batch)  # the direct insert gets its columns for free
    await _sink_once(store, records[:1000], batch)  # warm-up: first inserts create parts, load code
    await _direct_once(store, column_batches(records[:1000], batch))
    direct_samples, sink_samples = [], []
    for _ in range(repeats):
        direct_samples.append(await _direct_once(store, batches))
        sink_samples.append(await _sink_once(store, records, batch))
    counts = [
        (await store.query(f"SELECT count() FROM {db}.transitions")).result_rows[0][0] for db in (DIRECT_DB, SINK_DB)
    ]
    check = "row counts match" if counts == [rows, rows] else f"ROW COUNTS {counts} != {rows}"
    components = sum(len(r["reward_components"]) for r in records) / rows
    direct = median_run(
        SECTION, "direct chDB insert", DIRECT_COMMAND.format(batch=batch), rows, "rows", direct_samples,
        notes=[f"rows mapped to columns beforehand (untimed); {components:.1f} reward components/row"],
    )  # fmt: skip
    sink = median_run(
        SECTION, "ClickHouseSink", SINK_COMMAND.format(batch=batch), rows, "rows", sink_samples,
        baseline="direct chDB insert", notes=[f"decoded records in: row mapping + buffering + insert; {check}"],
    )  # fmt: skip
    return [direct, sink]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--home", required=True)
    parser.add_argument("--batch-size", type=int, default=Settings().sink_batch_size)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    store = ClickHouseStore.open(Settings(home=args.home), database=SINK_DB)
    try:
        apply_migrations(store)
        store.call_sync(lambda client: apply_pending(client, DIRECT_DB))
        results = asyncio.run(bench(store, args.rows, args.batch_size, args.repeats))
    finally:
        store.close()
    write_measurements(args.out, results)


if __name__ == "__main__":
    main()
