"""The agent-facing SDK: emit dispatches, tool results, rewards, state deltas and lifecycle events.

An agent loop must never wait for the data plane, so every call returns as soon as its event is
handed to the Kafka producer (appended to its partition's record batch, which aiokafka sends with
`send_batch`: streams/batching.py); the broker's acknowledgement is tracked in the background. Nothing
is dropped silently either: a send that fails later is recorded, and the next call, `flush()` or
`close()` raises `ProducerError` naming the failed events (their records are kept for a retry).

Every event is keyed by its session_id, so a session's events share one partition in every input
topic, and carries a per-stream `seq` that orders them without trusting clocks.

    async with AgentStream(agent_id="shopper") as stream:
        step = await stream.dispatch("search", {"q": "red shoes"})
        async with stream.tool_call(step) as call:
            call.output = await search("red shoes")
        await stream.reward(step, 0.7, source="heuristic")

Reward sources that only know a step's `logical_event_id` and session use `RewardEmitter`.
Agents without an event loop use `AgentStreamSync` / `RewardEmitterSync`.

Conventions: a dispatch's event_id is its step's logical_event_id, and its trace_id is that id
without dashes unless one is given; deltas and lifecycle events not tied to a step carry their own
event_id as logical_event_id. The partition is Kafka's default, murmur2(session_id) mod partitions,
as Java clients and Faust compute it. aiokafka's idempotent producer retries forever while the
broker is down, so `delivery_timeout_s` (default 120 s, like Java's delivery.timeout.ms) bounds how
long an event may stay unacknowledged before it is reported failed.
"""

from __future__ import annotations

import asyncio
import json
import json.encoder
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Mapping
from concurrent.futures import Future as ConcurrentFuture
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from types import TracebackType
from typing import Any, Self, TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaTimeoutError, UnknownTopicOrPartitionError

from streams.batching import Batch, PartitionBatcher, key_hash
from streams.producer import create_producer
from streams.settings import Settings
from streams.state_model import StateGraph
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.event_checks import (
    MAX_NAME_CHARS,
    event_time_problem,
    latency_problem,
    overlong_name_problem,
    reward_problem,
)
from topics.ids import now_micros, uuid7
from topics.tool_schemas import InvalidParamsError, ToolSchemas

__all__ = [
    "AgentStream",
    "AgentStreamSync",
    "Annotator",
    "Edge",
    "EventTooLargeError",
    "FailedEvent",
    "InvalidParamsError",
    "LifecycleKind",
    "Node",
    "ProducerError",
    "RewardEmitter",
    "RewardEmitterSync",
    "StepRef",
    "StreamError",
    "ToolCall",
    "ToolStatus",
]

T = TypeVar("T")

ACTION = "treadle.events.ActionDispatched"
TOOL_RESULT = "treadle.events.ToolResult"
REWARD = "treadle.events.RewardSignal"
STATE_DELTA = "treadle.events.StateDelta"
LIFECYCLE = "treadle.events.LifecycleEvent"
_KINDS = {
    ACTION: "actions",
    TOOL_RESULT: "tool_results",
    REWARD: "rewards",
    STATE_DELTA: "state_deltas",
    LIFECYCLE: "lifecycle",
}
_METADATA_TIMEOUT_S = 15.0
DEFAULT_DELIVERY_TIMEOUT_S = 120.0
# Encoders built once: json.dumps with options builds a new encoder per call, a visible cost per dispatch.
_PARAMS_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_LENIENT_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=str)


def _params_encoder() -> Callable[[Any], str]:
    """`_PARAMS_JSON.encode`, with json's C encoder built once instead of on every call (half the cost of a dispatch's
    JSON). Its output is the same; without the circular-reference check (whose marker dict cannot be shared between
    calls that fail halfway), a cycle raises RecursionError instead of ValueError."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # no C accelerator (e.g. PyPy)
        return _PARAMS_JSON.encode
    p = _PARAMS_JSON
    encoder = make(None, p.default, json.encoder.encode_basestring, None, p.key_separator, p.item_separator,
                   p.sort_keys, p.skipkeys, p.allow_nan)  # fmt: skip
    return lambda params: "".join(encoder(params, 0))


_params_json = _params_encoder()


class ToolStatus(StrEnum):
    """How a tool call ended (the ToolResult.status enum)."""

    OK = "OK"
    ERROR = "ERROR"
    TIMEOUT = "TIMEOUT"
    REJECTED = "REJECTED"


class Annotator(StrEnum):
    """Who produced a reward signal (the RewardSignal.annotator enum)."""

    LLM = "LLM"
    CODE = "CODE"
    HUMAN = "HUMAN"


class LifecycleKind(StrEnum):
    """Session and episode phases (the LifecycleEvent.kind enum)."""

    SESSION_CREATED = "SESSION_CREATED"
    EPISODE_STARTED = "EPISODE_STARTED"
    EPISODE_ENDED = "EPISODE_ENDED"
    SESSION_PAUSED = "SESSION_PAUSED"
    SESSION_RESUMED = "SESSION_RESUMED"
    SESSION_CLOSED = "SESSION_CLOSED"
    SESSION_ARCHIVED = "SESSION_ARCHIVED"


_TOOL_STATUSES = {m.value: m for m in ToolStatus}
_ANNOTATORS = {m.value: m for m in Annotator}
E = TypeVar("E", bound=StrEnum)


def _member(kind: type[E], by_value: dict[str, E], given: Any) -> E:
    """`kind(given)` (ValueError for an unknown value) without Enum's slow call for members and known strings."""
    if type(given) is kind:
        return given
    if type(given) is str and (member := by_value.get(given)) is not None:
        return member
    return kind(given)


class StreamError(Exception):
    """The stream cannot do what was asked (not started, closed, topics missing)."""


class EventTooLargeError(ValueError):
    """An event larger than TREADLE_MAX_EVENT_BYTES encoded; nothing was sent (the worker would dead-letter it)."""


@dataclass(frozen=True, slots=True)
class FailedEvent:
    """An event the broker never acknowledged; `record` is kept so the caller can resend it."""

    schema: str
    topic: str
    record: dict[str, Any]
    error: BaseException

    @property
    def event_id(self) -> str:
        return str(self.record["envelope"]["event_id"])

    @property
    def session_id(self) -> str:
        return str(self.record["envelope"]["session_id"])

    @property
    def logical_event_id(self) -> str:
        return str(self.record["envelope"]["logical_event_id"])


class ProducerError(StreamError):
    """Events could not be delivered to Kafka; `failed` lists them, `cause` is the first error."""

    def __init__(self, cause: BaseException, failed: Iterable[FailedEvent] = ()) -> None:
        self.cause = cause
        self.failed: tuple[FailedEvent, ...] = tuple(failed)
        what = f"{len(self.failed)} event(s) not delivered" if self.failed else "event not delivered"
        first = f" (first: {self.failed[0].schema.rsplit('.', 1)[-1]} {self.failed[0].event_id})" if self.failed else ""
        super().__init__(f"{what}{first}: {type(cause).__name__}: {cause}")


@dataclass(frozen=True, slots=True)
class StepRef:
    """The ids of a dispatched step: what a tool result or a reward needs to attach to it."""

    logical_event_id: str
    trace_id: str
    step: int
    session_id: str
    episode_id: str
    tool: str = ""
    dispatched_at: int = 0  # event_time of the dispatch, UTC micros


@dataclass(frozen=True, slots=True)
class Node:
    """A state-graph node to upsert; `data` is any JSON value (a dict, usually)."""

    id: str
    type: str
    data: Any = None
    ttl_seconds: int | None = None


@dataclass(frozen=True, slots=True)
class Edge:
    """A typed, directed edge between two nodes."""

    src: str
    dst: str
    type: str
    data: Any = None


NodeLike = Node | Mapping[str, Any]
EdgeLike = Edge | Mapping[str, Any] | tuple[str, str, str]


@dataclass(slots=True)
class ToolCall:
    """A tool call being measured by `tool_call(...)`; set the outcome fields inside the block.

    `status` defaults to OK on a normal exit, ERROR on an exception and TIMEOUT on TimeoutError;
    set it yourself (e.g. REJECTED) to override a normal exit.
    """

    step: StepRef
    output: Any = None
    error: str | None = None
    status: ToolStatus | str | None = None
    cost_usd: float = 0.0
    tokens_in: int = 0
    tokens_out: int = 0
    retries: int = 0
    attributes: dict[str, str] = field(default_factory=dict)
    latency_ms: float | None = None
    _started: float = field(default_factory=time.perf_counter, repr=False)

    def _finish(self, exc: BaseException | None) -> None:
        """Fix latency and status from how the block ended."""
        self.latency_ms = (time.perf_counter() - self._started) * 1000.0
        if exc is None:
            self.status = ToolStatus.OK if self.status is None else _member(ToolStatus, _TOOL_STATUSES, self.status)
        elif isinstance(exc, TimeoutError):  # asyncio.TimeoutError is TimeoutError since 3.11
            self.status = ToolStatus.TIMEOUT
            self.error = self.error or _describe(exc) or "timed out"
        else:
            self.status = ToolStatus.ERROR
            self.error = self.error or ("cancelled" if isinstance(exc, asyncio.CancelledError) else _describe(exc))


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _text(value: Any) -> str:
    """Tool outputs and graph data as text: strings as they are, anything else as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    return _LENIENT_JSON.encode(value)


def _json_data(value: Any) -> str:
    return "{}" if value is None else _text(value)


def _attrs(attributes: Mapping[str, Any] | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in attributes.items()} if attributes else {}


def _micros(deadline: datetime | timedelta | int | None) -> int | None:
    """A deadline as UTC micros: datetimes as they are (naive = UTC), timedeltas from now, ints as micros."""
    if deadline is None:
        return None
    if isinstance(deadline, timedelta):
        return now_micros() + int(deadline / timedelta(microseconds=1))
    if isinstance(deadline, datetime):
        aware = deadline if deadline.tzinfo is not None else deadline.replace(tzinfo=UTC)
        return int(aware.timestamp() * 1_000_000)
    return int(deadline)


def _node(node: NodeLike) -> dict[str, Any]:
    if isinstance(node, Node):
        return {"id": node.id, "type": node.type, "data_json": _json_data(node.data), "ttl_seconds": node.ttl_seconds}
    data_json = node["data_json"] if "data_json" in node else _json_data(node.get("data"))
    return {"id": node["id"], "type": node["type"], "data_json": data_json, "ttl_seconds": node.get("ttl_seconds")}


def _edge(edge: EdgeLike) -> dict[str, Any]:
    if isinstance(edge, Edge):
        return {"src": edge.src, "dst": edge.dst, "type": edge.type, "data_json": _json_data(edge.data)}
    if isinstance(edge, tuple):
        src, dst, kind = edge
        return {"src": src, "dst": dst, "type": kind, "data_json": "{}"}
    data_json = edge["data_json"] if "data_json" in edge else _json_data(edge.get("data"))
    return {"src": edge["src"], "dst": edge["dst"], "type": edge["type"], "data_json": data_json}


class _Emitter:
    """What every emitter shares: the producer, the codec, background-send tracking and `seq`."""

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
        self._topics = {schema: catalog[kind].name for schema, kind in _KINDS.items()}
        self._codec = codec or AvroCodec()
        self._producer = producer
        self._owns_producer = producer is None
        self._producer_options = dict(producer_options or {})
        self._seq = 0
        self._batcher: PartitionBatcher | None = None
        self._tokens = 0  # numbers the events handed over, for the batches' delivery callbacks
        self._pending: dict[int, tuple[str, dict[str, Any], Batch]] = {}  # token -> (schema, record, its batch)
        # (monotonic send time, token) in send order; acknowledged entries are dropped lazily from the left
        self._sent_order: deque[tuple[float, int]] = deque()
        self._delivered_callback = self._on_delivered  # bound once: it is stored with every event
        self._failures: list[FailedEvent] = []
        self._abandoned = False  # some events were reported undelivered while the producer still holds them
        self._partition_counts: dict[str, int] = {}
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
            for topic in self._topics.values():
                try:
                    partitions = await asyncio.wait_for(self._producer.partitions_for(topic), _METADATA_TIMEOUT_S)
                except (TimeoutError, KafkaTimeoutError, UnknownTopicOrPartitionError):
                    raise StreamError(
                        f"topic {topic} not found on {self.settings.kafka_bootstrap_servers}: create the topics "
                        "first (`treadle up`, or topics.admin.ensure_topics)"
                    ) from None
                self._partition_counts[topic] = len(partitions)
            self._batcher = PartitionBatcher.for_producer(self._producer)
        except BaseException:
            if self._owns_producer:
                await self._producer.stop()
                self._producer = None
            raise
        self._started = True
        return self

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until the broker acknowledged every event sent so far; raise ProducerError if any failed.

        Events still unacknowledged after `timeout` (default: delivery_timeout_s) are reported as
        failed too: the idempotent producer retries forever while the broker is down, so without a
        bound a dead broker would hang the agent. Resending a reported event is safe (same event_id).
        """
        waiting = list(self._pending)  # what was sent so far; later sends are the next flush's
        if waiting:
            batches = {sent[2].done for sent in self._pending.values()}  # resolved once their events were told
            await asyncio.wait(batches, timeout=self.delivery_timeout_s if timeout is None else timeout)
            overdue = [token for token in waiting if token in self._pending]
            if overdue:
                self._expire(overdue, "not acknowledged by the broker when flush timed out")
        if not self._pending:
            self._sent_order.clear()
        self._raise_failures()

    async def close(self, timeout: float | None = None) -> None:
        """Flush, then stop the producer if this stream created it (a shared one is left running)."""
        if self._closed:
            return
        try:
            if self._started:
                await self.flush(timeout)
        finally:
            self._closed = True
            if self._owns_producer and self._producer is not None:
                await self._stop_owned_producer(self._producer)

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
        """Events handed to the producer and not yet acknowledged."""
        return len(self._pending)

    # -- sending --------------------------------------------------------------------------------

    def _check_ready(self) -> None:
        if self._closed:
            raise StreamError("the stream is closed")
        if not self._started:
            raise StreamError("the stream is not started: `await stream.start()` or `async with`")

    def _surface_failures(self) -> None:
        """Raise what went wrong in the background since the last call, before this call sends anything."""
        order, pending = self._sent_order, self._pending
        while order and order[0][1] not in pending:
            order.popleft()
        if order and order[0][0] < time.monotonic() - self.delivery_timeout_s:
            cutoff = time.monotonic() - self.delivery_timeout_s
            overdue = []
            while order and order[0][0] < cutoff:
                token = order.popleft()[1]
                if token in pending:
                    overdue.append(token)
            self._expire(overdue, f"not acknowledged within {self.delivery_timeout_s}s")
        if self._failures:
            self._raise_failures()

    def _expire(self, tokens: Iterable[int], why: str) -> None:
        """Report pending events as failed; the producer may still deliver them (event_id deduplicates)."""
        for token in tokens:
            schema, record, _ = self._pending.pop(token)
            self._abandoned = True
            self._failures.append(FailedEvent(schema, self._topics[schema], record, KafkaTimeoutError(why)))

    def _raise_failures(self) -> None:
        if self._failures:
            failed, self._failures = self._failures, []
            raise ProducerError(failed[0].error, failed) from failed[0].error

    def _envelope(
        self,
        *,
        event_id: str,
        session_id: str,
        episode_id: str,
        logical_event_id: str,
        seq: int,
        trace_id: str,
        attributes: Mapping[str, Any] | None,
        event_time: int | None,
    ) -> dict[str, Any]:
        if event_time is not None and (problem := event_time_problem(event_time)) is not None:
            raise ValueError(problem)  # the worker would dead-letter it
        return {
            "event_id": event_id,
            "session_id": session_id,
            "agent_id": self.agent_id,
            "episode_id": episode_id,
            "logical_event_id": logical_event_id,
            "seq": seq,
            "event_time": time.time_ns() // 1000 if event_time is None else int(event_time),  # now_micros(), inline
            "policy_version": self.policy_version,
            "trace_id": trace_id,
            "attributes": _attrs(attributes) if attributes else {},
        }

    def _encode(self, schema: str, record: dict[str, Any]) -> bytes:
        """Encode before anything is counted, so a bad value costs neither a seq nor a step."""
        try:
            value = self._codec.encode(schema, record)
        except (ValueError, TypeError, KeyError, OverflowError) as exc:
            raise ValueError(f"cannot encode {schema.rsplit('.', 1)[-1]}: {exc}") from exc
        if len(value) > MAX_NAME_CHARS and (problem := overlong_name_problem(record)) is not None:
            raise ValueError(problem)  # the worker would dead-letter it
        if len(value) > self._max_event_bytes:
            raise EventTooLargeError(
                f"{schema.rsplit('.', 1)[-1]} is {len(value):,} bytes encoded, above the "
                f"{self._max_event_bytes:,}-byte limit (TREADLE_MAX_EVENT_BYTES); nothing was sent: store large "
                "payloads elsewhere and send a reference"
            )
        return value

    def _send(self, schema: str, record: dict[str, Any], value: bytes) -> Coroutine[Any, Any, None] | None:
        """Hand one encoded event to the producer (its partition's batch) and track its acknowledgement.

        Returns None once it is handed over, which is almost always; when the partition's batch is
        full, a coroutine the caller awaits (it waits for room, then hands the event over). No
        coroutine per event on the hot path.
        """
        topic = self._topics[schema]
        session_id = record["envelope"]["session_id"]
        if self._hashed[0] != session_id or not session_id:
            key = session_id.encode()
            self._hashed = (session_id, key, key_hash(key))
        _, key, hashed = self._hashed
        # Kafka's default partitioning (Java, Faust, aiokafka agree), with the key's hash computed once per session.
        partition = hashed % self._partition_counts[topic]
        token = self._tokens
        self._tokens += 1
        assert self._batcher is not None
        try:
            batch = self._batcher.append(topic, partition, key, value, self._delivered_callback, token)
        except Exception as exc:
            raise ProducerError(exc, [FailedEvent(schema, topic, record, exc)]) from exc
        if batch is None:
            return self._send_when_room(schema, record, topic, partition, key, value, token)
        self._pending[token] = (schema, record, batch)
        self._sent_order.append((time.monotonic(), token))
        return None

    async def _send_when_room(
        self, schema: str, record: dict[str, Any], topic: str, partition: int, key: bytes, value: bytes, token: int
    ) -> None:
        """The partition's batch is full and the producer has not taken it yet: wait, as aiokafka's send() does."""
        assert self._batcher is not None
        try:
            batch = None
            while batch is None:
                await self._batcher.room(topic, partition)
                batch = self._batcher.append(topic, partition, key, value, self._delivered_callback, token)
        except Exception as exc:
            raise ProducerError(exc, [FailedEvent(schema, topic, record, exc)]) from exc
        self._pending[token] = (schema, record, batch)
        self._sent_order.append((time.monotonic(), token))

    def _on_delivered(self, token: int, error: BaseException | None) -> None:
        sent = self._pending.pop(token, None)  # None: already reported as expired
        if sent is not None and error is not None:
            schema, record, _ = sent
            self._failures.append(FailedEvent(schema, self._topics[schema], record, error))

    async def _emit_reward(
        self,
        target: StepRef | str,
        value: float,
        *,
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
        event_id: str | None = None,
    ) -> str:
        self._check_ready()
        self._surface_failures()
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
        record = {
            "envelope": self._envelope(
                event_id=event_id,
                session_id=session_id,
                episode_id=episode_id or "",
                logical_event_id=logical_event_id,
                seq=self._seq,
                trace_id=trace_id or "",
                attributes=attributes,
                event_time=event_time,
            ),
            "source": source,
            "name": name,
            "value": value,
            "confidence": confidence,
            "annotator": _member(Annotator, _ANNOTATORS, annotator).value,
            "evidence": evidence,
        }
        encoded = self._encode(REWARD, record)
        self._seq += 1
        if (waiting := self._send(REWARD, record, encoded)) is not None:
            await waiting
        return event_id


class AgentStream(_Emitter):
    """One agent session's events; async. Use `async with`, or `start()` then `close()`.

    `seq` counts every event this stream emits, from 0; `step` counts its dispatches, from 0.
    Pass `producer=` (started, on this event loop) to share one producer among many streams: each
    stream then flushes only its own events and never stops the shared producer.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        agent_id: str,
        session_id: str | None = None,
        episode_id: str | None = None,
        policy_version: str = "",
        tool_schemas: ToolSchemas | None = None,
        producer: AIOKafkaProducer | None = None,
        producer_options: Mapping[str, Any] | None = None,
        codec: AvroCodec | None = None,
        delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
    ) -> None:
        super().__init__(
            settings,
            agent_id=agent_id,
            policy_version=policy_version,
            producer=producer,
            producer_options=producer_options,
            codec=codec,
            delivery_timeout_s=delivery_timeout_s,
        )
        self.session_id = session_id or uuid7()
        self.episode_id = episode_id or uuid7()
        self.tool_schemas = tool_schemas if tool_schemas is not None else ToolSchemas.load(self.settings.tool_schemas)
        self._step = 0
        self._episode_steps = 0  # dispatches since this stream switched to its current episode

    @property
    def next_step(self) -> int:
        """The step number the next dispatch will get."""
        return self._step

    @property
    def next_seq(self) -> int:
        """The seq the next event will get."""
        return self._seq

    async def dispatch(
        self,
        tool: str,
        params: dict[str, Any],
        *,
        deadline: datetime | timedelta | int | None = None,
        attributes: Mapping[str, Any] | None = None,
        trace_id: str | None = None,
        event_time: int | None = None,
    ) -> StepRef:
        """Open a step: validate `params` (InvalidParamsError before anything is sent), send, return its ids.

        Returns once the event is handed to the producer; the broker's ack is awaited by `flush()`.
        `deadline`: absolute datetime, timedelta from now, or UTC micros.
        """
        self._check_ready()
        self._surface_failures()
        self.tool_schemas.validate(tool, params)
        try:
            params_json = _params_json(params)
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidParamsError(f"params of {tool} are not JSON-serializable: {exc}") from exc
        event_id = uuid7()
        trace = trace_id or event_id.replace("-", "")
        envelope = self._envelope(
            event_id=event_id,
            session_id=self.session_id,
            episode_id=self.episode_id,
            logical_event_id=event_id,
            seq=self._seq,
            trace_id=trace,
            attributes=attributes,
            event_time=event_time,
        )
        step = self._step
        record = {
            "envelope": envelope,
            "step": step,
            "tool": tool,
            "params_json": params_json,
            "deadline": _micros(deadline),
        }
        encoded = self._encode(ACTION, record)
        # No await between reading the counters and advancing them: concurrent dispatches never share a step.
        self._step += 1
        self._episode_steps += 1
        self._seq += 1
        if (waiting := self._send(ACTION, record, encoded)) is not None:
            await waiting
        # positional: a frozen dataclass's keyword call costs a third more, once per step
        session_id, episode_id, dispatched_at = envelope["session_id"], envelope["episode_id"], envelope["event_time"]
        return StepRef(event_id, trace, step, session_id, episode_id, tool, dispatched_at)

    def tool_call(self, step: StepRef) -> _AsyncToolCallContext:
        """Measure a tool call and emit its ToolResult on exit (OK, ERROR on exception, TIMEOUT on TimeoutError).

        The exception is re-raised; if emitting fails while one is in flight, the failure is kept
        for the next call / flush instead of replacing the tool's exception.
        """
        return _AsyncToolCallContext(self, step)

    async def tool_result(
        self,
        step: StepRef,
        status: ToolStatus | str,
        *,
        output: Any = None,
        error: str | None = None,
        latency_ms: float | None = None,
        cost_usd: float = 0.0,
        tokens_in: int = 0,
        tokens_out: int = 0,
        retries: int = 0,
        attributes: Mapping[str, Any] | None = None,
        event_time: int | None = None,
    ) -> str:
        """Record a tool's outcome explicitly; latency defaults to the time since the dispatch. Returns its event_id."""
        self._check_ready()
        self._surface_failures()
        return await self._tool_result(
            step,
            _member(ToolStatus, _TOOL_STATUSES, status),
            output=output,
            error=error,
            latency_ms=latency_ms,
            cost_usd=cost_usd,
            tokens_in=tokens_in,
            tokens_out=tokens_out,
            retries=retries,
            attributes=attributes,
            event_time=event_time,
        )

    async def _tool_result(
        self,
        step: StepRef,
        status: ToolStatus,
        *,
        output: Any,
        error: str | None,
        latency_ms: float | None,
        cost_usd: float,
        tokens_in: int,
        tokens_out: int,
        retries: int,
        attributes: Mapping[str, Any] | None,
        event_time: int | None,
    ) -> str:
        if latency_ms is None:
            latency_ms = max(0.0, (now_micros() - step.dispatched_at) / 1000.0) if step.dispatched_at else 0.0
        if (problem := latency_problem(latency_ms := float(latency_ms))) is not None:
            raise ValueError(problem)
        event_id = uuid7()
        record = {
            "envelope": self._envelope(
                event_id=event_id,
                session_id=step.session_id,
                episode_id=step.episode_id,
                logical_event_id=step.logical_event_id,
                seq=self._seq,
                trace_id=step.trace_id,
                attributes=attributes,
                event_time=event_time,
            ),
            "tool": step.tool,
            "status": status.value,
            "output": _text(output),
            "error": error,
            "latency_ms": latency_ms,
            "cost_usd": float(cost_usd),
            "tokens_in": int(tokens_in),
            "tokens_out": int(tokens_out),
            "retries": int(retries),
        }
        encoded = self._encode(TOOL_RESULT, record)
        self._seq += 1
        if (waiting := self._send(TOOL_RESULT, record, encoded)) is not None:
            await waiting
        return event_id

    async def _emit_tool_call(self, call: ToolCall, in_flight: BaseException | None) -> None:
        """Emit a finished ToolCall. While the tool's own exception is `in_flight`, a failure here must not
        replace it: an undelivered event is kept for the next call / flush, anything else becomes a note on it."""
        if in_flight is None:
            self._check_ready()
            self._surface_failures()
        assert call.status is not None
        try:
            await self._tool_result(
                call.step,
                _member(ToolStatus, _TOOL_STATUSES, call.status),
                output=call.output,
                error=call.error,
                latency_ms=call.latency_ms,
                cost_usd=call.cost_usd,
                tokens_in=call.tokens_in,
                tokens_out=call.tokens_out,
                retries=call.retries,
                attributes=call.attributes,
                event_time=None,
            )
        except Exception as exc:
            if in_flight is None:
                raise
            if isinstance(exc, ProducerError):
                self._failures.extend(exc.failed)
            in_flight.add_note(f"treadle could not record this tool call's result: {exc!r}")

    async def reward(
        self,
        target: StepRef | str,
        value: float,
        *,
        source: str,
        name: str = "reward",
        confidence: float = 1.0,
        annotator: Annotator | str = Annotator.CODE,
        evidence: str | None = None,
        session_id: str | None = None,
        episode_id: str | None = None,
        attributes: Mapping[str, Any] | None = None,
        event_time: int | None = None,
        event_id: str | None = None,
    ) -> str:
        """Emit a reward signal for a step (a StepRef, or a logical_event_id of this stream's session by default).

        `event_id`: give one derived from what was judged (e.g. a uuid5) when the same reward may be emitted again,
        by a re-run or a retry: the step assembler ignores a duplicate event_id. Default: a fresh uuid7."""
        if not isinstance(target, StepRef):
            session_id = session_id or self.session_id
            episode_id = self.episode_id if episode_id is None and session_id == self.session_id else episode_id
        return await self._emit_reward(
            target,
            value,
            source=source,
            name=name,
            confidence=confidence,
            annotator=annotator,
            evidence=evidence,
            session_id=session_id,
            episode_id=episode_id,
            trace_id=None,
            attributes=attributes,
            event_time=event_time,
            event_id=event_id,
        )

    async def delta(
        self,
        *,
        node_upserts: Iterable[NodeLike] = (),
        node_deletes: Iterable[str] = (),
        edge_upserts: Iterable[EdgeLike] = (),
        edge_deletes: Iterable[EdgeLike] = (),
        rollback_to: str | None = None,
        step_ref: StepRef | None = None,
        attributes: Mapping[str, Any] | None = None,
        event_time: int | None = None,
    ) -> str:
        """Emit a state-graph change; tied to `step_ref` if given, else its logical_event_id is its own event_id."""
        self._check_ready()
        self._surface_failures()
        event_id = uuid7()
        record = {
            "envelope": self._envelope(
                event_id=event_id,
                session_id=self.session_id,
                episode_id=step_ref.episode_id if step_ref else self.episode_id,
                logical_event_id=step_ref.logical_event_id if step_ref else event_id,
                seq=self._seq,
                trace_id=step_ref.trace_id if step_ref else "",
                attributes=attributes,
                event_time=event_time,
            ),
            "node_upserts": [_node(n) for n in node_upserts],
            "node_deletes": [str(n) for n in node_deletes],
            "edge_upserts": [_edge(e) for e in edge_upserts],
            "edge_deletes": [_edge(e) for e in edge_deletes],
            "rollback_to": rollback_to,
        }
        encoded = self._encode(STATE_DELTA, record)
        self._seq += 1
        if (waiting := self._send(STATE_DELTA, record, encoded)) is not None:
            await waiting
        return event_id

    async def lifecycle(
        self,
        kind: LifecycleKind | str,
        *,
        done: bool = False,
        truncated: bool = False,
        reason: str | None = None,
        episode_id: str | None = None,
        attributes: Mapping[str, Any] | None = None,
        event_time: int | None = None,
        reward: float | None = None,
        steps: int | None = None,
    ) -> str:
        """Emit a session/episode phase change; `episode_id` switches this stream to that episode first.

        EPISODE_ENDED may carry the episode's `reward` (spread over its steps by the credit processor);
        `steps` defaults to the dispatches this stream made in the episode, which credit waits for.
        """
        self._check_ready()
        self._surface_failures()
        kind = LifecycleKind(kind)
        switching = bool(episode_id) and episode_id != self.episode_id
        if steps is None and kind is LifecycleKind.EPISODE_ENDED and not switching:
            steps = self._episode_steps
        event_id = uuid7()
        record = {
            "envelope": self._envelope(
                event_id=event_id,
                session_id=self.session_id,
                episode_id=episode_id or self.episode_id,
                logical_event_id=event_id,
                seq=self._seq,
                trace_id="",
                attributes=attributes,
                event_time=event_time,
            ),
            "kind": kind.value,
            "done": bool(done),
            "truncated": bool(truncated),
            "reason": reason,
            "reward": None if reward is None else float(reward),
            "steps": None if steps is None else int(steps),
        }
        encoded = self._encode(LIFECYCLE, record)
        if switching:
            self._episode_steps = 0
        if episode_id:
            self.episode_id = episode_id
        self._seq += 1
        if (waiting := self._send(LIFECYCLE, record, encoded)) is not None:
            await waiting
        return event_id

    async def state(self) -> StateGraph | None:
        """The session's latest state graph from Redis, expired nodes removed; None before its first version.

        The state processor writes Redis after each commit, so this is O(1) and a little behind the events
        just emitted (a state event waits for its seq's turn, see processors/state_graph.py).
        """
        from streams.state_cache import StateCache, connect

        client = connect(self.settings)
        try:
            return await StateCache(client, self.settings.topic_prefix).read(self.session_id)
        finally:
            await client.aclose()

    async def state_at(self, version_or_time: str | int | datetime) -> StateGraph:
        """The session's graph at a version id, ordinal or time, from the ClickHouse history tables."""
        from streams.state_history import state_at

        return await asyncio.to_thread(state_at, self.settings, self.session_id, version_or_time)


class _AsyncToolCallContext:
    def __init__(self, stream: AgentStream, step: StepRef) -> None:
        self._stream = stream
        self._call = ToolCall(step)

    async def __aenter__(self) -> ToolCall:
        self._stream._check_ready()
        self._call._started = time.perf_counter()
        return self._call

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is not None and not isinstance(exc, Exception | asyncio.CancelledError):
            return False  # KeyboardInterrupt / SystemExit: the process is going down
        self._call._finish(exc)
        await self._stream._emit_tool_call(self._call, exc)
        return False


class RewardEmitter(_Emitter):
    """Reward signals from a source that did not dispatch the step (an LLM judge, a metrics job, a labeller).

    It needs only the step's logical_event_id and session_id. `seq` is one counter across all the
    sessions this emitter writes to: strictly increasing per session, gaps allowed, no per-session state.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        source: str,
        agent_id: str | None = None,
        annotator: Annotator | str = Annotator.CODE,
        policy_version: str = "",
        producer: AIOKafkaProducer | None = None,
        producer_options: Mapping[str, Any] | None = None,
        codec: AvroCodec | None = None,
        delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
    ) -> None:
        super().__init__(
            settings,
            agent_id=agent_id or source,
            policy_version=policy_version,
            producer=producer,
            producer_options=producer_options,
            codec=codec,
            delivery_timeout_s=delivery_timeout_s,
        )
        self.source = source
        self.annotator = Annotator(annotator)

    async def reward(
        self,
        target: StepRef | str,
        value: float,
        *,
        session_id: str | None = None,
        episode_id: str | None = None,
        name: str = "reward",
        confidence: float = 1.0,
        annotator: Annotator | str | None = None,
        evidence: str | None = None,
        trace_id: str | None = None,
        attributes: Mapping[str, Any] | None = None,
        event_time: int | None = None,
        event_id: str | None = None,
    ) -> str:
        """Emit one reward for the step `target` (StepRef, or logical_event_id plus `session_id`). Returns event_id.

        `event_id`: give one derived from what was judged (e.g. a uuid5) when the same reward may be emitted again,
        by a re-run or a retry: the step assembler ignores a duplicate event_id. Default: a fresh uuid7."""
        return await self._emit_reward(
            target,
            value,
            source=self.source,
            name=name,
            confidence=confidence,
            annotator=annotator or self.annotator,
            evidence=evidence,
            session_id=session_id,
            episode_id=episode_id,
            trace_id=trace_id,
            attributes=attributes,
            event_time=event_time,
            event_id=event_id,
        )


# -- synchronous facades ---------------------------------------------------------------------------


class _LoopThread:
    """An event loop in a daemon thread, owned by one facade; calls block until their coroutine returns."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("a sync treadle stream was called from its own event-loop thread (would deadlock)")
        if self.loop.is_closed():
            coro.close()
            raise StreamError("the stream is closed")
        future: ConcurrentFuture[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result()

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.call(self._cancel_leftovers())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()

    @staticmethod
    async def _cancel_leftovers() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.get_running_loop().shutdown_asyncgens()


def _close_forgotten(runner: _LoopThread, inner: _Emitter) -> None:
    """A facade dropped (or the interpreter exiting) without close(): deliver its events rather than lose them."""
    if runner.loop.is_closed() or threading.current_thread() is runner.thread:
        return
    warnings.warn("a treadle sync stream was not closed; flushing it now", ResourceWarning, stacklevel=1)
    try:
        runner.call(inner.close())
    finally:
        runner.stop()


class _SyncFacade:
    """Shared by the sync facades: a background event loop running one async emitter."""

    def __init__(self, inner: _Emitter, thread_name: str) -> None:
        self._inner = inner
        self._runner = _LoopThread(thread_name)
        self._finalizer = weakref.finalize(self, _close_forgotten, self._runner, inner)

    def start(self) -> Self:
        """Connect to Kafka; blocks until the producer is ready."""
        self._runner.call(self._inner.start())
        return self

    def flush(self, timeout: float | None = None) -> None:
        """Block until every event sent so far is acknowledged; raise ProducerError if any failed."""
        self._runner.call(self._inner.flush(timeout))

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the producer and the background loop. Idempotent."""
        self._finalizer.detach()
        if self._runner.loop.is_closed():
            return
        try:
            self._runner.call(self._inner.close(timeout))
        finally:
            self._runner.stop()

    @property
    def pending(self) -> int:
        return self._inner.pending

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as close_error:
            exc.add_note(f"also, while closing the treadle stream: {close_error!r}")


class AgentStreamSync(_SyncFacade):
    """AgentStream for agents without an event loop: same methods, blocking only until the event is handed off.

    Runs its own event loop in a background thread (one per facade) and its own producer.
    Use `with AgentStreamSync(...) as stream:` or `start()` ... `close()`.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        agent_id: str,
        session_id: str | None = None,
        episode_id: str | None = None,
        policy_version: str = "",
        tool_schemas: ToolSchemas | None = None,
        producer_options: Mapping[str, Any] | None = None,
        codec: AvroCodec | None = None,
        delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
    ) -> None:
        self._stream = AgentStream(
            settings,
            agent_id=agent_id,
            session_id=session_id,
            episode_id=episode_id,
            policy_version=policy_version,
            tool_schemas=tool_schemas,
            producer_options=producer_options,
            codec=codec,
            delivery_timeout_s=delivery_timeout_s,
        )
        super().__init__(self._stream, f"treadle-stream-{self._stream.session_id}")

    @property
    def session_id(self) -> str:
        return self._stream.session_id

    @property
    def episode_id(self) -> str:
        return self._stream.episode_id

    @property
    def agent_id(self) -> str:
        return self._stream.agent_id

    def dispatch(
        self,
        tool: str,
        params: dict[str, Any],
        *,
        deadline: datetime | timedelta | int | None = None,
        attributes: Mapping[str, Any] | None = None,
        trace_id: str | None = None,
        event_time: int | None = None,
    ) -> StepRef:
        """See AgentStream.dispatch; InvalidParamsError is raised here, before anything is sent."""
        return self._runner.call(
            self._stream.dispatch(
                tool, params, deadline=deadline, attributes=attributes, trace_id=trace_id, event_time=event_time
            )
        )

    def tool_call(self, step: StepRef) -> _SyncToolCallContext:
        """See AgentStream.tool_call; a plain `with` block, timed in the caller's thread."""
        return _SyncToolCallContext(self, step)

    def tool_result(
        self,
        step: StepRef,
        status: ToolStatus | str,
        *,
        output: Any = None,
        error: str | None = None,
        latency_ms: float | None = None,
        cost_usd: float = 0.0,
        tokens_in: int = 0,
        tokens_out: int = 0,
        retries: int = 0,
        attributes: Mapping[str, Any] | None = None,
        event_time: int | None = None,
    ) -> str:
        """See AgentStream.tool_result."""
        return self._runner.call(
            self._stream.tool_result(
                step,
                status,
                output=output,
                error=error,
                latency_ms=latency_ms,
                cost_usd=cost_usd,
                tokens_in=tokens_in,
                tokens_out=tokens_out,
                retries=retries,
                attributes=attributes,
                event_time=event_time,
            )
        )

    def reward(
        self,
        target: StepRef | str,
        value: float,
        *,
        source: str,
        name: str = "reward",
        confidence: float = 1.0,
        annotator: Annotator | str = Annotator.CODE,
        evidence: str | None = None,
        session_id: str | None = None,
        episode_id: str | None = None,
        attributes: Mapping[str, Any] | None = None,
        event_time: int | None = None,
        event_id: str | None = None,
    ) -> str:
        """See AgentStream.reward."""
        return self._runner.call(
            self._stream.reward(
                target,
                value,
                source=source,
                name=name,
                confidence=confidence,
                annotator=annotator,
                evidence=evidence,
                session_id=session_id,
                episode_id=episode_id,
                attributes=attributes,
                event_time=event_time,
                event_id=event_id,
            )
        )

    def delta(
        self,
        *,
        node_upserts: Iterable[NodeLike] = (),
        node_deletes: Iterable[str] = (),
        edge_upserts: Iterable[EdgeLike] = (),
        edge_deletes: Iterable[EdgeLike] = (),
        rollback_to: str | None = None,
        step_ref: StepRef | None = None,
        attributes: Mapping[str, Any] | None = None,
        event_time: int | None = None,
    ) -> str:
        """See AgentStream.delta."""
        return self._runner.call(
            self._stream.delta(
                node_upserts=node_upserts,
                node_deletes=node_deletes,
                edge_upserts=edge_upserts,
                edge_deletes=edge_deletes,
                rollback_to=rollback_to,
                step_ref=step_ref,
                attributes=attributes,
                event_time=event_time,
            )
        )

    def lifecycle(
        self,
        kind: LifecycleKind | str,
        *,
        done: bool = False,
        truncated: bool = False,
        reason: str | None = None,
        episode_id: str | None = None,
        attributes: Mapping[str, Any] | None = None,
        event_time: int | None = None,
        reward: float | None = None,
        steps: int | None = None,
    ) -> str:
        """See AgentStream.lifecycle."""
        return self._runner.call(
            self._stream.lifecycle(
                kind,
                done=done,
                truncated=truncated,
                reason=reason,
                episode_id=episode_id,
                attributes=attributes,
                event_time=event_time,
                reward=reward,
                steps=steps,
            )
        )

    @property
    def next_step(self) -> int:
        """See AgentStream.next_step."""
        return self._stream.next_step

    @property
    def next_seq(self) -> int:
        """See AgentStream.next_seq."""
        return self._stream.next_seq

    def state(self) -> StateGraph | None:
        """See AgentStream.state."""
        return self._runner.call(self._stream.state())

    def state_at(self, version_or_time: str | int | datetime) -> StateGraph:
        """See AgentStream.state_at."""
        return self._runner.call(self._stream.state_at(version_or_time))


class _SyncToolCallContext:
    def __init__(self, facade: AgentStreamSync, step: StepRef) -> None:
        self._facade = facade
        self._call = ToolCall(step)

    def __enter__(self) -> ToolCall:
        self._facade._stream._check_ready()
        self._call._started = time.perf_counter()
        return self._call

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is not None and not isinstance(exc, Exception):
            return False
        self._call._finish(exc)
        try:
            self._facade._runner.call(self._facade._stream._emit_tool_call(self._call, exc))
        except Exception as emit_error:
            if exc is None:
                raise
            exc.add_note(f"treadle could not record this tool call's result: {emit_error!r}")
        return False


class RewardEmitterSync(_SyncFacade):
    """RewardEmitter for sources without an event loop (a labelling UI, a batch job)."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        source: str,
        agent_id: str | None = None,
        annotator: Annotator | str = Annotator.CODE,
        policy_version: str = "",
        producer_options: Mapping[str, Any] | None = None,
        codec: AvroCodec | None = None,
        delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
    ) -> None:
        self._emitter = RewardEmitter(
            settings,
            source=source,
            agent_id=agent_id,
            annotator=annotator,
            policy_version=policy_version,
            producer_options=producer_options,
            codec=codec,
            delivery_timeout_s=delivery_timeout_s,
        )
        super().__init__(self._emitter, f"treadle-rewards-{source}")

    def reward(
        self,
        target: StepRef | str,
        value: float,
        *,
        session_id: str | None = None,
        episode_id: str | None = None,
        name: str = "reward",
        confidence: float = 1.0,
        annotator: Annotator | str | None = None,
        evidence: str | None = None,
        trace_id: str | None = None,
        attributes: Mapping[str, Any] | None = None,
        event_time: int | None = None,
        event_id: str | None = None,
    ) -> str:
        """See RewardEmitter.reward."""
        return self._runner.call(
            self._emitter.reward(
                target,
                value,
                session_id=session_id,
                episode_id=episode_id,
                name=name,
                confidence=confidence,
                annotator=annotator,
                evidence=evidence,
                trace_id=trace_id,
                attributes=attributes,
                event_time=event_time,
                event_id=event_id,
            )
        )
