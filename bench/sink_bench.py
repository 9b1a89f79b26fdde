"""Section 3: ClickHouseSink (add + flush) of N Transition records vs a direct chDB insert of the same rows.

Like with like: the same rows into the same table (the real migrations), the same batch size and insert settings
(sinks.writer.INSERT_SETTINGS). The baseline is the fastest direct insert of prebuilt columns found: the rows as
Arrow IPC streams built beforehand (untimed), inserted FORMAT ArrowStream, or as Native blocks chDB wrote, through
raw_insert (a temporary file on chDB) or from memory (chDB's send_insert, as the sink inserts on chDB); the same
columns as Python lists through clickhouse-connect's column insert are printed beside it, and so is the insert of
the Avro container the sink would hand ClickHouse for the same records, prebuilt (the sink's own cost is the
difference). The sink is timed on the path the consumer takes for the Transitions topic (the Avro bytes as they are
on the topic, in the ConsumerRecords a fetch returns: `add_encoded_records`, then Native blocks made natively) and
on the decoded-record path that input topics and the Avro fallback take (`add`: row mapping in Python). Background
merges are stopped on both tables: a run's merges would otherwise land in the next run's CPU clock.

chDB allows one data path per process, so this runs in its own process on a fresh path, with two databases
(bench_sink for the sink, bench_direct for the direct inserts):
    python -m bench.sink_bench --rows N --home DIR [--out FILE]     (without --out it prints the results)
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pyarrow as pa
from aiokafka.structs import ConsumerRecord

from bench.common import Measurement, machine_facts, median_run, write_measurements
from bench.workload import final_transitions, make_steps
from sinks.avro_container import AvroContainer
from sinks.chdb_insert import insert_from_memory
from sinks.clickhouse import ClickHouseStore
from sinks.migrations import apply_migrations, apply_pending
from sinks.native_blocks import NativeBlocks
from sinks.rows import TABLE_COLUMNS, rows_for
from sinks.writer import INSERT_SETTINGS, ClickHouseSink
from topics.codec import AvroCodec
from topics.names import TRANSITION
from topics.settings import Settings

SECTION = "3. sink"
SINK_DB, DIRECT_DB = "bench_sink", "bench_direct"
SINK_ENCODED = "ClickHouseSink"
SINK_DECODED = "ClickHouseSink, decoded records"
DIRECT_ARROW = "direct chDB insert (Arrow)"
DIRECT_COLUMNS = "direct chDB insert (Python columns)"
DIRECT_AVRO = "direct chDB insert (Avro)"
DIRECT_NATIVE = "direct chDB insert (Native)"
DIRECT_NATIVE_MEMORY = "direct chDB insert (Native, in memory)"
TARGET = 0.8
SINK_ENCODED_COMMAND = (
    "ClickHouseSink(batch_size={batch}).add_encoded_records('transitions', fetched ConsumerRecords, Transition) per "
    "fetch of up to {batch}, as the consumer does; flush() when full + at end"
)
SINK_DECODED_COMMAND = "ClickHouseSink(batch_size={batch}).add('transitions', decoded record) per record; flush()"
ARROW_COMMAND = "client.raw_insert('transitions', prebuilt Arrow IPC stream, fmt='ArrowStream'), {batch} rows each"
NATIVE_COMMAND = (
    "client.raw_insert('transitions', prebuilt Native block (chDB's own output), fmt='Native'), {batch} each"
)
NATIVE_MEMORY_COMMAND = (
    "sinks.chdb_insert.insert_from_memory(client, 'transitions', prebuilt Native block, 'Native'): chDB's send_insert, "
    "no temporary file, {batch} each"
)
AVRO_COMMAND = "client.raw_insert('transitions', prebuilt Avro container of the same bytes, fmt='Avro'), {batch} each"
COLUMNS_COMMAND = "client.insert('transitions', prebuilt columns, column_oriented=True), {batch} rows per insert"
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


def arrow_streams(store: ClickHouseStore, batches: list[list[list[Any]]]) -> list[bytes]:
    """Each batch as an Arrow IPC stream typed as ClickHouse reads the table back (so nothing is converted)."""
    columns = ", ".join(f"`{name}`" for name in NAMES)
    schema = store.call_sync(lambda c: c.query_arrow(f"SELECT {columns} FROM {DIRECT_DB}.transitions LIMIT 0")).schema
    streams = []
    for batch in batches:
        arrays = [pa.array(column, type=field.type) for column, field in zip(batch, schema, strict=True)]
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, schema) as writer:
            writer.write_table(pa.Table.from_arrays(arrays, schema=schema))
        streams.append(sink.getvalue().to_pybytes())
    return streams


def fetches(encoded: list[bytes], batch: int) -> list[list[ConsumerRecord]]:
    """The values as the sink's consumer gets them: aiokafka ConsumerRecords, at most `batch` per fetch
    (getmany(max_records=TREADLE_SINK_BATCH_SIZE)); made beforehand, as aiokafka makes them for the consumer."""
    records = [
        ConsumerRecord("treadle.transitions", 0, offset, 1_700_000_000_000, 0, None, value, None, -1, len(value), ())
        for offset, value in enumerate(encoded)
    ]
    return [records[start : start + batch] for start in range(0, len(records), batch)]


async def _sink_encoded(
    store: ClickHouseStore, fetched: list[list[ConsumerRecord]], batch: int, codec: AvroCodec
) -> None:
    sink = ClickHouseSink(store, batch_size=batch, codec=codec, native_blocks=True)
    for records in fetched:
        full = sink.add_encoded_records("transitions", records, TRANSITION)
        if full is None:
            raise RuntimeError("the sink did not take the fetched records as bytes")
        if full:
            await sink.flush()
    await sink.flush()


async def _sink_decoded(store: ClickHouseStore, records: list[dict[str, Any]], batch: int, codec: AvroCodec) -> None:
    sink = ClickHouseSink(store, batch_size=batch, codec=codec)
    for record in records:
        if sink.add("transitions", record):
            await sink.flush()
    await sink.flush()


async def _direct(store: ClickHouseStore, blocks: list[bytes], fmt: str) -> None:
    """Prebuilt blocks in format `fmt` (ArrowStream, Native, Avro), one insert each."""
    target, names, settings = f"{DIRECT_DB}.transitions", list(NAMES), dict(INSERT_SETTINGS)
    for block in blocks:
        await store.call(
            lambda client, block=block: client.raw_insert(target, names, insert_block=block, fmt=fmt, settings=settings)
        )


def native_blocks(store: ClickHouseStore, batches: list[list[list[Any]]], streams: list[bytes]) -> list[bytes]:
    """The same batches as Native blocks written by chDB itself, rows in the same order (a block sorted by the
    table's key would insert faster than the sink's batches can be), in the table's own column types."""
    columns = ", ".join(f"`{name}`" for name in NAMES)
    target, settings = f"{DIRECT_DB}.transitions", dict(INSERT_SETTINGS)
    ids_at = NAMES.index("logical_event_id")  # unique per row here
    store.command_sync(f"TRUNCATE TABLE {target}")
    blocks = []
    for batch, stream in zip(batches, streams, strict=True):
        store.call_sync(lambda c, s=stream: c.raw_insert(target, list(NAMES), insert_block=s, fmt="ArrowStream",
                                                         settings=settings))  # fmt: skip
        query = (
            f"SELECT {columns} FROM {target} WHERE logical_event_id IN {{ids:Array(String)}} "
            "ORDER BY indexOf({ids:Array(String)}, logical_event_id) FORMAT Native"
        )
        ids = batch[ids_at]
        blocks.append(store.call_sync(lambda c, q=query, ids=ids: c.raw_query(q, parameters={"ids": ids})))
        store.command_sync(f"TRUNCATE TABLE {target}")
    return blocks


def avro_containers(encoded: list[bytes], batch: int) -> list[bytes]:
    """The records as the sink hands them to ClickHouse (AvroContainer), built beforehand."""
    schema = AvroCodec().schemas[TRANSITION]
    files = []
    for start in range(0, len(encoded), batch):
        container = AvroContainer(schema)
        for value in encoded[start : start + batch]:
            container.append(value)
        files.append(container.to_bytes())
    return files


async def _direct_from_memory(store: ClickHouseStore, blocks: list[bytes], fmt: str) -> None:
    """Prebuilt blocks handed to chDB from memory (the insert the sink makes on chDB), one insert each."""
    target, names, settings = f"{DIRECT_DB}.transitions", list(NAMES), dict(INSERT_SETTINGS)
    for block in blocks:
        written = await store.call(
            lambda client, block=block: insert_from_memory(client, target, names, block, fmt, settings)
        )
        if written is None:
            raise RuntimeError("this chDB client takes no insert from memory")


async def _direct_columns(store: ClickHouseStore, batches: list[list[list[Any]]]) -> None:
    names, settings = list(NAMES), dict(INSERT_SETTINGS)
    for columns in batches:
        await store.call(
            lambda client, columns=columns: client.insert(
                "transitions", columns, column_names=names, database=DIRECT_DB, column_oriented=True,
                settings=settings,
            )
        )  # fmt: skip


async def _timed(
    store: ClickHouseStore, db: str, rows: int, run: Callable[[], Awaitable[None]]
) -> tuple[float, float, bool]:
    """One run into an emptied table: its process CPU seconds (every thread: chDB inserts in this process), its wall
    seconds, and whether the table then holds exactly `rows` rows."""
    await store.command(f"TRUNCATE TABLE {db}.transitions")
    cpu, wall = time.process_time(), time.perf_counter()
    await run()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    count = (await store.query(f"SELECT count() FROM {db}.transitions")).result_rows[0][0]
    return cpu, wall, count == rows


async def bench(store: ClickHouseStore, rows: int, batch: int, repeats: int) -> list[Measurement]:
    records = transitions(rows)
    codec = AvroCodec()
    encoded = [codec.encode(TRANSITION, record) for record in records]  # as the Transitions topic holds them
    batches = column_batches(records, batch)  # the direct inserts get their columns for free
    streams = arrow_streams(store, batches)
    blocks = native_blocks(store, batches, streams)
    files = avro_containers(encoded, batch)
    fetched = fetches(encoded, batch)
    runs: dict[str, Callable[[], Awaitable[None]]] = {
        DIRECT_ARROW: lambda: _direct(store, streams, "ArrowStream"),
        SINK_ENCODED: lambda: _sink_encoded(store, fetched, batch, codec),
        DIRECT_NATIVE: lambda: _direct(store, blocks, "Native"),
        DIRECT_NATIVE_MEMORY: lambda: _direct_from_memory(store, blocks, "Native"),
        DIRECT_COLUMNS: lambda: _direct_columns(store, batches),
        DIRECT_AVRO: lambda: _direct(store, files, "Avro"),
        SINK_DECODED: lambda: _sink_decoded(store, records, batch, codec),
    }
    db = dict.fromkeys(runs, DIRECT_DB) | {SINK_ENCODED: SINK_DB, SINK_DECODED: SINK_DB}
    # warm-up: first inserts create parts, load code
    await _sink_encoded(store, fetches(encoded[:1000], batch), batch, codec)
    await _sink_decoded(store, records[:1000], batch, codec)
    await _direct(store, arrow_streams(store, column_batches(records[:1000], batch)), "ArrowStream")
    for name in (SINK_DB, DIRECT_DB):  # a run's background merges would land in the next run's CPU clock
        await store.command(f"SYSTEM STOP MERGES {name}.transitions")
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    wall: dict[str, list[float]] = {name: [] for name in runs}
    wrong: set[str] = set()
    for repeat in range(repeats):  # alternating, and each repeat in the other order, so drift hits every path
        for name in runs if repeat % 2 == 0 else reversed(runs):
            used, elapsed, right = await _timed(store, db[name], rows, runs[name])
            cpu[name].append(used)
            wall[name].append(elapsed)
            if not right:
                wrong.add(name)
    components = sum(len(r["reward_components"]) for r in records) / rows
    made = {
        name: median_run(SECTION, name, command.format(batch=batch), rows, "rows", cpu[name])
        for name, command in (
            (DIRECT_ARROW, ARROW_COMMAND), (DIRECT_NATIVE, NATIVE_COMMAND),
            (DIRECT_NATIVE_MEMORY, NATIVE_MEMORY_COMMAND), (DIRECT_COLUMNS, COLUMNS_COMMAND),
            (DIRECT_AVRO, AVRO_COMMAND), (SINK_ENCODED, SINK_ENCODED_COMMAND), (SINK_DECODED, SINK_DECODED_COMMAND),
        )
    }  # fmt: skip
    prebuilt = (DIRECT_ARROW, DIRECT_NATIVE, DIRECT_NATIVE_MEMORY, DIRECT_COLUMNS)
    fastest = min(prebuilt, key=lambda name: made[name].elapsed_s)
    settings = ", ".join(f"{k}={v}" for k, v in INSERT_SETTINGS.items())
    made[fastest].notes.append(f"the baseline: the fastest direct insert this run; prebuilt, untimed; {settings}")
    made[DIRECT_COLUMNS].notes.append(f"rows mapped to columns beforehand (untimed); {components:.1f} components/row")
    made[DIRECT_AVRO].notes.append("the records as an Avro container, prebuilt (what the sink inserts without native)")
    made[SINK_ENCODED].notes.append(f"Avro bytes in, as on the topic; inserted as {sink_format()}")
    made[SINK_DECODED].notes.append("decoded records in: row mapping in Python, column insert")
    for name, measurement in made.items():
        measurement.notes.append(
            f"process CPU seconds per run (all threads); wall {' / '.join(f'{w:.3f}' for w in wall[name])} s"
        )
        if name != fastest:
            measurement.baseline = fastest
        if name in wrong:
            measurement.failed_checks.append(f"{name}: the table did not hold exactly {rows:,} rows after a run")
    made[SINK_ENCODED].target = TARGET
    return list(made.values())


def sink_format() -> str:
    """How the sink inserts the Transitions it keeps as bytes: Native blocks made natively, or Avro."""
    if NativeBlocks.built():
        return "Native blocks (treadle_native NativeBlockWriter)"
    return "an Avro container ClickHouse decodes (TREADLE_NATIVE=0 or no NativeBlockWriter)"


def report(results: list[Measurement]) -> str:
    """The results as plain lines: rate, ratio to the baseline, the samples, and the machine."""
    by_name = {m.name: m for m in results}
    lines = [machine_facts(), f"sink inserts: {sink_format()}; rates are rows per process CPU-second (all threads)"]
    for m in results:
        base = by_name.get(m.baseline or "")
        ratio = f"  {m.rate / base.rate:.2f}x {base.name}" if base is not None else "  (baseline)"
        if m.target is not None and base is not None:
            ratio += f"  target >= {m.target:.2f}x: {'ok' if m.rate / base.rate >= m.target else 'MISSED'}"
        samples = " / ".join(f"{s:.3f}" for s in m.samples)
        lines.append(f"{m.name:38} {m.rate:>10,.0f} rows/CPU-s{ratio}  (CPU {samples} s){' '.join(m.failed_checks)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--home", help="chDB home (a fresh temporary directory without it)")
    parser.add_argument("--batch-size", type=int, default=Settings().sink_batch_size)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="write the measurements as JSON here instead of printing them")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="treadle-sink-bench-") as scratch:
        store = ClickHouseStore.open(Settings(home=args.home or scratch), database=SINK_DB)
        try:
            apply_migrations(store)
            store.call_sync(lambda client: apply_pending(client, DIRECT_DB))
            results = asyncio.run(bench(store, args.rows, args.batch_size, args.repeats))
        finally:
            store.close()
    if args.out:
        write_measurements(args.out, results)
    else:
        print(report(results))


if __name__ == "__main__":
    main()
