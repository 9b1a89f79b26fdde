"""Reading back what the plans scheduler needs after a restart: its input log, and what it already sent.

The scheduler's state is a function of the plan_events log, so a worker that takes the log's partition (after a
kill -9, a restart or a rebalance) rebuilds it by folding the log again up to where it resumes. What a dead worker
decided after its last commit is decided again, identically (same decision_id, same content); the ids already on
plan_decisions and on the work topics are read back so those decisions are not sent a second time.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from topics.codec import AvroCodec, DecodeError
from topics.compacted import topic_partitions
from topics.names import PLAN_DECISION_SCHEMAS, RELEASE_DELIVERED

log = logging.getLogger(__name__)

_DECISIONS = frozenset(PLAN_DECISION_SCHEMAS)
CLOCK_SKEW_MS = 5 * 60 * 1000  # producers' clocks may disagree this much: read back from that much earlier


async def read_partition(
    bootstrap_servers: str, topic: str, partition: int, start: int, stop: int
) -> AsyncIterator[ConsumerRecord]:
    """The records of `topic[partition]` at offsets [start, stop), in order (from the log start if it is later)."""
    if stop <= start:
        return
    tp = TopicPartition(topic, partition)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, enable_auto_commit=False, max_poll_records=2000)
    await consumer.start()
    try:
        consumer.assign([tp])
        first = (await consumer.beginning_offsets([tp]))[tp]
        if first > start:
            log.warning("%s[%d] starts at offset %d: records %d..%d were deleted (retention) before the plans "
                        "scheduler could refold them, so the plans and capacity they held are unknown to it; keep "
                        "plan_events longer than any plan runs", topic, partition, first, start, first - 1)  # fmt: skip
        consumer.seek(tp, max(start, first))
        position = max(start, first)
        while position < stop:
            batch = await consumer.getmany(tp, timeout_ms=1000)
            for message in batch.get(tp, []):
                if message.offset >= stop:
                    return
                position = message.offset + 1
                yield message
            if not batch:
                position = max(position, await consumer.position(tp))  # past a transaction marker or a gap
    finally:
        await consumer.stop()


async def marked_releases(
    bootstrap_servers: str, topic: str, partition: int, start: int, stop: int, codec: AvroCodec
) -> set[str]:
    """The decision_id of every ReleaseDelivered marker on `topic[partition]` at offsets [start, stop)."""
    found: set[str] = set()
    async for message in read_partition(bootstrap_servers, topic, partition, start, stop):
        try:
            schema_name, record = codec.decode(message.value or b"")
        except DecodeError:  # an unreadable record: the intake dead-letters it; it marks nothing
            continue
        if schema_name == RELEASE_DELIVERED:
            found.add(record["decision_id"])
    return found


async def topic_names(bootstrap_servers: str) -> list[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        return sorted(await admin.list_topics())
    finally:
        await admin.close()


async def end_offset(bootstrap_servers: str, topic: str, partition: int) -> int:
    tp = TopicPartition(topic, partition)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, enable_auto_commit=False)
    await consumer.start()
    try:
        return int((await consumer.end_offsets([tp]))[tp])
    finally:
        await consumer.stop()


async def sent_decision_ids(
    bootstrap_servers: str, topics: list[str], since_ms: int, codec: AvroCodec
) -> dict[str, set[str]]:
    """The decision_id of every record on `topics` written at or after `since_ms` (less CLOCK_SKEW_MS), per topic."""
    found: dict[str, set[str]] = {topic: set() for topic in topics}
    unreadable: dict[str, int] = {}
    partitions = await topic_partitions(bootstrap_servers, topics)
    if not partitions:
        return found
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, enable_auto_commit=False, max_poll_records=2000)
    await consumer.start()
    try:
        consumer.assign(partitions)
        starts = await consumer.offsets_for_times({tp: max(0, since_ms - CLOCK_SKEW_MS) for tp in partitions})
        ends = await consumer.end_offsets(partitions)
        begin = {tp: at.offset for tp, at in starts.items() if at is not None and at.offset < ends[tp]}
        if not begin:
            return found
        consumer.assign(list(begin))
        for tp, offset in begin.items():
            consumer.seek(tp, offset)
        remaining = set(begin)
        while remaining:
            batches = await consumer.getmany(*remaining, timeout_ms=1000)
            for tp, messages in batches.items():
                for message in messages:
                    if message.offset >= ends[tp]:
                        remaining.discard(tp)
                        break
                    if message.value is not None:
                        try:
                            _, record = codec.decode(message.value, expect=_DECISIONS)
                        except DecodeError as exc:  # another writer's record on a work topic: it sent nothing
                            unreadable[tp.topic] = unreadable.get(tp.topic, 0) + 1
                            if unreadable[tp.topic] == 1:
                                log.warning("%s[%d]@%d is not a scheduler decision (%s); the plans scheduler's "
                                            "recovery skips such records (only treadle should write %s)", tp.topic,
                                            tp.partition, message.offset, exc.reason, tp.topic)  # fmt: skip
                            continue
                        found[tp.topic].add(record["decision_id"])
                    if message.offset + 1 >= ends[tp]:
                        remaining.discard(tp)
            for tp in list(remaining):
                if await consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
    finally:
        await consumer.stop()
    return found
