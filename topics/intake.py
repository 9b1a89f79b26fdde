"""Decode and validate one input message, or say why it is a dead letter.

Shared by the step assembler and the ClickHouse sink so both agree on what a valid event is.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from topics.catalog import TopicCatalog, topic_expectation
from topics.codec import AvroCodec, DeadLetterStage, DecodeError
from topics.dead_letters import dead_letter
from topics.settings import Settings
from topics.validation import InputValidator

log = logging.getLogger(__name__)


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
        max_event_bytes: int = Settings.model_fields["max_event_bytes"].default,
    ) -> None:
        self.codec = codec
        self.max_event_bytes = max_event_bytes  # TREADLE_MAX_EVENT_BYTES: larger inputs are dead letters
        self.validator = validator
        # SchemaRegistry.load_if_due of the registry the codec looks writers up in; None: no registry
        self.reload_schemas = reload_schemas
        self._expected = {spec.name: topic_expectation(spec) for spec in catalog.inputs}

    async def read_after_reload(self, message: SourceMessage) -> Accepted | Rejected:
        """`read`, after reloading the registry (unless it was loaded under a second ago): for a message rejected
        for an unknown writer schema, which its producer may have registered since the last load. Without the
        reload such an event would be a dead letter for good."""
        if self.reload_schemas is not None:
            await self.reload_schemas()
        return self.read(message)

    def read(self, message: SourceMessage) -> Accepted | Rejected:
        """The decoded, valid record, or its dead letter. Never raises: whatever goes wrong with one record (a bug,
        a RecursionError on hostile input) makes that record a dead letter, so it cannot fail its batch."""
        try:
            return self._read(message)
        except Exception as exc:
            log.error("reading %s[%d]@%d raised %r; it becomes a dead letter", message.topic, message.partition,
                      message.offset, exc, exc_info=exc)  # fmt: skip
            return Rejected(message.dead_letter(DeadLetterStage.DECODE, f"reading the record failed: {exc!r}"))

    def _read(self, message: SourceMessage) -> Accepted | Rejected:
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
                try:
                    problem = self._size_problem(message) or self.validator.problem(
                        schema_name, record, message.key, len(message.value)
                    )
                except Exception as exc:  # a validator bug or hostile content: this record only
                    log.error("validating %s[%d]@%d raised %r", message.topic, message.partition, message.offset,
                              exc, exc_info=exc)  # fmt: skip
                    problem = f"validating the record failed: {exc!r}"
                if problem is None:
                    return Accepted(schema_name, record)
                stage, reason = DeadLetterStage.VALIDATE, problem
        return Rejected(message.dead_letter(stage, reason, schema_name, record))

    def _size_problem(self, message: SourceMessage) -> str | None:
        size = len(message.value or b"") + len(message.key or b"")
        if size <= self.max_event_bytes:
            return None
        return (
            f"the event is {size:,} bytes (key and value), above the {self.max_event_bytes:,}-byte limit "
            "(TREADLE_MAX_EVENT_BYTES); the SDK refuses such events before sending them"
        )
