"""The Faust app: topics, the changelog-backed step table, and the step-assembler agent.

Faust has no joins and no event time, so the join is ours: every input event of a session lands
in the partition its session_id hashes to, the step's state lives in a RocksDB table whose
changelog is co-partitioned with the inputs, and the fold itself is StepAssembler (pure logic).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import faust

from processors.intake import Accepted, Intake, SourceMessage
from processors.step_assembler import STEP_INPUTS, StepAssembler, StepState
from processors.validation import InputValidator
from streams.settings import Settings
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec, DeadLetterStage
from topics.tool_schemas import ToolSchemas

log = logging.getLogger(__name__)

DEAD_LETTER = "treadle.derived.DeadLetter"
_OUTPUT_TOPIC = {
    "treadle.derived.Transition": "transitions",
    "treadle.derived.WovenReward": "woven_rewards",
    DEAD_LETTER: "dead_letters",
}


def faust_broker_url(bootstrap_servers: str) -> str:
    return ";".join(f"kafka://{host.strip()}" for host in bootstrap_servers.split(",") if host.strip())


@dataclass
class Pipeline:
    """The app and what its agents need; built once per worker process."""

    app: faust.App
    settings: Settings
    catalog: TopicCatalog
    codec: AvroCodec
    intake: Intake
    assembler: StepAssembler
    steps: Any  # faust.Table[bytes, bytes]
    outputs: dict[str, faust.TopicT]


def build_pipeline(settings: Settings, codec: AvroCodec | None = None) -> Pipeline:
    catalog = TopicCatalog(settings)
    codec = codec or AvroCodec()
    tool_schemas = ToolSchemas.load(settings.tool_schemas)
    app = faust.App(
        settings.app_id,
        broker=faust_broker_url(settings.kafka_bootstrap_servers),
        store="rocksdb://",
        datadir=str(settings.worker_dir),
        web_host="127.0.0.1",
        web_bind="127.0.0.1",
        web_port=settings.web_port,
        topic_partitions=settings.partitions,
        topic_replication_factor=settings.replication_factor,
        topic_allow_declare=True,
        processing_guarantee="at_least_once",
        key_serializer="raw",
        value_serializer="raw",
        table_cleanup_interval=60.0,
        producer_acks=-1,
        consumer_auto_offset_reset="earliest",
        # A crashed worker's partitions move after this long (Faust's default is 60 s).
        broker_session_timeout=15.0,
        broker_heartbeat_interval=3.0,
    )
    steps = app.Table(
        "steps",
        partitions=settings.partitions,
        key_type=bytes,  # Faust picks the raw serializer from the type; without it, JSON
        value_type=bytes,
        help="StepState per logical_event_id, serialized with orjson.",
    )
    outputs = {
        kind: app.topic(catalog[kind].name, key_serializer="raw", value_serializer="raw", internal=False)
        for kind in ("transitions", "woven_rewards", "dead_letters")
    }
    pipeline = Pipeline(
        app=app,
        settings=settings,
        catalog=catalog,
        codec=codec,
        intake=Intake(codec, catalog, InputValidator(tool_schemas)),
        assembler=StepAssembler(),
        steps=steps,
        outputs=outputs,
    )
    inputs = app.topic(*[spec.name for spec in catalog.inputs], key_serializer="raw", value_serializer="raw")

    @app.agent(inputs, name="step-assembler")
    async def step_assembler(stream: faust.StreamT) -> None:
        async for event in stream.events():
            await handle_input(pipeline, event)

    return pipeline


async def handle_input(pipeline: Pipeline, event: faust.EventT) -> None:
    """Decode, validate and fold one input event; publish derived records or a dead letter."""
    source = SourceMessage.of(event.message, timestamp_ms=int(event.message.timestamp * 1000))
    read = pipeline.intake.read(source)
    if not isinstance(read, Accepted):
        log.warning(
            "dead letter from %s[%d]@%d: %s",
            source.topic,
            source.partition,
            source.offset,
            read.dead_letter["reason"],
        )
        await publish(pipeline, DEAD_LETTER, read.dead_letter, key=source.key)
        return
    if read.schema_name not in STEP_INPUTS:
        return  # state deltas and lifecycle events are raw events for now; the state graph folds them
    record = read.record
    key = record["envelope"]["logical_event_id"].encode()
    try:
        stored = pipeline.steps.get(key)
        state = StepState.from_bytes(stored) if stored is not None else StepState(key.decode())
        output = pipeline.assembler.apply(state, read.schema_name, record)
    except Exception as exc:  # a bug or corrupt state must not block the partition: keep the event, move on
        log.exception("step assembly failed for %s[%d]@%d", source.topic, source.partition, source.offset)
        failure = source.dead_letter(
            DeadLetterStage.PROCESS, f"step assembly failed: {exc!r}", read.schema_name, read.record
        )
        await publish(pipeline, DEAD_LETTER, failure, key=source.key)
        return
    if output.changed:
        pipeline.steps[key] = state.to_bytes()
    session_key = record["envelope"]["session_id"].encode()
    for schema_name, derived in output.records:
        await publish(pipeline, schema_name, derived, key=session_key)


async def publish(pipeline: Pipeline, schema_name: str, record: dict[str, Any], key: bytes | None) -> None:
    topic = pipeline.outputs[_OUTPUT_TOPIC[schema_name]]
    await topic.send(key=key, value=pipeline.codec.encode(schema_name, record))
