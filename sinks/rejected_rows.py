"""rejected_rows: records the sink could not write, with why and where they came from, so one cannot stop the sink.

The sink commits a topic's offsets only after its rows are inserted, so a record whose row mapping raised, or whose
row ClickHouse refused, was met again after every restart: the sink stopped for good on it. Such a record becomes a
rejected_rows row instead (migration 0015), its source topic/partition/offset pointing at the whole record in Kafka.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, NamedTuple

MAX_VALUE_BYTES = 65_536  # enough to see what the record was; the whole one stays in Kafka at topic/partition/offset
MAX_REASON_CHARS = 2_000


class RejectStage(StrEnum):
    MAP = "MAP"  # the record could not become rows (sinks.rows raised)
    INSERT = "INSERT"  # ClickHouse refused the record's row when inserted alone


class RowSource(NamedTuple):
    """Where a buffered row came from (a NamedTuple: the sink makes one per record, and a frozen dataclass's
    __init__ cost several times a tuple's)."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    value: bytes | None

    @classmethod
    def of(cls, message: Any) -> RowSource:
        """From an aiokafka ConsumerRecord (timestamp in milliseconds)."""
        return cls(message.topic, message.partition, message.offset, message.timestamp, message.value)


def row_source(source: Any) -> RowSource | None:
    """A RowSource, or None, from what a buffered row keeps: a RowSource, None, or the aiokafka ConsumerRecord itself
    (ClickHouseSink.add_encoded_records keeps the records and makes a RowSource only for a row it rejects)."""
    if source is None or isinstance(source, RowSource):
        return source
    return RowSource.of(source)


def rejected_row(stage: RejectStage, table: str, reason: str, source: RowSource) -> dict[str, Any]:
    """The rejected_rows row of `source`; the same on replay (the id and time come from the source only)."""
    value = source.value
    if value is not None and len(value) > MAX_VALUE_BYTES:
        value = value[:MAX_VALUE_BYTES]
    suffix = f"/{table}" if stage is RejectStage.INSERT else ""
    return {
        "rejected_id": f"{source.topic}/{source.partition}/{source.offset}{suffix}",
        "stage": str(stage),
        "target_table": table,
        "reason": reason if len(reason) <= MAX_REASON_CHARS else f"{reason[:MAX_REASON_CHARS]}… (cut)",
        "topic": source.topic,
        "partition": source.partition,
        "offset": source.offset,
        "value": value,
        "rejected_at": source.timestamp_ms * 1000,
    }
