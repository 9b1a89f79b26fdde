"""Live load for the weaving bench: the workload sent at a fixed input rate, event_time = the wall clock at send.

Besides sending, it keeps what the latency measurement needs: the broker's ack time of every reward, when a
raw consumer of the rewards topic received it (the Kafka floor, the latency baseline), and when each step's
`complete` transition row first appeared in ClickHouse (polled through the worker's sink SQL endpoint).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from bench.workload import REWARD, TRANSITION, Planned, WeavingExpectation
from streams.sdk.batching import PartitionBatcher, key_hash
from topics.codec import AvroCodec
from topics.settings import Settings

COMPLETE_SQL = (
    "SELECT DISTINCT logical_event_id FROM transitions "
    "WHERE reward_status = 'complete' AND updated_at >= fromUnixTimestamp64Micro(toInt64({since}), 'UTC')"
)


@dataclass
class PacedRun:
    """What the paced producer did; acks only when asked for (a soak would hold millions)."""

    sent: int = 0
    first_s: float | None = None  # perf_counter of the first and last send
    last_s: float | None = None
    behind_s: float = 0.0  # worst delay of a send behind its schedule
    acks: dict[str, tuple[float, bytes]] = field(default_factory=dict)  # reward id -> (ack wall time, its value)
    failed: int = 0
    steady: tuple[int, float] | None = None  # (sent, seconds) when the last dispatch was sent

    @property
    def rate(self) -> float:
        """Input events/s while dispatches were still being planned (after it, only the steps' tails are sent)."""
        if self.steady is None or self.steady[1] <= 0:
            return float("nan")
        return self.steady[0] / self.steady[1]


async def send_paced(
    producer: AIOKafkaProducer,
    plan: Iterator[Planned],
    topics: dict[str, str],
    run: PacedRun,
    expectation: WeavingExpectation | None = None,
    poller: CompletePoller | None = None,
    steady_s: float | None = None,
) -> None:
    """Send every planned event at its time (event_time = now); with an expectation, note rewards' acks and
    hand steps whose last required reward was just sent to the poller.

    Events go the way the SDK sends them (streams/sdk/batching.py): appended to their partition's batch, the key's
    murmur2 computed once per session. aiokafka's `send()` per event took ~29% of the bench's CPU (py-spy at
    5,000 events/s), on the core the sink shares.
    """
    codec = AvroCodec()
    seqs: dict[str, int] = {}
    batcher = PartitionBatcher.for_producer(producer)
    partitions = len(await producer.partitions_for(topics[REWARD]))  # the input topics are co-partitioned
    hashes: dict[bytes, int] = {}
    delivered = _Deliveries(run)
    start = time.perf_counter()
    for item in plan:
        delay = start + item.at_s - time.perf_counter()
        if delay > 0.001:
            await asyncio.sleep(delay)
        else:
            run.behind_s = max(run.behind_s, -delay)
            if run.sent % 200 == 0:
                await asyncio.sleep(0)  # let the poller and the receipts reader run when the producer is behind
        if run.steady is None and steady_s is not None and item.at_s >= steady_s and run.first_s is not None:
            run.steady = (run.sent - 1, run.last_s - run.first_s)  # type: ignore[operator]
        value = item.encode(codec, time.time_ns() // 1000, seqs)
        key = item.session_id.encode()
        hashed = hashes.get(key)
        if hashed is None:
            hashed = hashes[key] = key_hash(key)
        tracked = expectation is not None and item.original is None and item.schema == REWARD
        token = delivered.track(item.record["envelope"]["event_id"], value) if tracked else -1
        topic, partition = topics[item.schema], hashed % partitions
        if batcher.append(topic, partition, key, value, delivered, token) is None:
            await batcher.append_when_room(topic, partition, key, value, delivered, token)
        run.last_s = time.perf_counter()
        run.first_s = run.first_s or run.last_s
        run.sent += 1
        if expectation is None or item.original is not None:
            continue
        expectation.sent(item)
        if item.schema == REWARD:
            lid = item.record["envelope"]["logical_event_id"]
            step = expectation.steps[lid]
            if poller is not None and step.complete:
                poller.pending[lid] = step.last_reward_us
    await batcher.handed_over()
    await producer.flush()


class _Deliveries:
    """The batcher's delivery callback: counts failures, notes each tracked reward's ack time in `run.acks`."""

    def __init__(self, run: PacedRun) -> None:
        self.run = run
        self._tracked: list[tuple[str, bytes] | None] = []  # token -> (event_id, value) until acked

    def track(self, event_id: str, value: bytes) -> int:
        self._tracked.append((event_id, value))
        return len(self._tracked) - 1

    def __call__(self, token: int, error: BaseException | None) -> None:
        if error is not None:
            self.run.failed += 1
            return
        if token >= 0:
            tracked, self._tracked[token] = self._tracked[token], None
            if tracked is not None:
                event_id, value = tracked
                self.run.acks[event_id] = (time.time(), value)


class CompletePoller:
    """Polls ClickHouse for `complete` transition rows of the steps in `pending`; notes when each first shows.

    Only recent rows are selected: updated_at (the step's newest input event time, here its last reward's) at or
    after the oldest pending step's, and never more than `horizon_s` back (older pending steps count as stale).
    """

    def __init__(self, settings: Settings, interval_s: float = 0.1, horizon_s: float = 30.0) -> None:
        self.settings = settings
        self.interval_s = interval_s
        self.horizon_s = horizon_s
        self.pending: dict[str, int] = {}  # logical_event_id -> last required reward's event time (us)
        self.seen: dict[str, float] = {}  # logical_event_id -> wall time the query that first returned it ended
        self.stale: set[str] = set()
        self.query_s: list[float] = []
        self.errors = 0

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until `stop` is set and nothing is pending (or until the horizon has passed since)."""
        from sinks.sql_client import QueryFailedError, run_sql

        stopped_at: float | None = None
        while True:
            if stop.is_set():
                stopped_at = stopped_at or time.perf_counter()
                if not self.pending or time.perf_counter() - stopped_at > self.horizon_s:
                    return
            await asyncio.sleep(self.interval_s)
            if not self.pending:
                continue
            now_us = time.time_ns() // 1000
            horizon = now_us - int(self.horizon_s * 1e6)
            for lid in [lid for lid, t in self.pending.items() if t < horizon]:
                self.stale.add(lid)
                del self.pending[lid]
            if not self.pending:
                continue
            since = min(self.pending.values())
            began = time.perf_counter()
            try:
                _, rows = await asyncio.to_thread(run_sql, self.settings, COMPLETE_SQL.format(since=since))
            except QueryFailedError:
                self.errors += 1
                continue
            ended = time.time()
            self.query_s.append(time.perf_counter() - began)
            for (lid,) in rows:
                if self.pending.pop(lid, None) is not None:
                    self.seen[lid] = ended


@dataclass
class Observed:
    """Everything the latency run noted: sends and acks, the expectation, and the three observers."""

    run: PacedRun
    expectation: WeavingExpectation
    poller: CompletePoller
    receipts: Receipts
    published: Published


class _Tail:
    """A raw consumer positioned at the end of a topic before anything is produced; `take` gets every batch."""

    fetch: dict[str, int] = {}  # AIOKafkaConsumer fetch settings (read-only); none: aiokafka's defaults

    def __init__(self, settings: Settings, topic: str) -> None:
        self.settings = settings
        self.topic = topic
        self._consumer: AIOKafkaConsumer | None = None

    async def start(self) -> None:
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.settings.kafka_bootstrap_servers, enable_auto_commit=False, **self.fetch
        )
        await self._consumer.start()
        partitions = [TopicPartition(self.topic, p) for p in range(self.settings.partitions)]
        self._consumer.assign(partitions)
        await self._consumer.seek_to_end(*partitions)
        for tp in partitions:
            await self._consumer.position(tp)

    async def run(self, stop: asyncio.Event) -> None:
        assert self._consumer is not None, "start() first"
        try:
            while not stop.is_set():
                batches = await self._consumer.getmany(timeout_ms=50, max_records=5000)
                now = time.time()
                for tp, messages in batches.items():
                    self.take(tp.partition, messages, now)
        finally:
            await self._consumer.stop()

    def take(self, partition: int, messages: list, now: float) -> None:
        raise NotImplementedError


class Receipts(_Tail):
    """The rewards topic: when each value first arrived (a duplicate repeats its original's bytes), for the
    Kafka-floor baseline."""

    def __init__(self, settings: Settings, topic: str) -> None:
        super().__init__(settings, topic)
        self.at: dict[bytes, float] = {}

    def take(self, partition: int, messages: list, now: float) -> None:
        for message in messages:
            self.at.setdefault(message.value, now)


class Published(_Tail):
    """The transitions topic: when the worker first published each step's `complete` Transition (before the sink)."""

    # fuller fetches (the bench shares a core with the broker and the sink); "produced" reads the producer timestamp
    fetch = {"fetch_min_bytes": 65_536, "fetch_max_wait_ms": 100}

    def __init__(self, settings: Settings, topic: str) -> None:
        super().__init__(settings, topic)
        self.at: dict[str, float] = {}
        self.created: dict[str, float] = {}  # the same Transitions' producer timestamps (when the worker sent them)
        self._codec = AvroCodec()

    def take(self, partition: int, messages: list, now: float) -> None:
        for message in messages:
            if b"complete" not in message.value:
                continue  # not a complete Transition (two in three): not decoded, to spare the bench's CPU
            record = self._codec.decode(message.value, expect=TRANSITION)[1]
            if record["reward_status"] == "complete" and record["logical_event_id"] not in self.at:
                self.at[record["logical_event_id"]] = now
                self.created[record["logical_event_id"]] = message.timestamp / 1000
