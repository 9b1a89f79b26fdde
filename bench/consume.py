"""Baselines of section 2: a raw aiokafka consume + Avro decode loop over the input topics, nothing else; then
the worker's own per-event logic (intake, fold, state bytes, output encoding) over the same messages, no Kafka.

Run as its own process (pinned to the worker's core when pinning), so it gets the same CPU the worker had:
    python -m bench.consume --bootstrap HOST:PORT --prefix P --partitions 4 --events N --out FILE
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.common import Measurement, write_measurements
from processors.steps.assembler import STEP_INPUTS, StepAssembler, StepState
from processors.steps.policy import PolicyBook, load_policy_file
from processors.steps.state_codec import StepStateCodec
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.intake import Accepted, Intake, SourceMessage
from topics.settings import Settings
from topics.tool_schemas import ToolSchemas
from topics.validation import InputValidator

SECTION = "2. worker"
COMMAND = "AIOKafkaConsumer.getmany over the 5 input topics + AvroCodec.decode(value, expect=topic schema)"
FOLD_COMMAND = (
    "in memory, no Kafka: Intake.read + StepState from/to bytes in a dict + StepAssembler.fold/outputs + encode outputs"
)


async def consume(settings: Settings, events: int, timeout: float) -> tuple[Measurement, list[SourceMessage]]:
    catalog = TopicCatalog(settings)
    codec = AvroCodec()
    expected = {spec.name: spec.value_schema for spec in catalog.inputs}
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap_servers,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_records=5000,
    )
    await consumer.start()
    try:
        partitions = [TopicPartition(name, p) for name in expected for p in range(settings.partitions)]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        decoded = 0
        kept: list = []
        started = time.perf_counter()
        deadline = started + timeout
        while decoded < events and time.perf_counter() < deadline:
            batches = await consumer.getmany(timeout_ms=200, max_records=5000)
            for tp, messages in batches.items():
                expect = expected[tp.topic]
                for message in messages:
                    codec.decode(message.value, expect=expect)
                    decoded += 1
                kept.extend(messages)
        elapsed = time.perf_counter() - started
    finally:
        await consumer.stop()
    measured = Measurement(
        SECTION, "raw consume+decode", COMMAND, decoded, "events", elapsed, complete=decoded >= events,
        notes=["own process, same core as the worker had" if _pinned() else "own process"],
    )  # fmt: skip
    sources = [
        SourceMessage(m.topic, m.partition, m.offset, m.key, m.value, m.timestamp) for m in kept
    ]  # consumed in partition batches, as the worker sees them
    return measured, sources


def fold(settings: Settings, messages: list[SourceMessage]) -> Measurement:
    """What handle_input computes per event, minus Faust and Kafka: the ceiling of the worker's own code."""
    catalog = TopicCatalog(settings)
    codec = AvroCodec()
    intake = Intake(codec, catalog, InputValidator(ToolSchemas()))
    policies = PolicyBook([load_policy_file(settings.reward_policy)]) if settings.reward_policy else None
    assembler = StepAssembler(policies)
    states = StepStateCodec(codec)
    table: dict[bytes, bytes] = {}
    outputs = 0
    started = time.perf_counter()
    for message in messages:
        read = intake.read(message)
        if not isinstance(read, Accepted) or read.schema_name not in STEP_INPUTS:
            continue
        key = read.record["envelope"]["logical_event_id"].encode()
        stored = table.get(key)
        state = states.decode(stored) if stored is not None else StepState(key.decode())
        if assembler.fold(state, read.schema_name, read.record, message.value):
            table[key] = states.encode(state)
        for schema_name, derived in assembler.outputs(state):
            codec.encode(schema_name, derived)
            outputs += 1
    elapsed = time.perf_counter() - started
    return Measurement(
        SECTION, "fold logic only", FOLD_COMMAND, len(messages), "events", elapsed,
        notes=[f"{outputs} output records encoded; the ceiling for the worker's own code on this core"],
    )  # fmt: skip


def _pinned() -> bool:
    import os

    return hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) == 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--partitions", type=int, required=True)
    parser.add_argument("--events", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--reward-policy", type=Path, help="the worker's TREADLE_REWARD_POLICY, for the fold")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    settings = Settings(
        kafka_bootstrap_servers=args.bootstrap,
        topic_prefix=args.prefix,
        partitions=args.partitions,
        reward_policy=args.reward_policy,
    )
    measured, messages = asyncio.run(consume(settings, args.events, args.timeout))
    write_measurements(args.out, [measured, fold(settings, messages)])


if __name__ == "__main__":
    main()
