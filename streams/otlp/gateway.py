"""From decoded spans to acknowledged Kafka records: the OTLP receiver's one job besides HTTP.

`OtlpGateway.export` maps a request's spans, numbers them, encodes and checks them as the SDK does, hands them to the
SDK's producer (its partition batches, `OtlpEmitter`), sends unmappable spans to dead letters, then waits until the
broker acknowledged every record of the request. Only then is the request accepted: an exporter told "accepted" never
loses a span. When the broker does not acknowledge in time, or the producer already holds too many unacknowledged
events, the answer is "retry later" (`Busy`); a resent span maps to the same event ids, so the worker drops copies.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from streams.otlp.mapping import CONVENTIONS, MappedEvent, MappingConfig, map_spans
from streams.otlp.numbering import SessionNumbering
from streams.otlp.spans import Span
from streams.sdk.emitter import _Emitter
from streams.sdk.producer import create_producer
from streams.sdk.types import ProducerError, StreamError
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec, DeadLetterStage
from topics.dead_letters import dead_letter
from topics.names import DEAD_LETTER, DISPATCH
from topics.settings import Settings
from topics.tool_schemas import ToolSchemas

log = logging.getLogger(__name__)
DEAD_LETTER_SOURCE = "otlp"  # the dead letters' `topic`: they come from OTLP requests, not from a Kafka topic


class Busy(Exception):
    """The request was not accepted and should be retried later (HTTP 429 when `overloaded`, else 503)."""

    def __init__(self, reason: str, *, overloaded: bool = False) -> None:
        super().__init__(reason)
        self.overloaded = overloaded


@dataclass(frozen=True)
class ExportResult:
    accepted_spans: int
    rejected_spans: int
    events: int
    message: str  # the first rejection's reason, for the OTLP partial-success answer


class OtlpEmitter(_Emitter):
    """The SDK's emitter for mapped events: same encoding checks, size limit and partition batches. Each event gets a
    future told by the producer's delivery callback, so each request waits for its own events only."""

    def __init__(self, settings: Settings, producer: AIOKafkaProducer | None = None) -> None:
        super().__init__(
            settings,
            agent_id="otlp",
            policy_version="",
            producer=producer,
            producer_options={"client_id": "treadle-otlp"},
            codec=None,
            delivery_timeout_s=settings.otlp_ack_timeout_s,
        )
        self._waiters: dict[int, asyncio.Future[BaseException | None]] = {}

    def encode(self, schema: str, record: dict[str, Any]) -> bytes:
        """The record's bytes; ValueError (EventTooLargeError included) when the SDK would refuse it."""
        return self._encode(schema, record)

    async def send(self, schema: str, record: dict[str, Any], value: bytes) -> int:
        """Hand one encoded event to the producer (waiting for room when its batch is full); its token."""
        self._check_ready()
        token = self._tokens
        self._waiters[token] = asyncio.get_running_loop().create_future()  # before any delivery can be told
        try:
            if (waiting := self._send(schema, record, value)) is not None:
                await waiting
        except BaseException:
            self._waiters.pop(token, None)
            raise
        return token

    async def acknowledged(self, tokens: Sequence[int], timeout: float) -> str | None:
        """Wait for the broker's answer on these events; None when all were acknowledged, else why not."""
        waiters = {t: self._waiters[t] for t in tokens if t in self._waiters}
        if waiters:
            await asyncio.wait(waiters.values(), timeout=timeout)
        late = [t for t, w in waiters.items() if not w.done()]
        errors = [w.result() for w in waiters.values() if w.done() and w.result() is not None]
        for token in tokens:
            self._waiters.pop(token, None)
        for token in late:  # the producer may still deliver them: the exporter's resend is then a duplicate
            self._pending.pop(token, None)
            self._abandoned = True
        self._failures.clear()  # told to the exporter through this answer, not through a later call
        sent_order = getattr(self, "_sent_order", None)  # the SDK's send-time record, pruned as its flush() would
        while sent_order and sent_order[0][1] not in self._pending:
            sent_order.popleft()
        if late:
            return f"the broker did not acknowledge {len(late)} events within {timeout}s"
        if errors:
            return f"the broker refused {len(errors)} events: {errors[0]!r}"
        return None

    def _on_delivered(self, token: int, error: BaseException | None) -> None:
        super()._on_delivered(token, error)
        waiter = self._waiters.get(token)
        if waiter is not None and not waiter.done():
            waiter.set_result(error)


class OtlpGateway:
    """Owns the producer (started lazily, restarted after the broker was unreachable) and the session numbering."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.config = MappingConfig(CONVENTIONS[settings.otlp_conventions], settings.otlp_session_attribute)
        self.numbering = SessionNumbering()
        self.tool_schemas = ToolSchemas.load(settings.tool_schemas)
        self.dead_letter_topic = TopicCatalog(settings).for_schema(DEAD_LETTER).name
        self._codec = AvroCodec()
        self._emitter: OtlpEmitter | None = None
        self._starting = asyncio.Lock()
        self.spans_accepted = 0
        self.spans_rejected = 0

    @property
    def pending(self) -> int:
        """Events handed to the producer that the broker has not acknowledged yet."""
        return self._emitter.pending if self._emitter is not None else 0

    async def start(self) -> None:
        """Start the producer now if the broker answers; if not, the first request tries again."""
        with contextlib.suppress(Busy):
            await self._ready()

    async def close(self) -> None:
        if self._emitter is not None:
            emitter, self._emitter = self._emitter, None
            with contextlib.suppress(Exception):
                await emitter.close(timeout=1.0)

    async def _ready(self) -> OtlpEmitter:
        if self._emitter is not None:
            return self._emitter
        async with self._starting:
            if self._emitter is None:
                producer = create_producer(self.settings, client_id="treadle-otlp")
                try:
                    await asyncio.wait_for(producer.start(), self.settings.otlp_ack_timeout_s)
                    emitter = OtlpEmitter(self.settings, producer)
                    await emitter.start()
                except (TimeoutError, KafkaError, OSError, StreamError) as exc:
                    with contextlib.suppress(Exception):
                        await producer.stop()
                    raise Busy(f"the broker at {self.settings.kafka_bootstrap_servers} is unreachable: {exc}") from None
                emitter._owns_producer = True  # closing the emitter stops the producer it was given
                self._emitter = emitter
        return self._emitter

    async def export(self, spans: Sequence[Span]) -> ExportResult:
        """Map, send and wait for the broker; Busy when the request must be retried (nothing was accepted)."""
        emitter = await self._ready()
        if emitter.pending >= self.settings.otlp_max_pending:
            raise Busy(f"{emitter.pending:,} events wait for the broker (TREADLE_OTLP_MAX_PENDING)", overloaded=True)
        mapped = map_spans(spans, self.config, self.numbering.trace_sessions)
        rejected = {u.span.span_id: (u.span, u.reason) for u in mapped.unmappable}
        events = self._valid_params(mapped.events, rejected, spans)
        self.numbering.number(events)
        encoded: list[tuple[MappedEvent, bytes]] = []
        for event in events:
            try:
                encoded.append((event, emitter.encode(event.schema, event.record)))
            except ValueError as exc:
                rejected.setdefault(event.span_id, (_span(spans, event.span_id), str(exc)))
        tokens: list[int] = []
        for event, value in encoded:
            if event.span_id in rejected:
                continue  # a span is mapped whole or not at all
            try:
                tokens.append(await emitter.send(event.schema, event.record, value))
            except ProducerError as exc:  # the producer refused it outright (closed, ...): retry later
                await emitter.acknowledged(tokens, 0)
                raise Busy(f"the producer refused an event: {exc}") from None
        letters = [self._dead_letter_send(span, reason) for span, reason in rejected.values()]
        problem = await emitter.acknowledged(tokens, self.settings.otlp_ack_timeout_s)
        if problem is None and letters:
            problem = await self._letters_acknowledged(letters)
        if problem is not None:
            raise Busy(problem)
        accepted = len(spans) - len(rejected)
        self.spans_accepted += accepted
        self.spans_rejected += len(rejected)
        first = next(iter(rejected.values()), None)
        message = f"{len(rejected)} spans could not be mapped (dead letters); first: {first[1]}" if first else ""
        return ExportResult(accepted, len(rejected), len(tokens), message)

    def _valid_params(
        self, events: list[MappedEvent], rejected: dict[str, tuple[Span, str]], spans: Sequence[Span]
    ) -> list[MappedEvent]:
        """Tool arguments checked against the tool schemas (TREADLE_TOOL_SCHEMAS), before any span is numbered."""
        for event in events:
            if event.schema == DISPATCH:
                problem = self.tool_schemas.error(event.record["tool"], json.loads(event.record["params_json"]))
                if problem is not None:
                    rejected.setdefault(event.span_id, (_span(spans, event.span_id), problem))
        return [e for e in events if e.span_id not in rejected]

    def _dead_letter_send(self, span: Span, reason: str) -> asyncio.Future[Any] | str:
        log.warning("OTLP span %s of trace %s sent to dead letters: %s", span.span_id, span.trace_id, reason)
        letter = dead_letter(
            DeadLetterStage.VALIDATE,
            reason,
            topic=DEAD_LETTER_SOURCE,
            partition=0,
            offset=0,
            key=span.trace_id.encode(),
            value=span.raw,
            timestamp_ms=time.time_ns() // 1_000_000,
            schema_name="opentelemetry.proto.trace.v1.Span",
        )
        letter["dead_letter_id"] = f"otlp/{span.trace_id}/{span.span_id}"
        letter["session_id"] = span.trace_id
        return self._send_letter(letter)

    def _send_letter(self, letter: dict[str, Any]) -> asyncio.Future[Any] | str:
        emitter = self._emitter
        assert emitter is not None and emitter._producer is not None
        try:
            value = self._codec.encode(DEAD_LETTER, letter)
        except ValueError as exc:
            return f"cannot encode a dead letter: {exc}"
        if len(value) > self.settings.max_event_bytes and letter["value"]:
            cut = len(value) - self.settings.max_event_bytes + 1024
            letter = {**letter, "value": letter["value"][:-cut], "value_truncated_bytes": cut}
            value = self._codec.encode(DEAD_LETTER, letter)
        key = (letter["session_id"] or "otlp").encode()
        return asyncio.ensure_future(emitter._producer.send(self.dead_letter_topic, value, key=key))

    async def _letters_acknowledged(self, letters: list[asyncio.Future[Any] | str]) -> str | None:
        for letter in letters:
            if isinstance(letter, str):
                return letter
        try:
            async with asyncio.timeout(self.settings.otlp_ack_timeout_s):
                handed = await asyncio.gather(*letters)  # type: ignore[arg-type]
                await asyncio.gather(*handed)
        except (TimeoutError, KafkaError) as exc:
            return f"dead letters were not acknowledged by the broker: {exc!r}"
        return None

    async def dead_letter_request(self, stage: DeadLetterStage, reason: str, body: bytes, size: int) -> None:
        """A request that is not OTLP at all (or too large): one dead letter with (the start of) its body; best
        effort, the exporter is told 400 / 413 either way and would not resend."""
        log.warning("OTLP request refused (%s): %s", stage, reason)
        try:
            await self._ready()
        except Busy:
            return
        kept = body[: self.settings.max_event_bytes // 2]
        letter = dead_letter(
            stage,
            reason,
            topic=DEAD_LETTER_SOURCE,
            partition=0,
            offset=0,
            key=None,
            value=kept,
            timestamp_ms=time.time_ns() // 1_000_000,
            schema_name="opentelemetry.proto.collector.trace.v1.ExportTraceServiceRequest",
        )
        letter["dead_letter_id"] = f"otlp/request/{hashlib.sha256(body).hexdigest()[:32]}/{size}"
        letter["value_truncated_bytes"] = max(0, size - len(kept))
        sent = self._send_letter(letter)
        if not isinstance(sent, str):
            await self._letters_acknowledged([sent])


def _span(spans: Sequence[Span], span_id: str) -> Span:
    return next(s for s in spans if s.span_id == span_id)
