"""Reading a small compacted topic (schemas, reward policies) from the beginning to its current end."""

from __future__ import annotations

from collections.abc import Sequence

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient


async def topic_partitions(bootstrap_servers: str, topics: Sequence[str]) -> list[TopicPartition]:
    """Every partition of the `topics` that exist, by topic then partition, from one request to the cluster.

    A consumer only knows the partitions of topics it subscribed to, so the cluster is asked."""
    if not topics:
        return []
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        described = await admin.describe_topics(list(topics))
    finally:
        await admin.close()
    found = {d["topic"]: sorted(p["partition"] for p in d["partitions"]) for d in described if d["error_code"] == 0}
    return [TopicPartition(t, p) for t in topics for p in found.get(t, ())]


async def read_to_end(bootstrap_servers: str, topic: str) -> list[tuple[bytes | None, bytes]]:
    """Every (key, value) on the topic up to its end offsets when called, tombstones left out, in offset order."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, enable_auto_commit=False)
    await consumer.start()
    records: list[tuple[bytes | None, bytes]] = []
    try:
        partitions = await topic_partitions(bootstrap_servers, [topic])
        if not partitions:
            return records
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        end = await consumer.end_offsets(partitions)
        remaining = {tp for tp in partitions if end[tp] > 0}
        while remaining:
            batches = await consumer.getmany(timeout_ms=1000)
            for tp, messages in batches.items():
                for message in messages:
                    if message.value is not None:
                        records.append((message.key, message.value))
                    if message.offset + 1 >= end[tp]:
                        remaining.discard(tp)
    finally:
        await consumer.stop()
    return records
