"""Writing a Faust table from a batch: RocksDB plus changelog, without Faust's per-message slow path.

`table[key] = value` queues the changelog record in Faust's ProducerBuffer, which sends one message
per event-loop turn and throttles the stream once 100 are pending; measured on this project, that
capped a worker at ~800 input events/s. `put` writes the same RocksDB entry and sends the same
changelog record (same topic, partition, key and value) through the producer directly, acked with
the batch's outputs, so Faust's recovery replays it exactly as its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import faust
from rocksdict import WriteBatch

from streams.runtime.processor import InputEvent, ProcessingContext
from streams.runtime.rocksdb_memory import MIB, RocksDBMemory
from topics.settings import Settings


def bytes_table(app: faust.App, name: str, settings: Settings, help: str) -> Any:
    """A Faust table of raw bytes, co-partitioned with the input, in the worker's RocksDB memory budget.

    Without key/value types Faust would pick JSON; without shared options each partition's RocksDB may take a
    2 GiB block cache and 3 x 64 MiB write buffers, so a worker's RSS would grow with its tables for a long time
    (streams/runtime/rocksdb_memory.py).
    """
    table = app.Table(name, partitions=settings.partitions, key_type=bytes, value_type=bytes, help=help)
    store = table.data
    if getattr(store, "use_rocksdict", False):  # a rocksdb:// store (tests may run memory://)
        store.rocksdb_options = rocksdb_memory(app, settings).options()
    return table


def rocksdb_memory(app: faust.App, settings: Settings) -> RocksDBMemory:
    """The worker's one RocksDB budget (TREADLE_TABLE_MEMORY_MB), kept on its app: every table draws on it."""
    memory = _budget_of(app)
    if memory is None:
        memory = RocksDBMemory(settings.table_memory_mb * MIB)
        app.rocksdb_memory = memory  # type: ignore[attr-defined]
    return memory


def _budget_of(app: faust.App) -> RocksDBMemory | None:
    return getattr(app, "rocksdb_memory", None)


def get_in_partition(table: Any, key: bytes, partition: int) -> bytes | None:
    """table.get(key), read from the partition's RocksDB directly. Faust's path raises and catches a KeyError for
    every missing key (most new steps), runs sensors and updates its key index: ~5% of a worker's CPU."""
    return table.data._db_for_partition(partition).get(key)


def keys_in_order(table: Any, partition: int) -> Iterator[bytes]:
    """One partition's keys in byte order, read from its RocksDB directly (Faust's iteration walks every active
    partition and has no start key). Assumes the rocksdict driver, Faust's default and the one we install."""
    store = table.data
    db = store._db_for_partition(partition)
    for key in db.keys():  # noqa: SIM118 (an Rdict has no __iter__)
        if key != store.offset_key:
            yield key


def memory_report(app: faust.App) -> dict[str, int]:
    """Bytes of the worker's RocksDB budget in use (cache: everything charged to it), of its memtables, and its
    limit; empty before the first table exists."""
    memory = _budget_of(app)
    if memory is None:
        return {}
    memtables = 0
    for table in list(app.tables.values()):
        for db in list(getattr(table.data, "_dbs", {}).values()):
            memtables += db.property_int_value("rocksdb.cur-size-all-mem-tables") or 0
    return {"cache": memory.usage_bytes(), "memtables": memtables, "limit": memory.total_bytes}


def _db(table: Any, partition: int) -> Any:
    """The partition's RocksDB (rocksdict), as `get_in_partition` reads it. Writing it directly skips Faust's
    Store._set: a context variable naming the partition, and a key -> partition index our reads never use."""
    return table.data._db_for_partition(partition)


async def put(table: Any, key: bytes, value: bytes, event: InputEvent, ctx: ProcessingContext) -> None:
    """table[key] = value in the partition of `event` (any event of the key's session)."""
    await put_in_partition(table, key, value, event.source.partition, ctx)


async def put_in_partition(table: Any, key: bytes, value: bytes, partition: int, ctx: ProcessingContext) -> None:
    """table[key] = value in `partition` (a write-out of held-back steps, a timer, an expiry index entry)."""
    _db(table, partition).put(key, value)
    await ctx.send(table.changelog_topic.get_topic_name(), key, value, partition=partition)


async def write_in_partition(
    table: Any, items: Iterable[tuple[bytes, bytes | None]], partition: int, ctx: ProcessingContext
) -> int:
    """put_in_partition / delete_in_partition (value None) of many keys: one RocksDB write batch, then their changelog
    records in the same order. A commit writes a dozen keys per step; a put each was ~10% of the state worker.
    Returns how many keys."""
    written = list(items)
    if not written:
        return 0
    batch = WriteBatch(raw_mode=True)
    for key, value in written:
        if value is None:
            batch.delete(key)
        else:
            batch.put(key, value)
    _db(table, partition).write(batch)
    topic = table.changelog_topic.get_topic_name()
    for key, value in written:
        await ctx.send(topic, key, value, partition=partition)
    return len(written)


async def delete_in_partition(table: Any, key: bytes, partition: int, ctx: ProcessingContext) -> None:
    """del table[key] in `partition`: a tombstone in the changelog, so compaction and recovery drop the key too."""
    _db(table, partition).delete(key)
    await ctx.send(table.changelog_topic.get_topic_name(), key, None, partition=partition)


async def send_changelog(table: Any, key: bytes, value: bytes, partition: int, ctx: ProcessingContext) -> None:
    """The changelog half of put_in_partition: for a commit record that must be acked before it is used.

    Follow it with a producer flush, then `write_local` (put_acked does the three); the local RocksDB then never
    holds a record the changelog lost in a crash (recovery replays the changelog over it from Faust's last persisted
    offset).
    """
    await ctx.send(table.changelog_topic.get_topic_name(), key, value, partition=partition)


async def put_acked(table: Any, items: Iterable[tuple[bytes, bytes, int]], ctx: ProcessingContext) -> None:
    """table[key] = value for each (key, value, partition), written locally only once the broker has acked every
    changelog record (one producer flush for all, which also waits for everything sent before): for a commit record,
    or a state that must be on the broker before the outputs that depend on it go out."""
    written = list(items)
    for key, value, partition in written:
        await send_changelog(table, key, value, partition, ctx)
    await table.app.producer.flush()
    for key, value, partition in written:
        write_local(table, key, value, partition)


def write_local(table: Any, key: bytes, value: bytes, partition: int) -> None:
    """The RocksDB half of put_in_partition (its changelog record was sent and acked already)."""
    _db(table, partition).put(key, value)


def delete_local(table: Any, key: bytes, partition: int) -> None:
    """The RocksDB half of delete_in_partition (its tombstone was sent and acked already)."""
    _db(table, partition).delete(key)
