"""Section 1: SDK produce rate vs raw aiokafka sending the same events, pre-encoded.

All use the SDK's producer configuration (streams.sdk.producer.producer_config: acks=all, idempotence, linger 5 ms,
no compression) and a producer of their own; all end with every event acknowledged by the broker. The SDK hands
events over with aiokafka's batch API (create_batch / send_batch, PartitionBatcher), so its target compares it with a
plain loop over that API sending the same events: what the SDK's own work (validation, records, ids, Avro encoding,
batching, ack tracking) costs on top of the API it uses. The raw loops send the very bytes and keys the SDK sent in
an untimed capture run (same sizes, same partitions), pre-encoded, so the SDK's Avro encoding is SDK work, on its
side of the ratio. Like the SDK (which hashes a session's key once), the batch loop computes a key's murmur2 partition
once per key. Its ratio to `send()`, the call most producers use, is printed beside it. Each row also gives the CPU
seconds of this process per event (the producer's own threads included; the broker's not).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.producer.message_accumulator import BatchBuilder

from bench.common import Measurement, median_run
from streams.sdk.batching import default_partition
from streams.sdk.producer import producer_config
from topics.codec import AvroCodec
from topics.settings import Settings
from topics.tool_schemas import ToolSchemas
from treadle import AgentStream

SECTION = "1. SDK produce"
SDK_COMMAND = (
    "AgentStream.dispatch + tool_call (ctx) + reward per step, {sessions} streams on one shared producer; then flush()"
)
RAW_COMMAND = "AIOKafkaProducer.send(topic, pre-encoded bytes, key=session); then flush()"
RAW_BATCH_COMMAND = (
    "create_batch() + BatchBuilder.append(pre-encoded bytes, key=session) per partition (murmur2 once per key), "
    "send_batch() when full and at the end; then flush()"
)
OUTPUT = "result text 123456 " * 4  # about the size of the workload's tool outputs


async def _sdk_once(
    settings: Settings,
    sessions: int,
    steps: int,
    codec: AvroCodec,
    capture: list[tuple[str, bytes, bytes]] | None = None,
) -> tuple[float, float]:
    """One timed SDK run; with `capture`, every (topic, key, value) it hands to the batcher is appended to it."""
    producer = AIOKafkaProducer(**producer_config(settings, client_id="bench-sdk"))
    await producer.start()
    try:
        tools = ToolSchemas()
        streams = [
            AgentStream(settings, agent_id="bench-agent", policy_version="v1", producer=producer, codec=codec,
                        tool_schemas=tools)
            for _ in range(sessions)
        ]  # fmt: skip
        for stream in streams:
            await stream.start()  # learns partitions; not part of the hot path
        if capture is not None:
            _capture(streams[0], capture)
        started, cpu = time.perf_counter(), time.process_time()
        for k in range(steps):
            for stream in streams:
                step = await stream.dispatch("search", {"q": f"query {k}", "limit": 10})
                async with stream.tool_call(step) as call:
                    call.output = OUTPUT
                    call.tokens_in, call.tokens_out = 120, 40
                await stream.reward(step, 0.5, source="judge", name="quality", confidence=0.9, annotator="LLM")
        for stream in streams:
            await stream.flush()
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        for stream in streams:
            await stream.close()
        return elapsed, cpu
    finally:
        await producer.stop()


def _capture(stream: AgentStream, into: list[tuple[str, bytes, bytes]]) -> None:
    """Record what the streams' shared batcher is given (the bench's capture run only; its batcher dies with it)."""
    batcher = stream._batcher
    assert batcher is not None
    append = batcher.append

    def recording(topic: str, partition: int, key: bytes | None, value: bytes | None, owner: Any, token: int) -> Any:
        batch = append(topic, partition, key, value, owner, token)
        if batch is not None:  # None: the batch was full, the SDK appends it again once there is room
            into.append((topic, key or b"", value or b""))
        return batch

    batcher.append = recording  # type: ignore[method-assign]


async def _raw_once(settings: Settings, events: list[tuple[str, bytes, bytes]]) -> tuple[float, float]:
    producer = AIOKafkaProducer(**producer_config(settings, client_id="bench-raw"))
    await producer.start()
    try:
        for topic in {topic for topic, _, _ in events}:
            await producer.partitions_for(topic)  # metadata before the clock, as AgentStream.start does
        started, cpu = time.perf_counter(), time.process_time()
        for topic, key, value in events:
            await producer.send(topic, value, key=key)
        await producer.flush()
        return time.perf_counter() - started, time.process_time() - cpu
    finally:
        await producer.stop()


async def _raw_batch_once(settings: Settings, events: list[tuple[str, bytes, bytes]]) -> tuple[float, float]:
    """A plain loop over aiokafka's batch API with the same events: no per-message futures, one call per batch."""
    producer = AIOKafkaProducer(**producer_config(settings, client_id="bench-raw-batch"))
    await producer.start()
    try:
        counts = {topic: len(await producer.partitions_for(topic)) for topic in {topic for topic, _, _ in events}}
        started, cpu = time.perf_counter(), time.process_time()
        open_batches: dict[tuple[str, int], BatchBuilder] = {}
        partitions: dict[str, dict[bytes, int]] = {topic: {} for topic in counts}  # murmur2 once per key
        for topic, key, value in events:
            partition = partitions[topic].get(key)
            if partition is None:
                partition = partitions[topic][key] = default_partition(key, counts[topic])
            tp = (topic, partition)
            batch = open_batches.get(tp)
            if batch is None:
                batch = open_batches[tp] = producer.create_batch()
            if batch.append(timestamp=None, key=key, value=value) is None:
                await producer.send_batch(batch, tp[0], partition=tp[1])
                batch = open_batches[tp] = producer.create_batch()
                batch.append(timestamp=None, key=key, value=value)
        for (topic, partition), batch in open_batches.items():
            await producer.send_batch(batch, topic, partition=partition)
        await producer.flush()
        return time.perf_counter() - started, time.process_time() - cpu
    finally:
        await producer.stop()


def _cpu_note(runs: list[tuple[float, float]], n: int) -> str:
    """The CPU per event of the median run (by elapsed), as the rate is."""
    cpu = sorted(runs)[len(runs) // 2][1]
    return f"{cpu / n * 1e6:.1f} µs CPU/event (this process)"


async def run_produce(settings: Settings, events: int, sessions: int, repeats: int) -> list[Measurement]:
    """Alternate raw and SDK runs (after one small warm-up of each); report the median of `repeats`."""
    codec = AvroCodec()
    steps_per_session = max(1, events // (3 * sessions))
    n = 3 * sessions * steps_per_session
    raw_events: list[tuple[str, bytes, bytes]] = []
    await _sdk_once(settings, sessions, steps_per_session, codec, capture=raw_events)  # also the SDK's warm-up
    assert len(raw_events) == n, (len(raw_events), n)
    avg_bytes = sum(len(v) for _, _, v in raw_events) / n

    await _raw_once(settings, raw_events[: min(n, 3000)])
    await _raw_batch_once(settings, raw_events[: min(n, 3000)])
    raw_runs, batch_runs, sdk_runs = [], [], []
    for _ in range(repeats):
        raw_runs.append(await _raw_once(settings, raw_events))
        batch_runs.append(await _raw_batch_once(settings, raw_events))
        sdk_runs.append(await _sdk_once(settings, sessions, steps_per_session, codec))
    raw = median_run(
        SECTION, "raw aiokafka send()", RAW_COMMAND, n, "events", [e for e, _ in raw_runs],
        notes=[f"the SDK's events, pre-encoded, {avg_bytes:.0f} B/event avg", _cpu_note(raw_runs, n)],
    )  # fmt: skip
    batches = median_run(
        SECTION, "raw aiokafka batches", RAW_BATCH_COMMAND, n, "events", [e for e, _ in batch_runs],
        notes=["the API the SDK hands its events to, without the SDK's work", _cpu_note(batch_runs, n)],
    )  # fmt: skip
    sdk = median_run(
        SECTION, "SDK AgentStream", SDK_COMMAND.format(sessions=sessions), n, "events", [e for e, _ in sdk_runs],
        baseline="raw aiokafka batches", target=0.8,
        notes=["validate + build + Avro-encode + batch + ack tracking", _cpu_note(sdk_runs, n)],
    )  # fmt: skip
    sdk.notes.append(f"{raw.elapsed_s / sdk.elapsed_s:.2f}x raw aiokafka send()")
    return [raw, batches, sdk]


def produce_section(settings: Settings, events: int, sessions: int, repeats: int) -> list[Measurement]:
    return asyncio.run(run_produce(settings, events, sessions, repeats))
