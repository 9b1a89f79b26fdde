"""Decode and validate one input message, or say why it is a dead letter.

Shared by the step assembler and the ClickHouse sink so both agree on what a valid event is.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from topics.catalog import TopicCatalog
from topics.codec import AvroCodec, DeadLetterStage, DecodeError
from topics.dead_letters import dead_letter
from topics.validation import InputValidator


@dataclass(slots=True)  # not frozen: one per input record, and a frozen dataclass takes ~4x longer to build
class SourceMessage:
    """Where a message came from; all a dead letter needs besides the reason (never changed once built)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int

    @classmethod
    def of(cls, message: Any, timestamp_ms: int) -> SourceMessage:
        """From an aiokafka ConsumerRecord or a Faust Message (their timestamps differ in unit)."""
        return cls(message.topic, message.partition, message.offset, message.key, message.value, timestamp_ms)

    def dead_letter(
        self,
        stage: DeadLetterStage,
        reason: str,
        schema_name: str | None = None,
        record: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return dead_letter(
            stage,
            reason,
            topic=self.topic,
            partition=self.partition,
            offset=self.offset,
            key=self.key,
            value=self.value,
            timestamp_ms=self.timestamp_ms,
            schema_name=schema_name,
            record=record,
        )


@dataclass(slots=True)  # one per input record, like SourceMessage
class Accepted:
    schema_name: str
    record: dict[str, Any]


@dataclass(frozen=True)
class Rejected:
    dead_letter: dict[str, Any]
    unknown_writer: bool = False  # its writer schema is not known here (yet): see Intake.read_after_reload


class Intake:
    def __init__(
        self,
        codec: AvroCodec,
        catalog: TopicCatalog,
        validator: InputValidator,
        reload_schemas: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self.codec = codec
        self.validator = validator
        # SchemaRegistry.load_if_due of the registry the codec looks writers up in; None: no registry
        self.reload_schemas = reload_schemas
        self._expected = {spec.name: spec.value_schema for spec in catalog.inputs}

    async def read_after_reload(self, message: SourceMessage) -> Accepted | Rejected:
        """`read`, after reloading the registry (unless it was loaded under a second ago): for a message rejected
        for an unknown writer schema, which its producer may have registered since the last load. Without the
        reload such an event would be a dead letter for good."""
        if self.reload_schemas is not None:
            await self.reload_schemas()
        return self.read(message)

    def read(self, message: SourceMessage) -> Accepted | Rejected:
        expected = self._expected.get(message.topic)
        schema_name: str | None = None
        record: dict[str, Any] | None = None
        if message.value is None:
            stage, reason = DeadLetterStage.DECODE, "message has no value (tombstone) on an event topic"
        else:
            try:
                schema_name, record = self.codec.decode(message.value, expect=expected)
            except DecodeError as exc:
                if exc.unknown_writer:
                    return Rejected(message.dead_letter(exc.stage, exc.reason), unknown_writer=True)
                stage, reason = exc.stage, exc.reason
            else:
                problem = self.validator.problem(schema_name, record, message.key)
                if problem is None:
                    return Accepted(schema_name, record)
                stage, reason = DeadLetterStage.VALIDATE, problem
        return Rejected(message.dead_letter(stage, reason, schema_name, record))
