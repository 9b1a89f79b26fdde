"""What every SDK emitter shares: the producer, the codec, background-send tracking and `seq`.

An agent loop must never wait for the data plane, so every call returns as soon as its event is handed to the Kafka
producer (appended to its partition's record batch, which aiokafka sends with `send_batch`); the broker's
acknowledgement is tracked in the background. Nothing is dropped silently either: a send that fails later is recorded,
and the next call, `flush()` or `close()` raises `ProducerError` naming the failed events (their records are kept for
a retry). aiokafka's idempotent producer retries forever while the broker is down, so `delivery_timeout_s` (default
120 s, like Java's delivery.timeout.ms) bounds how long an event may stay unacknowledged before it is reported failed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Mapping
from types import TracebackType
from typing import Any, Self

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, KafkaTimeoutError, UnknownTopicOrPartitionError

from streams.sdk.batching import Batch, PartitionBatcher, key_hash
from streams.sdk.producer import create_producer
from streams.sdk.spool import Spool, SpoolFullError
from streams.sdk.types import (
    _ANNOTATORS,
    _METADATA_TIMEOUT_S,
    Annotator,
    EventTooLargeError,
    FailedEvent,
    ProducerError,
    StepRef,
    StreamError,
    _attrs,
    _member,
)
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.event_checks import MAX_NAME_CHARS, event_time_problem, overlong_name_problem, reward_problem
from topics.ids import uuid7
from topics.names import INPUT_SCHEMAS, PLAN_EVENTS_KEY, PLAN_INPUT_SCHEMAS, REWARD
from topics.settings import Settings

_CHECKPOINT_S = 0.1  # the resolution of delivery timeouts (see _Emitter._expire_overdue)
_KEPT_BATCHES = 64  # batches an emitter remembers before it drops the finished ones
_SPOOL_RETRY_S = 1.0  # pause before a spooled segment whose send failed is sent again
_PLAN_KEY = PLAN_EVENTS_KEY.encode()  # every plan event's message key: the scheduler reads them as one ordered log
# The fields of the records the hot paths build as tuples (AvroCodec.writer), in schema order; a test holds them to
# the schemas.
ENVELOPE_FIELDS = ("event_id", "session_id", "agent_id", "episode_id", "logical_event_id", "seq", "event_time",
                   "policy_version", "trace_id", "attributes")  # fmt: skip
DISPATCH_FIELDS = ("envelope", "step", "tool", "params_json", "deadline")
TOOL_RESULT_FIELDS = ("envelope", "tool", "status", "output", "error", "latency_ms", "cost_usd", "tokens_in",
                      "tokens_out", "retries")  # fmt: skip
REWARD_FIELDS = ("envelope", "source", "name", "value", "confidence", "annotator", "evidence")

log = logging.getLogger(__name__)


class _Emitter:
    """What every emitter shares: the producer, the codec, background-send tracking and `seq`."""

    _start_schemas: tuple[str, ...] = INPUT_SCHEMAS  # whose topics start() looks up (and requires)

    def __init__(
        self,
        settings: Settings | None,
        *,
        agent_id: str,
        policy_version: str,
        producer: AIOKafkaProducer | None,
        producer_options: Mapping[str, Any] | None,
        codec: AvroCodec | None,
        delivery_timeout_s: float,
    ) -> None:
        self.settings = settings or Settings.from_env()
        self._max_event_bytes = self.settings.max_event_bytes
        self.delivery_timeout_s = delivery_timeout_s
        self.agent_id = agent_id
        self.policy_version = policy_version
        catalog = TopicCatalog(self.settings)
        self._topics = {schema: catalog.for_schema(schema).name for schema in (*INPUT_SCHEMAS, *PLAN_INPUT_SCHEMAS)}
        self._attributes: dict[str, str] = {}  # attributes every event of this emitter carries (AgentStream's)
        self._codec = codec or AvroCodec()
        self._writers: dict[str, Callable[[dict[str, Any]], bytes]] = {}  # schema -> the codec's writer (_encode)
        self._producer = producer
        self._owns_producer = producer is None
        self._producer_options = dict(producer_options or {})
        self._seq = 0
        self._batcher: PartitionBatcher | None = None
        self._tokens = 0  # numbers the events handed over, for the batches' delivery callbacks
        # token -> encoded event, until acknowledged. Bytes, not the record: they hold nothing the garbage collector
        # must visit, and the record is decoded from them only when the event fails (FailedEvent.record).
        self._pending: dict[int, bytes] = {}
        self._batches: dict[Batch, None] = {}  # the batches holding pending events (what flush waits for)
        self._forget_above = _KEPT_BATCHES  # forget finished batches when more than this many are kept
        # (monotonic time, first token sent at or after it), one per _CHECKPOINT_S of sending: delivery timeouts
        # are checked against these instead of a timestamp per event
        self._checkpoints: deque[tuple[float, int]] = deque()
        self._next_checkpoint = 0.0
        self._delivered_callback = self._on_delivered  # bound once: it is stored with every event
        self._failures: list[FailedEvent] = []
        self._abandoned = False  # some events were reported undelivered while the producer still holds them
        self._partition_counts: dict[str, int] = {}
        # with TREADLE_SPOOL_DIR: events go to the spool while `_spooling` (brokers unreachable, or a predecessor's
        # spool not yet resent), and `_drain` sends them back in order
        self._spool: Spool | None = None
        self._spooling = False
        self._drain: asyncio.Task[None] | None = None
        # how old the oldest unacknowledged event may get before _surface_failures acts (spools it, or reports it)
        spooled = self.settings.spool_dir is not None
        self._stale_after_s = (self.settings.spool_after_s if spooled else delivery_timeout_s) + _CHECKPOINT_S
        self._hashed: tuple[str, bytes, int] = ("", b"", 0)  # (session_id, key, murmur2) of the last key
        self._started = False
        self._closed = False

    # -- lifecycle of the emitter ------------------------------------------------------------

    async def start(self) -> Self:
        """Start the producer (unless shared) and learn the topics' partitions before the hot path."""
        if self._closed:
            raise StreamError("the stream is closed; create a new one")
        if self._started:
            return self
        if self._producer is None:
            self._producer = create_producer(self.settings, **self._producer_options)
        try:
            if self._owns_producer:
                await self._producer.start()
            for topic in dict.fromkeys(self._topics[schema] for schema in self._start_schemas):
                self._partition_counts[topic] = await self._partitions_of(topic)
            self._batcher = PartitionBatcher.for_producer(self._producer)
            if self.settings.spool_dir is not None:
                name = re.sub(r"[^A-Za-z0-9_.-]", "_", self.agent_id) or "agent"
                self._spool = Spool.claim(self.settings.spool_dir, name, self.settings.spool_max_bytes)
        except BaseException:
            if self._owns_producer:
                await self._producer.stop()
                self._producer = None
            raise
        self._started = True
        if self._spool:  # a predecessor's events, not yet sent: they go first, and what this stream emits after them
            log.warning(
                "resending %d events left in the producer spool %s by an earlier process",
                self._spool.depth, self._spool.directory,
            )  # fmt: skip
            self._start_spooling()
        return self

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until the broker acknowledged every event sent so far; raise ProducerError if any failed.

        Events still unacknowledged after `timeout` (default: delivery_timeout_s) are reported as
        failed too: the idempotent producer retries forever while the broker is down, so without a
        bound a dead broker would hang the agent. Resending a reported event is safe (same event_id).
        """
        waiting = list(self._pending)  # what was sent so far; later sends are the next flush's
        if waiting:
            batches = {batch.done for batch in self._batches if not batch.done.done()}  # resolved once told
            if batches:
                await asyncio.wait(batches, timeout=self.delivery_timeout_s if timeout is None else timeout)
            overdue = [token for token in waiting if token in self._pending]
            if overdue:
                self._expire(overdue, "not acknowledged by the broker when flush timed out")
        self._forget_done_batches()
        if not self._pending:
            self._checkpoints.clear()
        if self._drain is not None and not self._drain.done():
            await asyncio.wait({self._drain}, timeout=self.delivery_timeout_s if timeout is None else timeout)
        self._raise_failures()

    def _forget_done_batches(self) -> None:
        for batch in [batch for batch in self._batches if batch.done.done()]:
            del self._batches[batch]

    async def close(self, timeout: float | None = None) -> None:
        """Flush, then stop the producer if this stream created it (a shared one is left running)."""
        if self._closed:
            return
        try:
            if self._started:
                await self.flush(timeout)
        finally:
            self._closed = True
            await self._close_spool()
            if self._owns_producer and self._producer is not None:
                await self._stop_owned_producer(self._producer)

    async def _close_spool(self) -> None:
        if self._drain is not None:
            self._drain.cancel()
            await asyncio.gather(self._drain, return_exceptions=True)
            self._drain = None
        if self._spool is not None:
            if self._spool:
                log.warning(
                    "%d events stay in the producer spool %s: the brokers did not take them before the stream "
                    "closed; the next stream of agent %r started with TREADLE_SPOOL_DIR=%s sends them",
                    self._spool.depth, self._spool.directory, self.agent_id, self.settings.spool_dir,
                )  # fmt: skip
            self._spool.close()
            self._spool = None

    async def _stop_owned_producer(self, producer: AIOKafkaProducer) -> None:
        """Stop our producer without hanging on events it can no longer deliver.

        aiokafka's stop() waits for every batch, and with idempotence a batch to a dead broker is
        retried forever. Those events were already reported to the caller, so the sender is stopped
        first (no more retries) and their batches failed (aiokafka's own fail_all, the step it takes
        on a fatal sender error); these are aiokafka internals, hence the getattr guards. Batches
        not yet handed to the producer are failed first, so none is added while it stops.
        """
        if self._batcher is not None:
            self._batcher.abort(KafkaTimeoutError("the stream closed before these events reached the producer"))
        if self._abandoned:
            sender = getattr(producer, "_sender", None)
            accumulator = getattr(producer, "_message_accumulator", None)
            if sender is not None and accumulator is not None:
                await sender.close()
                accumulator.fail_all(KafkaTimeoutError("the stream closed with events the broker never acknowledged"))
        await producer.stop()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            await self.close()
            return
        try:  # don't let a delivery failure mask the error that ended the block
            await self.close()
        except Exception as close_error:
            exc.add_note(f"also, while closing the treadle stream: {close_error!r}")

    @property
    def pending(self) -> int:
        """Events handed to the producer and not yet acknowledged (spooled ones not included)."""
        return len(self._pending)

    @property
    def spool_depth(self) -> int:
        """Events in this stream's producer spool (TREADLE_SPOOL_DIR), waiting for the brokers; 0 without one."""
        return self._spool.depth if self._spool is not None else 0

    @property
    def spool_bytes(self) -> int:
        """Bytes in this stream's producer spool; 0 without one."""
        return self._spool.size_bytes if self._spool is not None else 0

    @property
    def spooling(self) -> bool:
        """Whether new events go to the spool (the brokers were unreachable and the spool is not yet resent)."""
        return self._spooling

    # -- sending --------------------------------------------------------------------------------

    def _check_ready(self) -> None:
        if self._closed:
            raise StreamError("the stream is closed")
        if not self._started:
            raise StreamError("the stream is not started: `await stream.start()` or `async with`")

    def _ready_to_send(self) -> None:
        """`_check_ready` and `_surface_failures` in one call, the common case (started, nothing to report) first:
        every event pays for it."""
        if self._closed or not self._started:
            self._check_ready()
        if self._failures or ((c := self._checkpoints) and c[0][0] < time.monotonic() - self._stale_after_s):
            self._surface_failures()

    def _surface_failures(self) -> None:
        """Raise what went wrong in the background since the last call, before this call sends anything."""
        checkpoints = self._checkpoints
        if checkpoints and checkpoints[0][0] < time.monotonic() - self._stale_after_s:
            if self._spool is None:
                self._expire_overdue()
            elif self._overdue(self.settings.spool_after_s):
                self._start_spooling()
        if self._failures:
            self._raise_failures()

    def _expire_overdue(self) -> None:
        """Report the events still unacknowledged delivery_timeout_s after they were sent (up to _CHECKPOINT_S later).

        A checkpoint's events were all sent within _CHECKPOINT_S of its time: the next checkpoint is taken at the
        first send after that. So once a checkpoint is that much older than the timeout, all of its events are due.
        """
        why = f"not acknowledged within {self.delivery_timeout_s}s"
        self._expire(self._overdue(self.delivery_timeout_s), why)
        self._forget_done_batches()

    def _overdue(self, age: float) -> list[int]:
        """The pending events sent more than `age` seconds ago (up to _CHECKPOINT_S more); their checkpoints go."""
        cutoff = time.monotonic() - age - _CHECKPOINT_S
        checkpoints = self._checkpoints
        while checkpoints and checkpoints[0][0] < cutoff:
            checkpoints.popleft()
        bound = checkpoints[0][1] if checkpoints else self._tokens  # the first token not yet due
        return [token for token in self._pending if token < bound]

    # -- the producer spool (TREADLE_SPOOL_DIR) -------------------------------------------------

    def _start_spooling(self) -> None:
        """The brokers look unreachable: every unacknowledged event, then every new one, goes to the spool until
        `_drain_spool` has sent it all.

        The producer still holds the moved events. Were it to deliver a later one after failing an earlier one
        (aiokafka expires batches that wait longer than request_timeout_ms), the resend would land behind it: so
        a producer of the stream's own is replaced (its batches failed) before the spool is sent. A shared one
        (`producer=`) cannot be: its moved events may then also arrive ahead of the resend, as duplicates (the
        pipeline ignores a duplicate event_id), and in the expiry case out of seq order.
        """
        assert self._spool is not None
        moved = bool(self._pending)
        if moved:
            log.warning(
                "no broker acknowledged events for %.0f s: spooling them and what follows to %s; they are sent, "
                "in order, when the brokers are back",
                self.settings.spool_after_s, self._spool.directory,
            )  # fmt: skip
        for token in sorted(self._pending):  # token order is send order
            value = self._pending[token]
            schema, record = self._codec.decode(value)
            key = _PLAN_KEY if schema in PLAN_INPUT_SCHEMAS else record["envelope"]["session_id"].encode()
            self._spool.append(self._topics[schema], key, value, force=True)
        self._abandoned = bool(self._pending) or self._abandoned  # close must not wait on their batches
        self._pending.clear()
        self._checkpoints.clear()
        self._batches.clear()
        self._spooling = True
        if self._drain is None or self._drain.done():
            self._drain = asyncio.get_running_loop().create_task(self._drain_spool(moved and self._owns_producer))

    def _to_spool(self, topic: str, key: bytes, value: bytes) -> Coroutine[Any, Any, None] | None:
        assert self._spool is not None
        try:
            self._spool.append(topic, key, value)
        except SpoolFullError:
            if self.settings.spool_when_full == "raise":
                raise
            return self._to_spool_when_room(topic, key, value)
        return None

    async def _to_spool_when_room(self, topic: str, key: bytes, value: bytes) -> None:
        """TREADLE_SPOOL_WHEN_FULL=block: wait until the resend made room (or the brokers took over again)."""
        assert self._spool is not None
        while True:
            await asyncio.sleep(_SPOOL_RETRY_S / 10)
            try:
                self._spool.append(topic, key, value)
            except SpoolFullError:
                continue
            if not self._spooling:  # the resend finished meanwhile: this event must still follow what it sent
                self._start_spooling()
            return

    async def _drain_spool(self, replace_producer: bool) -> None:
        """Send the spool, oldest segment first, each once the one before it was acknowledged; then stop spooling.

        While the brokers are down the first segment's batches wait in the producer, which retries them until
        they are back. A segment is dropped only when all of it was acknowledged, so a process that dies first
        resends it (its events keep their event_ids; the pipeline ignores the duplicates).
        """
        if replace_producer:
            await self._replace_producer()
        assert self._spool is not None and self._batcher is not None
        spool, batcher = self._spool, self._batcher
        errors: list[BaseException] = []

        def told(_token: int, error: BaseException | None) -> None:
            if error is not None:
                errors.append(error)

        while (oldest := spool.oldest()) is not None:
            number, events = oldest
            batches: dict[Batch, None] = {}
            for topic, key, value in events:
                partition = key_hash(key) % await self._partition_count(topic)
                batches[await batcher.append_when_room(topic, partition, key, value, told, 0)] = None
            await asyncio.wait([batch.done for batch in batches])
            if errors:
                log.warning(
                    "resending %d spooled events failed (%r); trying again in %.0f s",
                    len(events), errors[0], _SPOOL_RETRY_S,
                )  # fmt: skip
                errors.clear()
                await asyncio.sleep(_SPOOL_RETRY_S)
                continue
            spool.drop(number)
        self._spooling = False  # no await since the spool was seen empty: the next event goes straight out, after
        log.info("the producer spool %s is resent; sending directly again", spool.directory)

    async def _replace_producer(self) -> None:
        """Fail every batch of this stream's producer (their events are in the spool) and start a new one once a
        broker answers: nothing the old one held can land after the resend."""
        assert self._producer is not None
        old, self._producer = self._producer, None
        self._abandoned = True
        await self._stop_owned_producer(old)
        self._abandoned = False
        while True:
            candidate = create_producer(self.settings, **self._producer_options)
            try:
                await candidate.start()
            except KafkaError as exc:
                await candidate.stop()
                log.debug("brokers still unreachable (%r); the spool waits", exc)
                await asyncio.sleep(_SPOOL_RETRY_S)
                continue
            except BaseException:
                await candidate.stop()
                raise
            break
        self._producer = candidate
        self._batcher = PartitionBatcher.for_producer(candidate)

    async def _partition_count(self, topic: str) -> int:
        count = self._partition_counts.get(topic)
        if count is None:  # a topic of an earlier process's spool
            assert self._producer is not None
            count = self._partition_counts[topic] = len(await self._producer.partitions_for(topic))
        return count

    def _expire(self, tokens: Iterable[int], why: str) -> None:
        """Report pending events as failed; the producer may still deliver them (event_id deduplicates)."""
        for token in tokens:
            value = self._pending.pop(token)
            self._abandoned = True
            self._failures.append(self._failed_event(value, KafkaTimeoutError(why)))

    def _failed_event(self, value: bytes, error: BaseException) -> FailedEvent:
        schema, record = self._codec.decode(value)
        return FailedEvent(schema, self._topics[schema], record, error)

    def _raise_failures(self) -> None:
        if self._failures:
            failed, self._failures = self._failures, []
            raise ProducerError(failed[0].error, failed) from failed[0].error

    def _envelope(
        self,
        event_id: str,
        session_id: str,
        episode_id: str,
        logical_event_id: str,
        seq: int,
        trace_id: str,
        attributes: Mapping[str, Any] | None,
        event_time: int | None,
    ) -> dict[str, Any]:
        """An event's envelope as a dict (`_envelope_values`, named)."""
        values = self._envelope_values(
            event_id, session_id, episode_id, logical_event_id, seq, trace_id, attributes, event_time
        )
        return dict(zip(ENVELOPE_FIELDS, values, strict=True))

    def _envelope_values(
        self,
        event_id: str,
        session_id: str,
        episode_id: str,
        logical_event_id: str,
        seq: int,
        trace_id: str,
        attributes: Mapping[str, Any] | None,
        event_time: int | None,
    ) -> tuple[Any, ...]:
        """An event's envelope as a tuple of its fields in schema order (ENVELOPE_FIELDS), as the hot paths encode it
        (AvroCodec.writer); positional, a keyword call costs more per event."""
        if event_time is None:
            at = time.time_ns() // 1000  # now_micros(), inline
        elif (problem := event_time_problem(event_time)) is not None:
            raise ValueError(problem)  # the worker would dead-letter it
        else:
            at = int(event_time)
        attributes = self._event_attributes(attributes) if attributes or self._attributes else {}
        return (event_id, session_id, self.agent_id, episode_id, logical_event_id, seq, at, self.policy_version,
                trace_id, attributes)  # fmt: skip

    def _event_attributes(self, attributes: Mapping[str, Any] | None) -> dict[str, str]:
        """An event's attributes: this emitter's, and the call's (which win on a clash)."""
        if not self._attributes:
            return _attrs(attributes)
        return {**self._attributes, **_attrs(attributes)} if attributes else dict(self._attributes)

    def _encode(self, schema: str, record: dict[str, Any] | tuple[Any, ...]) -> bytes:
        """Encode before anything is counted, so a bad value costs neither a seq nor a step. The hot paths (dispatch,
        tool result, reward) give the record as a tuple of its field values in schema order (AvroCodec.writer)."""
        try:
            try:
                value = self._writers[schema](record)  # the codec's compiled writer, without AvroCodec.encode's call
            except Exception:  # no compiled writer yet, or values it does not take: the codec's full path decides
                value = self._codec.encode(schema, self._codec.record_of(schema, record))
                self._writers[schema] = self._codec.writer(schema)
        except (ValueError, TypeError, KeyError, OverflowError) as exc:
            raise ValueError(f"cannot encode {schema.rsplit('.', 1)[-1]}: {exc}") from exc
        if len(value) > MAX_NAME_CHARS and (problem := overlong_name_problem(self._codec.record_of(schema, record))):
            raise ValueError(problem)  # the worker would dead-letter it
        if len(value) > self._max_event_bytes:
            raise EventTooLargeError(
                f"{schema.rsplit('.', 1)[-1]} is {len(value):,} bytes encoded, above the "
                f"{self._max_event_bytes:,}-byte limit (TREADLE_MAX_EVENT_BYTES); nothing was sent: store large "
                "payloads elsewhere and send a reference"
            )
        return value

    def _send(
        self,
        schema: str,
        record: dict[str, Any] | tuple[Any, ...],
        value: bytes,
        key: bytes | None = None,
        session_id: str | None = None,
    ) -> Coroutine[Any, Any, None] | None:
        """Hand one encoded event to the producer (its partition's batch) and track its acknowledgement.

        Returns None once it is handed over, which is almost always; when the partition's batch is
        full, a coroutine the caller awaits (it waits for room, then hands the event over). No
        coroutine per event on the hot path. The key is the event's session (`session_id`, else the record's
        envelope's) unless given (plan events).
        """
        topic = self._topics[schema]
        if key is None:
            if session_id is None:
                whole = record if type(record) is dict else self._codec.record_of(schema, record)
                session_id = whole["envelope"]["session_id"]
            hashed = self._hashed
            if hashed[0] != session_id or not session_id:
                key = session_id.encode()
                hashed = self._hashed = (session_id, key, key_hash(key))
            key = hashed[1]
            hashed = hashed[2]
        else:
            hashed = key_hash(key)
        if self._spooling:
            return self._to_spool(topic, key, value)
        # Kafka's default partitioning (Java, Faust, aiokafka agree), with the key's hash computed once per session.
        partition = hashed % self._partition_counts[topic]
        token = self._tokens
        self._tokens = token + 1
        try:
            batch = self._batcher.append(topic, partition, key, value, self._delivered_callback, token)  # type: ignore[union-attr]
        except Exception as exc:
            raise ProducerError(exc, [FailedEvent(schema, topic, self._codec.record_of(schema, record), exc)]) from exc
        if batch is None:
            return self._send_when_room(schema, record, topic, partition, key, value, token)
        # _track, inline: once per event
        self._pending[token] = value
        self._batches[batch] = None
        if (now := time.monotonic()) >= self._next_checkpoint or not self._checkpoints:
            self._checkpoint(now, token)
        return None

    def _track(self, token: int, value: bytes, batch: Batch) -> None:
        """Remember a handed-over event until its batch's outcome is told (_on_delivered)."""
        self._pending[token] = value
        self._batches[batch] = None
        if (now := time.monotonic()) >= self._next_checkpoint or not self._checkpoints:
            self._checkpoint(now, token)

    def _checkpoint(self, now: float, token: int) -> None:
        self._checkpoints.append((now, token))
        self._next_checkpoint = now + _CHECKPOINT_S
        if len(self._batches) > self._forget_above:  # so a stream that never flushes does not keep every batch
            self._forget_done_batches()
            # the next look once twice as many are kept: each look costs a pass over them, so not at every checkpoint
            self._forget_above = max(_KEPT_BATCHES, 2 * len(self._batches))

    async def _send_when_room(
        self,
        schema: str,
        record: dict[str, Any] | tuple[Any, ...],
        topic: str,
        partition: int,
        key: bytes,
        value: bytes,
        token: int,
    ) -> None:
        """The partition's batch is full and the producer has not taken it yet: wait, as aiokafka's send() does."""
        assert self._batcher is not None
        try:
            batch = None
            while batch is None:
                if self._spool is None:
                    await self._batcher.room(topic, partition)
                else:  # the brokers may be gone: wait for room only as long as an event may stay unacknowledged
                    try:
                        await asyncio.wait_for(self._batcher.room(topic, partition), self.settings.spool_after_s)
                    except TimeoutError:
                        self._start_spooling()
                    if self._spooling:
                        if (waiting := self._to_spool(topic, key, value)) is not None:
                            await waiting
                        return
                batch = self._batcher.append(topic, partition, key, value, self._delivered_callback, token)
        except Exception as exc:
            raise ProducerError(exc, [FailedEvent(schema, topic, self._codec.record_of(schema, record), exc)]) from exc
        self._track(token, value, batch)

    def _on_delivered(self, token: int, error: BaseException | None) -> None:
        value = self._pending.pop(token, None)  # None: already reported as expired
        if value is not None and error is not None:
            self._failures.append(self._failed_event(value, error))

    async def _partitions_of(self, topic: str) -> int:
        assert self._producer is not None
        try:
            partitions = await asyncio.wait_for(self._producer.partitions_for(topic), _METADATA_TIMEOUT_S)
        except (TimeoutError, KafkaTimeoutError, UnknownTopicOrPartitionError):
            raise StreamError(
                f"topic {topic} not found on {self.settings.kafka_bootstrap_servers}: create the topics first "
                "(`treadle up`, or topics.admin.ensure_topics)"
            ) from None
        return len(partitions)

    async def _emit_plan_event(self, schema: str, record: dict[str, Any]) -> None:
        """Send one PlanSubmitted, SubgoalStatus or ExecutorHeartbeat to plan_events, keyed PLAN_EVENTS_KEY."""
        self._ready_to_send()
        encoded = self._encode(schema, record)
        topic = self._topics[schema]
        if topic not in self._partition_counts:  # an AgentStream learns plan_events' partitions on its first plan
            self._partition_counts[topic] = await self._partitions_of(topic)
        if "envelope" in record:
            self._seq += 1
        if (waiting := self._send(schema, record, encoded, _PLAN_KEY)) is not None:
            await waiting

    def _reward_event(
        self,
        target: StepRef | str,
        value: float,
        source: str,
        name: str,
        confidence: float,
        annotator: Annotator | str,
        evidence: str | None,
        session_id: str | None,
        episode_id: str | None,
        trace_id: str | None,
        attributes: Mapping[str, Any] | None,
        event_time: int | None,
        event_id: str | None,
    ) -> tuple[str, Coroutine[Any, Any, None] | None]:
        """Check, build, encode and hand over a RewardSignal: its event_id, and what to await when the partition's
        batch was full (None almost always). Not a coroutine itself, and positional: once per reward."""
        self._ready_to_send()
        if event_id is not None and not (isinstance(event_id, str) and event_id):
            raise ValueError(f"event_id must be a non-empty string, not {event_id!r}")
        if isinstance(target, StepRef):
            logical_event_id = target.logical_event_id
            session_id = session_id or target.session_id
            episode_id = target.episode_id if episode_id is None else episode_id
            trace_id = target.trace_id if trace_id is None else trace_id
        else:
            logical_event_id = target
            if not session_id:
                raise ValueError("a reward for a bare logical_event_id needs its session_id (the partition key)")
        event_id = event_id or uuid7()
        if (problem := reward_problem(value := float(value), confidence := float(confidence))) is not None:
            raise ValueError(problem)  # the worker would dead-letter it
        # the record as a tuple of its fields in schema order, the envelope too (ENVELOPE_FIELDS): no dicts per event
        envelope = self._envelope_values(
            event_id, session_id, episode_id or "", logical_event_id, self._seq, trace_id or "", attributes, event_time
        )
        annotator = _member(Annotator, _ANNOTATORS, annotator)._value_  # not the `.value` descriptor
        record = (envelope, source, name, value, confidence, annotator, evidence)  # REWARD_FIELDS
        encoded = self._encode(REWARD, record)
        self._seq += 1
        return event_id, self._send(REWARD, record, encoded, None, session_id)
