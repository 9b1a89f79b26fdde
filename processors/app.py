"""The Faust app: one intake agent over all input topics, feeding every registered processor.

Faust has no joins and no event time, so the join is ours: every input event of a session lands
in the partition its session_id hashes to, and each processor keeps its state in RocksDB tables
whose changelogs are co-partitioned with the inputs (see processors/step_processor.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import faust

from processors.base import EventProcessor
from processors.intake import Accepted, Intake, SourceMessage
from processors.step_processor import StepProcessor
from processors.validation import InputValidator
from streams.settings import Settings
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec, DeadLetterStage
from topics.tool_schemas import ToolSchemas

log = logging.getLogger(__name__)

DEAD_LETTER = "treadle.derived.DeadLetter"
OUTPUT_TOPICS = {
    "treadle.derived.Transition": "transitions",
    "treadle.derived.WovenReward": "woven_rewards",
    DEAD_LETTER: "dead_letters",
}


def faust_broker_url(bootstrap_servers: str) -> str:
    return ";".join(f"kafka://{host.strip()}" for host in bootstrap_servers.split(",") if host.strip())


@dataclass
class Pipeline:
    """The app and what its agent needs; built once per worker process."""

    app: faust.App
    settings: Settings
    catalog: TopicCatalog
    codec: AvroCodec
    intake: Intake
    processors: list[EventProcessor]
    outputs: dict[str, faust.TopicT]

    async def publish(self, schema_name: str, record: dict[str, Any], key: bytes | None) -> None:
        topic = self.outputs[OUTPUT_TOPICS[schema_name]]
        await topic.send(key=key, value=self.codec.encode(schema_name, record))


def default_processors() -> list[EventProcessor]:
    return [StepProcessor()]


def build_pipeline(
    settings: Settings, codec: AvroCodec | None = None, processors: list[EventProcessor] | None = None
) -> Pipeline:
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
    processors = processors if processors is not None else default_processors()
    for processor in processors:
        processor.setup(app, settings)
    outputs = {
        kind: app.topic(catalog[kind].name, key_serializer="raw", value_serializer="raw", internal=False)
        for kind in set(OUTPUT_TOPICS.values())
    }
    pipeline = Pipeline(
        app=app,
        settings=settings,
        catalog=catalog,
        codec=codec,
        intake=Intake(codec, catalog, InputValidator(tool_schemas)),
        processors=processors,
        outputs=outputs,
    )
    inputs = app.topic(*[spec.name for spec in catalog.inputs], key_serializer="raw", value_serializer="raw")

    @app.agent(inputs, name="intake")
    async def intake(stream: faust.StreamT) -> None:
        async for event in stream.events():
            await handle_input(pipeline, event)

    return pipeline


async def handle_input(pipeline: Pipeline, event: faust.EventT) -> None:
    """Decode and validate one input event once, then hand it to every processor that takes it."""
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
        await pipeline.publish(DEAD_LETTER, read.dead_letter, key=source.key)
        return
    for processor in pipeline.processors:
        if read.schema_name not in processor.inputs:
            continue
        try:
            await processor.process(read.schema_name, read.record, pipeline)
        except Exception as exc:  # a bug or corrupt state must not block the partition: keep the event, move on
            log.exception(
                "processor %s failed on %s[%d]@%d", processor.name, source.topic, source.partition, source.offset
            )
            failure = source.dead_letter(
                DeadLetterStage.PROCESS, f"processor {processor.name} failed: {exc!r}", read.schema_name, read.record
            )
            await pipeline.publish(DEAD_LETTER, failure, key=source.key)
