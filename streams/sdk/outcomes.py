"""Rewards back to the agent: a step's woven reward, read from the woven-rewards topic as the worker publishes it.

Why the output topic and not SQL or Redis pub/sub: the WovenReward the worker publishes *is* the outcome (the
sink only copies it into ClickHouse, a flush later), so reading the topic is the earliest a reward can be known;
it needs nothing the SDK does not have already (aiokafka and the Avro codec, no database client, no extra
service); and it replays: an agent that asks after the reward was published still finds it in the log, which a
pub/sub message sent before anyone listened would not give. Polling SQL would add the sink's flush delay and a
query per step per poll. Outputs are keyed by session_id and murmur2-partitioned like the inputs, so one
partition of the topic holds every reward of a session: the watcher assigns that partition (no consumer group,
nothing committed) and skips other sessions' records.

The first WovenReward of a step comes once no required source is waiting (each arrived, or its window passed:
processors' step assembler), so it is what `outcome()` returns; if the log already holds later revisions
(optional sources in time) when it is asked, the highest is returned. Until then there is no fused value, so
`outcome()` at its timeout returns a partial Outcome with the reward signals seen so far on the rewards topic
(same partition), unfused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from streams.sdk.batching import key_hash
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec, DecodeError
from topics.names import REWARD, WOVEN_REWARD
from topics.settings import Settings

log = logging.getLogger(__name__)

CLOCK_SKEW_MS = 60_000  # records are looked up by timestamp from this far before the stream started
LOOKUP_ATTEMPTS = 5
T = TypeVar("T")


@dataclass(frozen=True)
class Outcome:
    """A step's reward as the agent receives it.

    `partial` is False when `woven` is the step's WovenReward (its required sources are in or their windows
    passed; `status` is then complete, partial or imputed, as the reward policy decided). It is True when the
    timeout came first: `value` is None, `status` is `pending` and `signals` lists the reward signals seen so far
    (source, name, value, confidence, event_id), not yet fused.
    """

    logical_event_id: str
    session_id: str
    step: int
    value: float | None
    status: str
    revision: int
    partial: bool
    woven: dict[str, Any] | None = None
    signals: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of_woven(cls, record: dict[str, Any]) -> Outcome:
        return cls(
            logical_event_id=record["logical_event_id"],
            session_id=record["session_id"],
            step=record["step"],
            value=record["value"],
            status=record["status"],
            revision=record["revision"],
            partial=False,
            woven=record,
        )


async def _retried(lookup: Callable[[], Awaitable[T]], attempts: int = LOOKUP_ATTEMPTS) -> T:
    """An offsets lookup, tried again after a retriable error (a leader election on a busy or fresh broker)."""
    for attempt in range(attempts):
        try:
            return await lookup()
        except KafkaError as exc:
            if attempt == attempts - 1 or not getattr(exc, "retriable", False):
                raise
            await asyncio.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


class OutcomeWatcher:
    """Reads one session's partition of the woven-rewards and rewards topics in the background.

    It keeps the latest WovenReward and the reward signals of each of the session's steps it has read (a session's
    worth: what `outcome()` for an earlier step needs), and decodes only records keyed by its session.
    """

    def __init__(self, settings: Settings, codec: AvroCodec, session_id: str, since_ms: int) -> None:
        catalog = TopicCatalog(settings)
        self.settings = settings
        self.codec = codec
        self.session_id = session_id
        self._key = session_id.encode()
        self.since_ms = since_ms
        self._woven_topic = catalog.for_schema(WOVEN_REWARD).name
        self._rewards_topic = catalog.for_schema(REWARD).name
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._woven: dict[str, dict[str, Any]] = {}  # logical_event_id -> highest revision seen
        self._signals: dict[str, dict[str, dict[str, Any]]] = {}  # logical_event_id -> event_id -> signal
        self._changed = asyncio.Event()
        self._subscribers: list[asyncio.Queue[dict[str, Any]]] = []
        self._failure: BaseException | None = None
        self._failed = asyncio.Event()

    @property
    def topics(self) -> tuple[str, str]:
        return self._woven_topic, self._rewards_topic

    async def start(self, partition_counts: dict[str, int]) -> None:
        """Assign the session's partition of each topic (`partition_counts`: topic -> partitions, as the producer
        knows them) and read from where the log's timestamps reach the stream's creation, less clock skew."""
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.settings.kafka_bootstrap_servers,
            group_id=None,
            enable_auto_commit=False,
            client_id="treadle-sdk-outcomes",
        )
        await consumer.start()
        try:
            hashed = key_hash(self.session_id.encode())
            partitions = [TopicPartition(topic, hashed % partition_counts[topic]) for topic in self.topics]
            consumer.assign(partitions)
            since = max(0, self.since_ms - CLOCK_SKEW_MS)
            # The ends first: a record appended between the two lookups is then after the end (read), whereas the
            # other way round it could land between a lookup that found nothing and the end it fell back to.
            ends = await _retried(lambda: consumer.end_offsets(partitions))
            found = await _retried(lambda: consumer.offsets_for_times(dict.fromkeys(partitions, since)))
            for tp in partitions:
                at = found.get(tp)
                consumer.seek(tp, min(at.offset, ends[tp]) if at is not None else ends[tp])
        except BaseException:
            await consumer.stop()
            raise
        self._consumer = consumer
        self._task = asyncio.create_task(self._run(consumer), name=f"treadle-outcomes-{self.session_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def _run(self, consumer: AIOKafkaConsumer) -> None:
        try:
            while True:
                batches = await consumer.getmany(timeout_ms=200)
                for tp, messages in batches.items():
                    for message in messages:
                        if message.key == self._key:  # other sessions share the partition: not even decoded
                            self._take(tp.topic, message.value)
                self._changed.set()
                self._changed = asyncio.Event()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surfaced to whoever waits
            self._failure = exc
            self._failed.set()
            self._changed.set()

    def _take(self, topic: str, value: bytes | None) -> None:
        expect = WOVEN_REWARD if topic == self._woven_topic else REWARD
        try:
            _, record = self.codec.decode(value, expect=expect)
        except DecodeError as exc:
            log.warning("treadle outcomes: skipped an unreadable record on %s: %s", topic, exc.reason)
            return
        if expect == WOVEN_REWARD:
            if record["session_id"] != self.session_id:
                return
            lid = record["logical_event_id"]
            best = self._woven.get(lid)
            if best is None or record["revision"] >= best["revision"]:
                self._woven[lid] = record
            for queue in self._subscribers:
                queue.put_nowait(record)
            return
        envelope = record["envelope"]
        if envelope["session_id"] != self.session_id:
            return
        self._signals.setdefault(envelope["logical_event_id"], {})[envelope["event_id"]] = {
            "event_id": envelope["event_id"],
            "source": record["source"],
            "name": record["name"],
            "value": record["value"],
            "confidence": record["confidence"],
        }

    async def _caught_up(self, deadline: float) -> None:
        """Wait until everything in the partitions when this was called has been read (or the deadline)."""
        consumer = self._consumer
        assert consumer is not None
        try:
            ends = await _retried(lambda: consumer.end_offsets(list(consumer.assignment())))
        except KafkaError as exc:  # only an answer's freshness depends on it: go on with what was read
            log.warning(
                "treadle outcomes: could not look up the end of the log (%r); answering from what was read", exc
            )
            return
        for tp, end in ends.items():
            while await consumer.position(tp) < end:
                if not await self._wait_change(deadline):
                    return

    async def _wait_change(self, deadline: float) -> bool:
        """Wait for the next batch the background task read; False at the deadline."""
        if self._failure is not None:
            raise self._failure
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), left)
        if self._failure is not None:
            raise self._failure
        return time.monotonic() < deadline

    async def outcome(self, logical_event_id: str, step: int, timeout: float) -> Outcome:
        deadline = time.monotonic() + timeout
        await self._caught_up(deadline)
        while logical_event_id not in self._woven:
            if not await self._wait_change(deadline):
                signals = sorted(self._signals.get(logical_event_id, {}).values(), key=lambda s: s["event_id"])
                return Outcome(logical_event_id, self.session_id, step, None, "pending", 0, True, None, signals)
        return Outcome.of_woven(self._woven[logical_event_id])

    async def outcomes(self) -> AsyncIterator[Outcome]:
        """The latest revision of every step rewarded so far (in step order), then each revision as it is read."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        for record in sorted(self._woven.values(), key=lambda r: (r["step"], r["logical_event_id"])):
            queue.put_nowait(record)
        self._subscribers.append(queue)
        try:
            while True:
                if self._failure is not None:
                    raise self._failure
                getting = asyncio.ensure_future(queue.get())
                failed = asyncio.ensure_future(self._failed.wait())
                done, _ = await asyncio.wait({getting, failed}, return_when=asyncio.FIRST_COMPLETED)
                failed.cancel()
                if getting not in done:
                    getting.cancel()
                    continue
                yield Outcome.of_woven(getting.result())
        finally:
            self._subscribers.remove(queue)
