"""The batched, idempotent ClickHouse writer the worker feeds from the output and input topics.

Records are mapped to rows (sinks.rows) and buffered column by column per table, so a flush is one
column-oriented insert per table with no per-row work left. Idempotency comes from the tables, not from the
writer: rows are deterministic and every table is a ReplacingMergeTree keyed on the record's identity, so a
replay after a crash (same records again, in other batches) leaves the *_latest views unchanged. Commit the
consumer offsets of a batch only after `flush()` returned: that makes the pipeline at-least-once into tables
that absorb duplicates.

Records bound for a table whose columns are their fields (sinks.rows.AVRO_TABLES) can skip Python altogether:
`add_encoded` keeps their bytes, and at flush treadle_native turns them into one Native block (NativeBlocks), or,
without it, ClickHouse decodes them as Avro (AvroContainer). A batch either refuses goes the Python way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from operator import itemgetter, methodcaller
from typing import Any

from sinks.avro_container import AvroContainer
from sinks.clickhouse import ClickHouseStore, ClickHouseUnavailableError
from sinks.native_blocks import FORMAT as NATIVE_FORMAT
from sinks.native_blocks import NativeBlocks
from sinks.rejected_rows import RejectStage, RowSource, rejected_row, row_source
from sinks.rows import AVRO_TABLES, TABLE_COLUMNS, rows_for
from streams.runtime.metrics import SinkMetrics
from topics.codec import HEADER, AvroCodec, DecodeError, single_object_header

log = logging.getLogger(__name__)

REJECTED = "rejected_rows"
# Every table the sink writes is a ReplacingMergeTree read through FINAL (*_latest views), so collapsing equal keys
# inside each inserted block buys nothing the merges and views do not already do; on chDB it was about half of an
# insert's time (20,000 Transitions: 110,000 -> 200,000 rows/s as Arrow, 70,000 -> 125,000 as Avro).
INSERT_SETTINGS: Mapping[str, Any] = {"optimize_on_insert": 0}


class _TableBatch:
    """Buffered rows of one table, each a tuple in column order; turned into columns once, when inserted.

    A row is taken out of its dict by one itemgetter call and the batch is transposed by one zip at flush, both in
    C: appending to one list per column cost the sink a Python-level call per column and row (36 for a Transition).
    """

    __slots__ = ("_values_of", "names", "sources", "values")

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self._values_of = itemgetter(*names)
        self.values: list[tuple[Any, ...]] = []
        self.sources: list[RowSource | None] = []  # where each row came from, for rejected_rows

    @property
    def rows(self) -> int:
        return len(self.values)

    def append(self, row: Mapping[str, Any], source: RowSource | None = None) -> None:
        self.append_values(self._values_of(row), source)

    def append_values(self, values: tuple[Any, ...], source: RowSource | None = None) -> None:
        """One row's values, in column order."""
        self.values.append(values)
        self.sources.append(source)

    def extend_front(self, other: _TableBatch) -> None:
        """Put `other`'s rows (an earlier batch whose insert failed) before this batch's rows."""
        self.values = other.values + self.values
        self.sources = other.sources + self.sources

    @property
    def columns(self) -> list[list[Any]]:
        """The whole batch, one list per column."""
        return _transposed(self.values, len(self.names))

    def pick(self, indexes: list[int]) -> list[list[Any]]:
        """The columns of the rows at `indexes`."""
        values = self.values
        return _transposed([values[i] for i in indexes], len(self.names))


def _transposed(rows: list[tuple[Any, ...]], width: int) -> list[list[Any]]:
    return [list(column) for column in zip(*rows, strict=True)] if rows else [[] for _ in range(width)]


# Each table's row dict -> its values in column order, as a tuple (every table has several columns).
_ROW_VALUES: Mapping[str, itemgetter] = {table: itemgetter(*names) for table, names in TABLE_COLUMNS.items()}


class ClickHouseSink:
    """Buffers rows per table and inserts each table's batch in one insert.

    `add` is synchronous and cheap; it returns True when a table reached `batch_size`, which is the caller's
    cue to `await flush()`. `put` does both. Time-based flushing (settings.sink_flush_seconds) is the caller's
    loop: call `flush()` on a timer; it is a no-op when nothing is buffered.
    """

    def __init__(
        self,
        store: ClickHouseStore,
        batch_size: int = 5000,
        metrics: SinkMetrics | None = None,
        codec: AvroCodec | None = None,
        native_blocks: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.store = store
        self.batch_size = batch_size
        self.metrics = metrics
        self.codec = codec or AvroCodec()
        self.undecodable = 0  # encoded records neither ClickHouse nor the codec could read (logged, not inserted)
        self._batches: dict[str, _TableBatch] = {}
        self._containers: dict[str, AvroContainer] = {}  # table -> records inserted as Native blocks or Avro
        self._native = NativeBlocks(store, native_blocks)  # a container as one Native block, where it can
        self._headers: dict[str, bytes] = {}  # schema name -> single-object header of its current version
        self._written: dict[str, int] = dict.fromkeys(TABLE_COLUMNS, 0)
        self._flush_lock = asyncio.Lock()

    def add(
        self, kind: str, record: Mapping[str, Any], source: RowSource | None = None, schema_name: str | None = None
    ) -> bool:
        """Buffer the rows of one decoded record of topic kind `kind`; True when a batch is full. A topic that
        carries several schemas needs the record's `schema_name` (sinks.rows.rows_for).

        With its `source`, a record whose rows cannot be made becomes a rejected_rows row instead of raising."""
        try:  # every row of the record is made before any is buffered: a record is written whole or rejected
            rows = [(table, _ROW_VALUES[table](row)) for table, row in rows_for(kind, record, schema_name)]
        except Exception as exc:
            if source is None:
                raise
            self.reject(RejectStage.MAP, kind, f"mapping the record to rows failed: {exc!r}", source)
            return False
        full = False
        for table, values in rows:
            batch = self._batches.get(table)
            if batch is None:
                batch = self._batches[table] = _TableBatch(TABLE_COLUMNS[table])
            batch.append_values(values, source)
            full |= batch.rows >= self.batch_size
        return full

    def reject(self, stage: RejectStage, table: str, reason: str, source: RowSource) -> None:
        """Write `source` to rejected_rows (with the next flush) instead of `table`."""
        log.error("%s[%d]@%d is not written to %s but to rejected_rows (%s): %s", source.topic, source.partition,
                  source.offset, table, stage, reason)  # fmt: skip
        if self.metrics is not None:
            self.metrics.rejected_rows.labels(table, str(stage)).inc()
        batch = self._batches.get(REJECTED)
        if batch is None:
            batch = self._batches[REJECTED] = _TableBatch(TABLE_COLUMNS[REJECTED])
        batch.append(rejected_row(stage, table, reason, source))

    def add_encoded(
        self, kind: str, value: bytes | None, expect: str | frozenset[str], source: RowSource | None = None
    ) -> bool:
        """Buffer one record of topic kind `kind` as it is on the topic (schema `expect`, or the set of schemas a
        multi-schema topic carries: topics.catalog.topic_expectation); True when a batch is full.

        Written with the current version of `expect` and bound for an AVRO_TABLES table, it stays bytes until
        ClickHouse reads it; anything else is decoded here, and DecodeError propagates.
        """
        table = AVRO_TABLES.get(kind)
        if table is not None and value is not None:
            container = self._containers.get(table)
            if container is not None and container.schema.name == expect and value.startswith(container.header):
                container.values.append(value)  # the common case, inlined: this runs once per record
                container.sources.append(source)
                return len(container.values) >= self.batch_size
            if value[: HEADER.size] == self._header(expect):
                if container is None:
                    container = self._containers[table] = AvroContainer(self.codec.schemas[expect])
                container.append(value, source)
                return container.rows >= self.batch_size
        schema_name, record = self.codec.decode(value, expect=expect)
        return self.add(kind, record, source, schema_name)

    def add_encoded_records(self, kind: str, records: Sequence[Any], expect: str | frozenset[str]) -> bool | None:
        """Buffer consecutive Kafka records of one topic (aiokafka ConsumerRecords) as `add_encoded` would, when all
        of them stay bytes: each written with the current version of `expect` and bound for an AVRO_TABLES table.
        True when a batch is full; None, having buffered nothing, when that does not hold (the caller then adds them
        one by one). The records themselves are kept as their rows' sources (`row_source` reads them if a row is
        rejected): making a RowSource and a call per record cost more than the rest of the sink's Python work."""
        table = AVRO_TABLES.get(kind)
        if table is None or not records or not isinstance(expect, str):
            return None
        container = self._containers.get(table)
        if container is not None and container.schema.name != expect:
            return None
        header = self._header(expect) if container is None else container.header
        values = [record.value for record in records]
        try:
            if not all(map(methodcaller("startswith", header), values)):
                return None
        except AttributeError:  # a tombstone (None): the one-by-one way decodes and reports it
            return None
        if container is None:
            container = self._containers[table] = AvroContainer(self.codec.schemas[expect])
        container.values += values
        container.sources += records
        return len(container.values) >= self.batch_size

    def _header(self, schema_name: str) -> bytes:
        header = self._headers.get(schema_name)
        if header is None:
            header = self._headers[schema_name] = single_object_header(self.codec.schemas[schema_name])
        return header

    async def put(self, kind: str, record: Mapping[str, Any]) -> None:
        """`add`, then flush if a batch is full."""
        if self.add(kind, record):
            await self.flush()

    @property
    def pending(self) -> int:
        """Rows buffered and not yet inserted, all tables together."""
        return sum(self.pending_rows.values())

    @property
    def pending_rows(self) -> dict[str, int]:
        """Rows buffered and not yet inserted, per table."""
        pending: dict[str, int] = {}
        for buffers in (self._batches, self._containers):
            for table, buffer in buffers.items():
                if buffer.rows:
                    pending[table] = pending.get(table, 0) + buffer.rows
        return pending

    @property
    def rows_written(self) -> dict[str, int]:
        """Rows inserted so far by this sink, per table (replayed duplicates included)."""
        return dict(self._written)

    async def flush(self) -> dict[str, int]:
        """Insert every buffered batch, one insert per table; returns rows inserted per table.

        On failure the batches not yet inserted stay buffered (ahead of rows added meanwhile) and the error
        propagates; retrying is safe since re-inserting rows that did land changes nothing.
        """
        async with self._flush_lock:
            inserted: dict[str, int] = {}
            containers, self._containers = self._containers, {}
            try:
                for table in list(containers):
                    await self._insert_container(table, containers[table], inserted)
                    del containers[table]
            finally:
                _keep_unflushed(containers, self._containers)
            batches, self._batches = self._batches, {}
            try:
                for table in [*(t for t in batches if t != REJECTED), REJECTED]:
                    if table == REJECTED and REJECTED in self._batches:  # rejects found while inserting the others
                        found = self._batches.pop(REJECTED)
                        if REJECTED in batches:
                            found.extend_front(batches[REJECTED])
                        batches[REJECTED] = found
                    batch = batches.get(table)
                    if batch is not None and batch.rows:
                        inserted[table] = inserted.get(table, 0) + await self._insert_batch(table, batch)
                    batches.pop(table, None)
            finally:
                _keep_unflushed(batches, self._batches)
            return inserted

    async def _insert_batch(self, table: str, batch: _TableBatch) -> int:
        """Insert the batch; if ClickHouse refuses it (not unavailable: the data), find the rows it refuses by
        inserting halves, and send those to rejected_rows. Rows inserted twice on the way are harmless (the tables
        collapse duplicates). Returns the rows inserted into `table`."""
        try:
            columns = batch.columns
            insert = self.store.insert(table, columns, batch.names, column_oriented=True, settings=INSERT_SETTINGS)
            await self._timed(table, batch.rows, insert)
            return batch.rows
        except ClickHouseUnavailableError:
            raise
        except Exception as exc:
            if table == REJECTED or not any(batch.sources):
                raise
            log.warning("ClickHouse refused a batch of %d rows for %s (%s); inserting it in parts to find the "
                        "rows it refuses", batch.rows, table, _one_line(exc))  # fmt: skip
            first_error = exc
        refused: list[tuple[int, str]] = []
        good = await self._bisect(table, batch, list(range(batch.rows)), refused)
        if good == 0 and batch.rows > 1:
            raise first_error  # every row alone fails too: the table or the server is at fault, not the records
        for index, reason in refused:
            source = batch.sources[index]
            if source is None:
                raise first_error  # nowhere to say where it came from: keep the old behaviour (retry)
            self.reject(RejectStage.INSERT, table, f"ClickHouse refused the row: {reason}", source)
        return good

    async def _bisect(self, table: str, batch: _TableBatch, indexes: list[int], refused: list[tuple[int, str]]) -> int:
        try:
            await self.store.insert(
                table, batch.pick(indexes), batch.names, column_oriented=True, settings=INSERT_SETTINGS
            )
            self._written[table] += len(indexes)
            return len(indexes)
        except ClickHouseUnavailableError:
            raise
        except Exception as exc:
            if len(indexes) == 1:
                refused.append((indexes[0], _one_line(exc)))
                return 0
        middle = len(indexes) // 2
        left = await self._bisect(table, batch, indexes[:middle], refused)
        return left + await self._bisect(table, batch, indexes[middle:], refused)

    async def _insert_container(self, table: str, container: AvroContainer, inserted: dict[str, int]) -> None:
        """ClickHouse decodes the records; if it cannot (a malformed record fails the whole insert), they are decoded
        here and join the table's Python batch, which the same flush inserts, so only unreadable records are lost."""
        if not container.rows:
            return
        names = TABLE_COLUMNS[table]
        writer = await self._native.writer(table, container.schema, names)
        try:
            if writer is None:
                insert = self.store.insert_avro(table, container.to_bytes(), names, INSERT_SETTINGS)
            else:
                try:
                    values = container.values  # read on the store's thread, without the GIL (NativeBlockWriter)
                    block = await self.store.call(lambda _client: writer.block(values))
                except ValueError as exc:  # treadle_native.Refused: a record it does not vouch for
                    log.warning("treadle_native refused a batch of %d records for %s (%s); decoding them in Python "
                                "instead", container.rows, table, exc)  # fmt: skip
                    self._decode_into_batches(table, container)
                    return
                insert = self.store.insert_formatted(table, block, names, NATIVE_FORMAT, INSERT_SETTINGS)
            await self._timed(table, container.rows, insert)
        except ClickHouseUnavailableError:
            raise
        except Exception as exc:
            log.warning("ClickHouse could not insert %d Avro records into %s (%s); decoding them in Python instead",
                        container.rows, table, " ".join(str(exc).split())[:300])  # fmt: skip
            self._decode_into_batches(table, container)
            return
        inserted[table] = inserted.get(table, 0) + container.rows

    def _decode_into_batches(self, table: str, container: AvroContainer) -> None:
        [kind] = [kind for kind, target in AVRO_TABLES.items() if target == table]  # one topic kind per table
        for index, value in enumerate(container.values):
            try:
                _, record = self.codec.decode(value, expect=container.schema.name)
            except DecodeError as exc:
                self.undecodable += 1
                source = row_source(container.sources[index])
                if source is not None:
                    self.reject(RejectStage.MAP, table, f"undecodable: {exc.reason}", source)
                else:
                    log.error("undecodable %s record bound for %s, not inserted: %s", container.schema.name, table,
                              exc.reason)  # fmt: skip
                continue
            self.add(kind, record, row_source(container.sources[index]))

    async def _timed(self, table: str, rows: int, insert: Any) -> None:
        started = time.perf_counter()
        await insert
        if self.metrics is not None:
            self.metrics.batch_seconds.labels(table).observe(time.perf_counter() - started)
            self.metrics.batch_rows.labels(table).observe(rows)
        self._written[table] += rows


def _one_line(exc: BaseException, limit: int = 500) -> str:
    return " ".join(str(exc).split())[:limit] or repr(exc)


def _keep_unflushed(unflushed: Mapping[str, Any], buffers: dict[str, Any]) -> None:
    """Buffers a failed flush did not insert go back, ahead of what was added meanwhile."""
    for table, old in unflushed.items():
        newer = buffers.get(table)
        if newer is None:
            buffers[table] = old
        else:
            newer.extend_front(old)
