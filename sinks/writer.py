"""The batched, idempotent ClickHouse writer the worker feeds from the output and input topics.

Records are mapped to rows (sinks.rows) and buffered column by column per table, so a flush is one
column-oriented insert per table with no per-row work left. Idempotency comes from the tables, not from the
writer: rows are deterministic and every table is a ReplacingMergeTree keyed on the record's identity, so a
replay after a crash (same records again, in other batches) leaves the *_latest views unchanged. Commit the
consumer offsets of a batch only after `flush()` returned: that makes the pipeline at-least-once into tables
that absorb duplicates.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from sinks.clickhouse import ClickHouseStore
from sinks.rows import TABLE_COLUMNS, rows_for
from streams.metrics import SinkMetrics


class _TableBatch:
    """Buffered rows of one table, held as one list per column."""

    __slots__ = ("columns", "names", "rows")

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.columns: list[list[Any]] = [[] for _ in names]
        self.rows = 0

    def append(self, row: Mapping[str, Any]) -> None:
        for column, name in zip(self.columns, self.names, strict=True):
            column.append(row[name])
        self.rows += 1

    def extend_front(self, other: _TableBatch) -> None:
        """Put `other`'s rows (an earlier batch whose insert failed) before this batch's rows."""
        self.columns = [old + new for old, new in zip(other.columns, self.columns, strict=True)]
        self.rows += other.rows


class ClickHouseSink:
    """Buffers rows per table and inserts each table's batch in one insert.

    `add` is synchronous and cheap; it returns True when a table reached `batch_size`, which is the caller's
    cue to `await flush()`. `put` does both. Time-based flushing (settings.sink_flush_seconds) is the caller's
    loop: call `flush()` on a timer; it is a no-op when nothing is buffered.
    """

    def __init__(self, store: ClickHouseStore, batch_size: int = 5000, metrics: SinkMetrics | None = None) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.store = store
        self.batch_size = batch_size
        self.metrics = metrics
        self._batches: dict[str, _TableBatch] = {}
        self._written: dict[str, int] = dict.fromkeys(TABLE_COLUMNS, 0)
        self._flush_lock = asyncio.Lock()

    def add(self, kind: str, record: Mapping[str, Any]) -> bool:
        """Buffer the rows of one decoded record of topic kind `kind`; True when a batch is full."""
        full = False
        for table, row in rows_for(kind, record):
            batch = self._batches.get(table)
            if batch is None:
                batch = self._batches[table] = _TableBatch(TABLE_COLUMNS[table])
            batch.append(row)
            full |= batch.rows >= self.batch_size
        return full

    async def put(self, kind: str, record: Mapping[str, Any]) -> None:
        """`add`, then flush if a batch is full."""
        if self.add(kind, record):
            await self.flush()

    @property
    def pending(self) -> int:
        """Rows buffered and not yet inserted, all tables together."""
        return sum(batch.rows for batch in self._batches.values())

    @property
    def pending_rows(self) -> dict[str, int]:
        """Rows buffered and not yet inserted, per table."""
        return {table: batch.rows for table, batch in self._batches.items() if batch.rows}

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
            batches, self._batches = self._batches, {}
            inserted: dict[str, int] = {}
            try:
                for table in list(batches):
                    batch = batches[table]
                    if batch.rows:
                        started = time.perf_counter()
                        await self.store.insert(table, batch.columns, batch.names, column_oriented=True)
                        if self.metrics is not None:
                            self.metrics.batch_seconds.labels(table).observe(time.perf_counter() - started)
                            self.metrics.batch_rows.labels(table).observe(batch.rows)
                        self._written[table] += batch.rows
                        inserted[table] = batch.rows
                    del batches[table]
            finally:
                for table, unflushed in batches.items():
                    newer = self._batches.get(table)
                    if newer is None:
                        self._batches[table] = unflushed
                    else:
                        newer.extend_front(unflushed)
            return inserted
