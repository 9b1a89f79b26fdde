"""An executor: runs the plans scheduler's released work for one resource class and reports on it.

The scheduler counts each release against one executor's advertised capacity (best fit), so an executor reads its
class's whole work topic, `<prefix>.work.<resource_class>`, with a consumer group of its own
(`<prefix>.executor.<executor_id>`, every partition assigned to it) and runs only the records whose `executor_id` is
its own: a class-wide group would hand a release to whichever member owns the partition, and admission control would
then hold for the class but not per executor. An executor that dies leaves its work to time out and be retried
elsewhere.

For each attempt it reports, on plan_events (key "plans"), `RUNNING` when the handler starts, `HEARTBEAT` more often
than the attempt's `deadline_s` while it runs, then `SUCCEEDED` (with the handler's return value as `output_ref`) or
`FAILED` (with the exception's class name as `error_class`). It drops an attempt seen before (same attempt key) and
one whose deadline passed before it could start: that one is reported `FAILED` with error class `expired` (the
scheduler has timed it out, or does so when that report moves its clock: the report only leaves a trace). Its
`ExecutorHeartbeat`s advertise what its budget has left after the attempts it holds (queued or running), capped by
the free GPU memory a probe reports (NVML, given by `treadle.Executor`), with those attempts in `running`; one is sent
every `heartbeat_interval_s` and right after an attempt ends, so the freed room is seen at once.

The handler gets the `SubgoalWork` and an `AttemptContext` whose `stream` is an AgentStream for the normal step path
(dispatches, tool results, rewards): its events carry the plan and subgoal in their envelope attributes, so rewards,
state and contracts apply to plan work and roll up per subgoal and per plan. The stream has a session of its own per
attempt (a session's `seq` must come from one writer: sharing the planner's session would make the state fold take the
executor's events for redeliveries) and the plan's episode.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import re
import socket
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar, Self

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from streams.sdk.emitter import _Emitter
from streams.sdk.plans import RESOURCE_CLASS_PATTERN, SubgoalWork
from streams.sdk.producer import create_producer
from streams.sdk.stream import AgentStream
from streams.sdk.sync import AgentStreamSync
from streams.sdk.types import DEFAULT_DELIVERY_TIMEOUT_S, ProducerError, StreamError, _text
from topics.admin import ensure_topics
from topics.catalog import work_topic_spec
from topics.codec import AvroCodec
from topics.ids import uuid7
from topics.names import EXECUTOR_HEARTBEAT, PLAN_INPUT_SCHEMAS, SUBGOAL_RELEASED, SUBGOAL_STATUS
from topics.plan_checks import Resources
from topics.settings import Settings
from topics.tool_schemas import ToolSchemas

log = logging.getLogger(__name__)

EXPIRED = "expired"  # error class: the attempt's deadline passed before it could start
ABANDONED = "abandoned"  # error class: the executor stopped before the attempt finished (or started)
OVER_CAPACITY = "over_capacity"  # error class: the attempt's profile exceeds this executor's whole budget
_SEEN_ATTEMPTS = 100_000  # attempt keys remembered for deduplication (oldest forgotten first)
_MAX_ERROR_CHARS = 2_000
_ATTEMPT_SESSIONS = uuid.UUID("6d1c3f0e-58a4-4f5e-9a53-0b8e4f1c2a77")  # namespace of the attempts' step sessions

Handler = Callable[["SubgoalWork", "AttemptContext"], Any]


def default_executor_id() -> str:
    """host-pid-random: a restarted executor is a new one (its predecessor's work times out), and two executors of
    one process are two (the same id would make both run the work counted against it)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class ExecutorConfig:
    """An executor's identity and budget.

    `gpu_memory_mb`, `gpus`, `cpu`: what its attempts may hold at once (profiles are counted against it).
    `max_concurrent`: attempts run at once (None: as many as the budget allows). `heartbeat_interval_s`: how often
    capacity is advertised; `valid_for_s`: how long the scheduler may count on one advertisement (keep it a few
    intervals). `stop_timeout_s`: how long `stop()` lets running attempts finish before abandoning them.
    `agent_id`: the agent id of the attempts' step-path events (default: the executor id).
    """

    resource_class: str
    executor_id: str = field(default_factory=default_executor_id)
    gpu_memory_mb: int = 0
    gpus: int = 0
    cpu: int = 1
    max_concurrent: int | None = None
    heartbeat_interval_s: float = 2.0
    valid_for_s: float = 10.0
    stop_timeout_s: float = 30.0
    agent_id: str = ""
    delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S

    def __post_init__(self) -> None:
        if not re.match(RESOURCE_CLASS_PATTERN, self.resource_class):
            raise ValueError(
                f"resource_class {self.resource_class!r} must be 1-200 letters, digits, '.', '_' or '-' (it names "
                "the work topic)"
            )
        if not self.executor_id:
            raise ValueError("executor_id must not be empty")
        if min(self.gpu_memory_mb, self.gpus, self.cpu) < 0:
            raise ValueError("gpu_memory_mb, gpus and cpu must be >= 0")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1 (or None)")
        if not (self.heartbeat_interval_s > 0 and self.valid_for_s > 0 and self.stop_timeout_s >= 0):
            raise ValueError("heartbeat_interval_s and valid_for_s must be positive, stop_timeout_s >= 0")

    @property
    def budget(self) -> Resources:
        return Resources(self.gpu_memory_mb, self.gpus, self.cpu)


def free_capacity(config: ExecutorConfig, held: list[SubgoalWork], gpu_free_mb: int | None) -> tuple[int, int, int]:
    """(free GPU memory MiB, free GPUs, free CPU slots) to advertise: the budget less what `held` attempts hold (never
    below 0), GPU memory capped by what the device reports free; all 0 once `max_concurrent` attempts are held."""
    if config.max_concurrent is not None and len(held) >= config.max_concurrent:
        return 0, 0, 0
    left = config.budget - sum((w.resources for w in held), Resources())
    memory = max(0, left.gpu_memory_mb)
    if gpu_free_mb is not None:
        memory = min(memory, max(0, gpu_free_mb))
    return memory, max(0, left.gpus), max(0, left.cpu)


@dataclass
class AttemptContext:
    """What a handler gets beside its work: the executor's id and an AgentStream for the attempt's step path.

    `stream` is an `AgentStream` (started) for an async handler, an `AgentStreamSync` for a sync one (over the same
    kind of stream, on the executor's loop and producer); either way its events carry `attributes` (plan_id,
    subgoal_id, attempt, plan_session_id, executor_id) and the attempt's own session, and the executor flushes them
    before it reports the attempt SUCCEEDED."""

    work: SubgoalWork
    executor_id: str
    attributes: dict[str, str]
    session_id: str
    _stream: Any = None

    @property
    def stream(self) -> Any:
        return self._stream


class _Reports(_Emitter):
    """The executor's SubgoalStatus and ExecutorHeartbeat records, to plan_events with key "plans"."""

    _start_schemas = PLAN_INPUT_SCHEMAS

    async def status(
        self,
        work: SubgoalWork,
        state: str,
        *,
        output_ref: str | None = None,
        error_class: str | None = None,
        error: str | None = None,
    ) -> None:
        record = {
            "envelope": self._envelope(
                event_id=uuid7(),
                session_id=work.session_id,
                episode_id=work.episode_id,
                logical_event_id=work.attempt_key,
                seq=self._seq,
                trace_id="",
                attributes=None,
                event_time=None,
            ),
            "plan_id": work.plan_id,
            "subgoal_id": work.subgoal_id,
            "attempt": work.attempt,
            "state": state,
            "executor_id": self.agent_id,
            "output_ref": output_ref,
            "error_class": error_class,
            "error": error[:_MAX_ERROR_CHARS] if error is not None else None,
        }
        await self._emit_plan_event(SUBGOAL_STATUS, record)

    async def heartbeat(self, record: dict[str, Any]) -> None:
        await self._emit_plan_event(EXECUTOR_HEARTBEAT, record)


class Executor:
    """Runs `handler(work, context)` for the plans scheduler's work counted against this executor; async.

    `handler` may be a coroutine function or a plain function (run in a worker thread). It returns the attempt's
    output reference (a str, None, or anything JSON-able, stored as JSON text) or raises: the exception's class name
    becomes the FAILED status's `error_class`, and the retry policy, fallback and escalation follow from there.

        async def handle(work: SubgoalWork, ctx: AttemptContext) -> str:
            step = await ctx.stream.dispatch(work.tool, work.params)
            ...
            return "s3://bucket/result.json"

        await Executor(resource_class="gpu-a100", handler=handle, gpu_memory_mb=40_000, gpus=1).run()

    `run()` runs until cancelled or `stop()`; or `start()` ... `stop()`, or `async with`. Options are the fields
    of `ExecutorConfig` (or pass `config=`).
    """

    stream_class: ClassVar[type[AgentStream]] = AgentStream  # treadle.Executor's adds the state reads
    sync_stream_class: ClassVar[type[AgentStreamSync]] = AgentStreamSync

    def __init__(
        self,
        resource_class: str | None = None,
        handler: Handler | None = None,
        settings: Settings | None = None,
        *,
        config: ExecutorConfig | None = None,
        gpu_free_mb: Callable[[], int | None] | None = None,
        tool_schemas: ToolSchemas | None = None,
        **options: Any,
    ) -> None:
        if handler is None:
            raise TypeError("Executor needs a handler: handler(work, context)")
        if config is None:
            if resource_class is None:
                raise TypeError("Executor needs a resource_class (or config=ExecutorConfig(...))")
            config = ExecutorConfig(resource_class=resource_class, **options)
        elif options or (resource_class is not None and resource_class != config.resource_class):
            raise TypeError("pass either config= or the ExecutorConfig fields, not both")
        self.config = config
        self.handler = handler
        self.settings = settings or Settings.from_env()
        self.gpu_free_mb = gpu_free_mb
        self.tool_schemas = tool_schemas if tool_schemas is not None else ToolSchemas.load(self.settings.tool_schemas)
        self.work_topic = work_topic_spec(self.settings, config.resource_class).name
        self.group_id = f"{self.settings.topic_prefix}.executor.{config.executor_id}"
        # a coroutine function, or an object with an async __call__
        self._is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(type(handler).__call__)
        self._codec = AvroCodec()
        self._producer: AIOKafkaProducer | None = None
        self._reports: _Reports | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._seen: OrderedDict[str, None] = OrderedDict()  # attempt keys taken (deduplication)
        self._held: dict[str, SubgoalWork] = {}  # accepted and not ended: queued or running
        self._queue: deque[SubgoalWork] = deque()  # accepted, waiting for room
        self._running: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []  # the consume and heartbeat loops
        self._last_sent_at = 0
        self._heartbeat_lock = asyncio.Lock()
        self._stopping = False
        self._started = False
        self._stopped = asyncio.Event()
        self._stop_task: asyncio.Task[None] | None = None

    @property
    def executor_id(self) -> str:
        return self.config.executor_id

    @property
    def held(self) -> list[str]:
        """Attempt keys accepted and not ended (queued or running): what heartbeats list in `running`."""
        return list(self._held)

    # -- lifecycle -----------------------------------------------------------------------------------------------

    async def start(self) -> Self:
        """Make the work topic if missing, take its partitions (resuming from this executor's committed offsets, or
        from the end), then advertise capacity and start taking work."""
        if self._started:
            return self
        if self._stopping:
            raise StreamError("the executor is stopped; create a new one")
        await ensure_topics([work_topic_spec(self.settings, self.config.resource_class)],  # type: ignore[arg-type]
                            self.settings.kafka_bootstrap_servers)  # fmt: skip
        self._producer = create_producer(self.settings)
        await self._producer.start()
        try:
            self._reports = _Reports(
                self.settings,
                agent_id=self.executor_id,
                policy_version="",
                producer=self._producer,
                producer_options=None,
                codec=self._codec,
                delivery_timeout_s=self.config.delivery_timeout_s,
            )
            await self._reports.start()
            self._consumer = AIOKafkaConsumer(
                bootstrap_servers=self.settings.kafka_bootstrap_servers,
                group_id=self.group_id,
                client_id=f"treadle-executor-{self.executor_id}",
                enable_auto_commit=False,
                auto_offset_reset="latest",
            )
            await self._consumer.start()
            partitions = await self._producer.partitions_for(self.work_topic)
            assigned = [TopicPartition(self.work_topic, p) for p in sorted(partitions)]
            self._consumer.assign(assigned)
            for tp in assigned:  # resolve every position now: work released after the first heartbeat is read
                committed = await self._consumer.committed(tp)
                if committed is None:
                    await self._consumer.seek_to_end(tp)
                else:
                    self._consumer.seek(tp, committed)
                await self._consumer.position(tp)
        except BaseException:
            await self._close_clients()
            raise
        self._started = True
        await self._heartbeat()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._consume()), loop.create_task(self._heartbeat_loop())]
        log.info(
            "executor %s takes %s work from %s (group %s)",
            self.executor_id, self.config.resource_class, self.work_topic, self.group_id,
        )  # fmt: skip
        return self

    async def run(self) -> None:
        """Start, run until `stop()` is called or the task is cancelled, then stop gracefully. Raises what stopped
        the executor's own loops (taking work, advertising capacity), if anything did."""
        await self.start()
        stopped = asyncio.get_running_loop().create_task(self._stopped.wait())
        try:
            await asyncio.wait([stopped, *self._tasks], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            failed = [t for t in self._tasks if t.done() and not t.cancelled() and t.exception() is not None]
            await self.stop()
        if failed:
            raise failed[0].exception()  # type: ignore[misc]

    async def stop(self, *, abandon: bool = False) -> None:
        """Stop taking work; let running attempts finish (up to `stop_timeout_s`; at once with `abandon=True`), report
        the rest and the queued ones FAILED `abandoned`; send a last heartbeat with no capacity; close. Idempotent."""
        if self._stop_task is None:
            self._stop_task = asyncio.get_running_loop().create_task(self._stop(abandon))
        await asyncio.shield(self._stop_task)

    async def _stop(self, abandon: bool) -> None:
        self._stopping = True
        try:
            if not self._started:
                return
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            while self._queue:
                work = self._queue.popleft()
                await self._end(work, "FAILED", error_class=ABANDONED, error="the executor stopped before it started")
            running = list(self._running.values())
            if running and not abandon:
                await asyncio.wait(running, timeout=self.config.stop_timeout_s)
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await self._heartbeat(final=True)
            if self._consumer is not None:
                try:
                    await self._consumer.commit()
                except Exception as exc:  # the offsets only spare a restarted executor of this id a re-read
                    log.warning("executor %s could not commit its work offsets: %r", self.executor_id, exc)
        finally:
            await self._close_clients()
            self._stopped.set()

    async def _close_clients(self) -> None:
        consumer, self._consumer = self._consumer, None
        reports, self._reports = self._reports, None
        producer, self._producer = self._producer, None
        try:
            if reports is not None:
                await reports.close()
        finally:
            if consumer is not None:
                await consumer.stop()
            if producer is not None:
                await producer.stop()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop(abandon=exc is not None)

    # -- taking work ---------------------------------------------------------------------------------------------

    async def _consume(self) -> None:
        assert self._consumer is not None
        while True:
            batches = await self._consumer.getmany(timeout_ms=500)
            for messages in batches.values():
                for message in messages:
                    await self._take(message.value, message.timestamp)
            if batches:
                try:
                    await self._consumer.commit()
                except KafkaError as exc:  # the offsets only spare a restarted executor of this id a re-read
                    log.warning("executor %s could not commit its work offsets (%r); going on", self.executor_id, exc)
            await self._start_ready()

    async def _take(self, value: bytes | None, timestamp_ms: int | None = None) -> None:
        """One record of the work topic (written at `timestamp_ms`): accept it if it is this executor's and new."""
        received_at = time.time_ns() // 1000
        sent_at = timestamp_ms * 1000 if timestamp_ms is not None and timestamp_ms > 0 else 0
        try:
            _, record = self._codec.decode(value or b"", expect=SUBGOAL_RELEASED)
            work = SubgoalWork.from_record(record, received_at=received_at, sent_at=sent_at)
        except Exception as exc:  # another writer's bad record: nothing to run, nothing to report to
            log.warning("executor %s skipped an unreadable record on %s: %s", self.executor_id, self.work_topic, exc)
            return
        if work.executor_id != self.executor_id:
            return
        key = work.attempt_key
        if key in self._seen:
            log.debug("executor %s ignores attempt %s again (a redelivery)", self.executor_id, key)
            return
        self._seen[key] = None
        if len(self._seen) > _SEEN_ATTEMPTS:
            self._seen.popitem(last=False)
        if not self.config.budget.covers(work.resources):
            await self._report_failed(work, OVER_CAPACITY, f"its profile {work.profile} exceeds this executor's budget")
            return
        self._held[key] = work
        self._queue.append(work)

    async def _start_ready(self) -> None:
        """Start queued attempts, oldest first, while the budget has room; drop those whose deadline passed."""
        while self._queue and not self._stopping:
            work = self._queue[0]
            if time.time_ns() // 1000 >= work.expires_at:
                self._queue.popleft()
                await self._end(
                    work, "FAILED", error_class=EXPIRED, error="its deadline passed before the executor could start it"
                )
                continue
            if not self._room_for(work):
                return
            self._queue.popleft()
            self._running[work.attempt_key] = asyncio.get_running_loop().create_task(self._attempt(work))

    def _room_for(self, work: SubgoalWork) -> bool:
        running = [self._held[key] for key in self._running]
        if self.config.max_concurrent is not None and len(running) >= self.config.max_concurrent:
            return False
        return (self.config.budget - sum((w.resources for w in running), Resources())).covers(work.resources)

    # -- running one attempt -------------------------------------------------------------------------------------

    async def _attempt(self, work: SubgoalWork) -> None:
        try:
            await self._run_attempt(work)
        except Exception as exc:  # a report that could not be sent: the scheduler times the attempt out
            log.error("executor %s could not report attempt %s: %r", self.executor_id, work.attempt_key, exc)

    async def _run_attempt(self, work: SubgoalWork) -> None:
        assert self._reports is not None
        context = self._context(work)
        beat: asyncio.Task[None] | None = None
        try:
            try:
                await self._reports.status(work, "RUNNING")
                beat = asyncio.get_running_loop().create_task(self._attempt_heartbeats(work))
                result = await self._call_handler(work, context)
            finally:
                if beat is not None:  # no HEARTBEAT after the attempt's last word
                    beat.cancel()
                    await asyncio.gather(beat, return_exceptions=True)
        except asyncio.CancelledError:
            await self._end(work, "FAILED", error_class=ABANDONED, error="the executor stopped while it ran")
            return
        except Exception as exc:
            log.info("attempt %s failed: %s: %s", work.attempt_key, type(exc).__name__, exc)
            await self._end(work, "FAILED", error_class=type(exc).__name__, error=str(exc) or repr(exc))
            return
        output_ref = result if result is None or isinstance(result, str) else _text(result)
        await self._end(work, "SUCCEEDED", output_ref=output_ref)

    async def _call_handler(self, work: SubgoalWork, context: AttemptContext) -> Any:
        stream = self.stream_class(
            self.settings, agent_id=self.config.agent_id or self.executor_id, session_id=context.session_id,
            episode_id=work.episode_id, attributes=context.attributes, tool_schemas=self.tool_schemas,
            producer=self._producer, codec=self._codec,
        )  # fmt: skip
        await stream.start()
        try:
            if self._is_async:
                context._stream = stream
                return await self.handler(work, context)
            # a plain function runs in a worker thread, with a blocking facade over the same stream on this loop
            context._stream = self.sync_stream_class.over(stream, asyncio.get_running_loop())
            return await asyncio.to_thread(self.handler, work, context)
        finally:
            await stream.close()  # flushed: the step-path events are acknowledged before SUCCEEDED

    def _context(self, work: SubgoalWork) -> AttemptContext:
        attributes = {
            "plan_id": work.plan_id,
            "subgoal_id": work.subgoal_id,
            "attempt": str(work.attempt),
            "plan_session_id": work.session_id,
            "executor_id": self.executor_id,
        }
        session_id = str(uuid.uuid5(_ATTEMPT_SESSIONS, work.attempt_key))
        return AttemptContext(work, self.executor_id, attributes, session_id)

    async def _attempt_heartbeats(self, work: SubgoalWork) -> None:
        """HEARTBEAT statuses more often than the deadline (a third of it, at most every heartbeat interval)."""
        assert self._reports is not None
        interval = min(self.config.heartbeat_interval_s, work.deadline_s / 3)
        while True:
            await asyncio.sleep(interval)
            await self._reports.status(work, "HEARTBEAT")

    async def _report_failed(self, work: SubgoalWork, error_class: str, error: str) -> None:
        assert self._reports is not None
        log.info("attempt %s not run (%s): %s", work.attempt_key, error_class, error)
        await self._reports.status(work, "FAILED", error_class=error_class, error=error)

    async def _end(
        self,
        work: SubgoalWork,
        state: str,
        *,
        output_ref: str | None = None,
        error_class: str | None = None,
        error: str | None = None,
    ) -> None:
        """Report the attempt's end, forget it, advertise the freed room and start what now fits."""
        assert self._reports is not None
        try:
            if error_class in (EXPIRED, ABANDONED):
                log.info("attempt %s not finished (%s): %s", work.attempt_key, error_class, error)
            await self._reports.status(work, state, output_ref=output_ref, error_class=error_class, error=error)
        finally:
            self._held.pop(work.attempt_key, None)
            self._running.pop(work.attempt_key, None)
        if not self._stopping:
            await self._heartbeat()
            await self._start_ready()

    # -- capacity ------------------------------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            try:
                await self._heartbeat()
                await self._start_ready()  # a queued attempt may have expired meanwhile
            except (KafkaError, ProducerError) as exc:  # brokers away: the advertisement lapses, the next one renews it
                log.warning("executor %s could not advertise its capacity (%r); trying again", self.executor_id, exc)

    async def _heartbeat(self, *, final: bool = False) -> None:
        """Advertise free capacity (none when `final`) and the attempts held; `sent_at` strictly increases."""
        assert self._reports is not None
        async with self._heartbeat_lock:
            if final:
                free, running = (0, 0, 0), []
            else:
                probe = self.gpu_free_mb() if self.gpu_free_mb is not None else None
                free, running = free_capacity(self.config, list(self._held.values()), probe), list(self._held)
            self._last_sent_at = max(time.time_ns() // 1000, self._last_sent_at + 1)
            await self._reports.heartbeat(
                {
                    "executor_id": self.executor_id,
                    "resource_class": self.config.resource_class,
                    "free_gpu_memory_mb": free[0],
                    "free_gpus": free[1],
                    "free_cpu": free[2],
                    "running": running,
                    "valid_for_s": float(self.config.valid_for_s),
                    "host": socket.gethostname(),
                    "sent_at": self._last_sent_at,
                }
            )
