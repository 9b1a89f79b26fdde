"""The SDK's record batches (PartitionBatcher) against a real broker: partitions, order, shared batches, failures.

The SDK hands events to aiokafka with create_batch/send_batch instead of send(); these tests check that what send()
guaranteed still holds: the partition of a key is the default partitioner's, a session's order survives many full
batches on the idempotent producer, and a batch the broker refuses is reported event by event.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import DefaultPartitioner
from hypothesis import given, settings
from hypothesis import strategies as st

from streams.sdk.batching import PartitionBatcher, default_partition
from streams.sdk.producer import create_producer
from topics.admin import ensure_topics
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.settings import Settings
from treadle import AgentStream, ProducerError

PARTITIONS = 5  # not the session default (3): a different modulus
KINDS = ("actions", "tool_results", "rewards")


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64), st.integers(1, 64))
def test_default_partition_is_aiokafkas_default_partitioner(key: bytes, partitions: int) -> None:
    every = list(range(partitions))
    assert default_partition(key, partitions) == DefaultPartitioner()(key, every, every)


@pytest.fixture(scope="module")
def deployment(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    s = Settings(
        home=tmp_path_factory.mktemp("batching-home"),
        kafka_bootstrap_servers=stack.kafka_bootstrap_servers,
        topic_prefix=f"batch{uuid.uuid4().hex[:8]}",
        partitions=PARTITIONS,
    )
    asyncio.run(ensure_topics(TopicCatalog(s), s.kafka_bootstrap_servers))
    return s


@pytest.fixture(scope="module")
def codec() -> AvroCodec:
    return AvroCodec()


async def read_all(s: Settings, codec: AvroCodec, kinds: tuple[str, ...] = KINDS) -> list[tuple[str, int, dict]]:
    """(kind, partition, record) of every event in the topics, in offset order per partition."""
    catalog = TopicCatalog(s)
    consumer = AIOKafkaConsumer(bootstrap_servers=s.kafka_bootstrap_servers, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(catalog[k].name, p) for k in kinds for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        remaining = {tp for tp in tps if end[tp] > 0}
        out: dict[TopicPartition, list[dict]] = {tp: [] for tp in tps}
        deadline = time.monotonic() + 60
        while remaining and time.monotonic() < deadline:
            for tp, messages in (await consumer.getmany(timeout_ms=500)).items():
                kind = catalog.by_name(tp.topic).kind
                for m in messages:
                    if m.value != b"probe":
                        out[tp].append(codec.decode(m.value, expect=catalog[kind].value_schema)[1])
                    if m.offset + 1 >= end[tp]:
                        remaining.discard(tp)
        assert not remaining, f"did not reach the end of {remaining}"
    finally:
        await consumer.stop()
    return [(catalog.by_name(tp.topic).kind, tp.partition, r) for tp in tps for r in out[tp]]


async def test_sdk_events_land_where_aiokafka_send_puts_their_key(deployment: Settings, codec: AvroCodec) -> None:
    producer = create_producer(deployment)
    await producer.start()
    try:
        streams = [AgentStream(deployment, agent_id=f"a{i}", producer=producer, codec=codec) for i in range(40)]
        for s in streams:
            await s.start()
        for s in streams:
            step = await s.dispatch("t", {"i": 1})
            await s.tool_result(step, "OK", output="x")
            await s.reward(step, 1.0, source="judge")
        for s in streams:
            await s.close()
        # where aiokafka's own send() (its default partitioner, no partition given) puts each session's key
        actions = TopicCatalog(deployment)["actions"].name
        probes = [await producer.send(actions, b"probe", key=s.session_id.encode()) for s in streams]
        expected = {s.session_id: (await probe).partition for s, probe in zip(streams, probes, strict=True)}
    finally:
        await producer.stop()
    landed: dict[str, set[int]] = {}
    for _, partition, record in await read_all(deployment, codec):
        landed.setdefault(record["envelope"]["session_id"], set()).add(partition)
    assert landed == {session: {partition} for session, partition in expected.items()}
    assert len(set(expected.values())) > 1  # the sessions spread over partitions


async def test_order_holds_across_many_full_batches_of_streams_sharing_a_producer(
    deployment: Settings, codec: AvroCodec, tmp_path: Path
) -> None:
    """Eight streams on one producer, 300 steps each with ~1 KB params, interleaved: many full 16 KB batches per
    partition, callers waiting for room. Every event lands once, and each session's seq order is its log order."""
    s = deployment.model_copy(update={"topic_prefix": f"order{uuid.uuid4().hex[:8]}"})
    await ensure_topics(TopicCatalog(s), s.kafka_bootstrap_servers)
    producer = create_producer(s)
    await producer.start()
    try:
        streams = [AgentStream(s, agent_id=f"o{i}", producer=producer, codec=codec) for i in range(8)]
        for stream in streams:
            await stream.start()

        async def agent(stream: AgentStream) -> list[str]:
            sent = []
            for i in range(300):
                step = await stream.dispatch("t", {"i": i, "pad": "p" * 1000})
                sent.append(step.logical_event_id)
                sent.append(await stream.reward(step, 0.1, source="judge"))
                if i % 50 == 0:
                    await asyncio.sleep(0)  # agents yield at times: batches go out half full too
            return sent

        sent = await asyncio.gather(*(agent(stream) for stream in streams))
        for stream in streams:
            await stream.close()
    finally:
        await producer.stop()
    reads = await read_all(s, codec, ("actions", "rewards"))
    ids = [r["envelope"]["event_id"] for _, _, r in reads]
    assert sorted(ids) == sorted(i for per_agent in sent for i in per_agent)  # all of them, once each
    by_session: dict[tuple[str, str], list[int]] = {}
    for kind, _, record in reads:  # offset order per partition; a session is on one partition
        by_session.setdefault((kind, record["envelope"]["session_id"]), []).append(record["envelope"]["seq"])
    assert len(by_session) == 16
    for seqs in by_session.values():
        assert seqs == sorted(seqs) and len(seqs) == 300


async def test_a_batch_the_broker_refuses_is_reported_event_by_event(deployment: Settings, codec: AvroCodec) -> None:
    # 2 MB batches are allowed by this producer but not by the broker (~1 MB): 400 events of 4 KB share one batch.
    async with AgentStream(
        deployment,
        agent_id="refused",
        codec=codec,
        producer_options={"max_batch_size": 2_000_000, "max_request_size": 4_000_000},
    ) as stream:
        refs = [await stream.dispatch("blob", {"data": "x" * 4000}) for _ in range(400)]
        with pytest.raises(ProducerError) as caught:
            await stream.flush()
        assert sorted(f.logical_event_id for f in caught.value.failed) == sorted(r.logical_event_id for r in refs)
        assert stream.pending == 0
        ok = await stream.dispatch("t", {})  # the stream stays usable
        await stream.flush()
    actions = [r for kind, _, r in await read_all(deployment, codec, ("actions",)) if kind == "actions"]
    mine = [r["envelope"]["logical_event_id"] for r in actions if r["envelope"]["agent_id"] == "refused"]
    assert mine == [ok.logical_event_id]


async def _batched(deployment: Settings, values: list[bytes], **options) -> tuple[PartitionBatcher, dict]:
    """Append `values` to partition 0 of the deployment's actions topic; hand over and flush like the worker."""
    producer = create_producer(deployment, **options)
    await producer.start()
    outcomes: dict[int, BaseException | None] = {}
    try:
        batcher = PartitionBatcher(producer)
        topic = TopicCatalog(deployment)["actions"].name
        for token, value in enumerate(values):
            await batcher.append_when_room(topic, 0, b"worker", value, outcomes.__setitem__, token)
        await batcher.handed_over()  # then the producer's own flush covers every record
        await producer.flush()
        await asyncio.sleep(0)  # delivery callbacks run right after the flush's futures resolve
    finally:
        await producer.stop()
    return batcher, outcomes


async def test_a_flush_after_handed_over_covers_every_appended_record(deployment: Settings) -> None:
    _, outcomes = await _batched(deployment, [b"probe"] * 300)
    assert outcomes == dict.fromkeys(range(300))  # every record acked (error None), none left behind


async def test_the_batcher_remembers_a_batch_the_broker_refused(deployment: Settings) -> None:
    batcher, outcomes = await _batched(
        deployment, [b"probe" * 800] * 400, max_batch_size=2_000_000, max_request_size=4_000_000
    )
    assert batcher.failed is not None, "a worker's flush must not look like success"
    assert len(outcomes) == 400 and all(error is not None for error in outcomes.values())


async def test_a_partition_takes_batches_again_after_the_broker_refused_one(deployment: Settings) -> None:
    # The idempotent producer numbered the refused batch's records; the broker, which already knows this producer on
    # the partition, waits for the first of those numbers: a later batch must carry it, not OutOfOrderSequenceNumber.
    producer = create_producer(deployment, max_batch_size=2_000_000, max_request_size=4_000_000)
    await producer.start()
    outcomes: dict[int, BaseException | None] = {}
    topic = TopicCatalog(deployment)["actions"].name
    try:
        batcher = PartitionBatcher(producer)
        for token, value in enumerate([b"probe", *[b"probe" * 800] * 400, b"probe", b"probe"]):
            await batcher.append_when_room(topic, 0, b"worker", value, outcomes.__setitem__, token)
            if token in (0, 400, 401):  # a batch of its own: known, refused, then after the refusal
                await batcher.handed_over()
                await producer.flush()
        await batcher.handed_over()
        await producer.flush()
        await asyncio.sleep(0)
    finally:
        await producer.stop()
    assert outcomes[0] is None
    assert all(outcomes[token] is not None for token in range(1, 401)), "the 2 MB batch is above the broker's limit"
    assert (outcomes[401], outcomes[402]) == (None, None)
