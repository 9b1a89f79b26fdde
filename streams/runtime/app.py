"""The Faust app: one intake over all input topics, in fetched batches, feeding every registered processor.

Faust has no joins and no event time, so the join is ours: every input event of a session lands
in the partition its session_id hashes to, and each processor keeps its state in RocksDB tables
whose changelogs are co-partitioned with the inputs (see processors/steps/processor.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import faust
from faust.streams import _current_event

from streams.runtime import table_writes
from streams.runtime.faust_transport import ResumingApp
from streams.runtime.metrics import WorkerMetrics
from streams.runtime.plugins import ProcessorRegistry
from streams.runtime.processor import EventProcessor, InputEvent
from streams.runtime.processor_context import ProcessorContext
from streams.sdk.batching import RecordRefusedError, key_hash
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec, DeadLetterStage
from topics.dead_letters import dead_letter
from topics.intake import Accepted, Intake, Rejected, SourceMessage
from topics.names import DEAD_LETTER
from topics.output_size import fit
from topics.publish_checks import publishable_topics
from topics.settings import CONSUMER_METADATA_MAX_AGE_MS, KAFKA_MAX_REQUEST_BYTES, Settings
from topics.tool_schemas import ToolSchemas
from topics.validation import InputValidator

log = logging.getLogger(__name__)


KEY_HASH_CACHE = 100_000  # session keys whose murmur2 is remembered
PRODUCER_BATCH_BYTES = 512 * 1024  # per output partition; one intake batch's outputs fit without waiting
MAX_OUTPUT_BYTES = KAFKA_MAX_REQUEST_BYTES - 4096  # an uncuttable output up to this is sent: room for batch headers
POLL_RECORDS = 200  # records one getmany hands out (an intake batch reads several)


def faust_broker_url(bootstrap_servers: str) -> str:
    return ";".join(f"kafka://{host.strip()}" for host in bootstrap_servers.split(",") if host.strip())


class _PartitionMarker:
    """Stands in for "the current event" where Faust's RocksDB store only needs `.message.partition`."""

    def __init__(self, partition: int) -> None:
        self.message = self
        self.partition = partition


@dataclass
class Pipeline:
    """The app and what its agent needs; built once per worker process. Also the processors' context."""

    app: faust.App
    settings: Settings
    catalog: TopicCatalog
    codec: AvroCodec
    intake: Intake
    processors: list[EventProcessor]
    outputs: dict[str, str]
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    # Next offset to process per input partition (the consumer-lag metric reads it).
    next_offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    enabled_processors: str = ""  # name (kind, distribution version) of each processor, for the start log
    _crash: asyncio.Future[Any] | None = None
    _partition_markers: dict[int, _PartitionMarker] = field(default_factory=dict)
    _out_counters: dict[str, Any] = field(default_factory=dict)  # schema -> its events_out child (labels() is slow)
    _topic_tokens: dict[str, int] = field(default_factory=dict)  # output topic -> the token its deliveries carry
    _token_topics: list[str] = field(default_factory=list)  # token -> output topic
    _partition_counts: dict[str, int] = field(default_factory=dict)
    _key_hashes: dict[bytes, int] = field(default_factory=dict)  # session key -> murmur2 (sessions repeat)

    async def publish(self, schema_name: str, record: dict[str, Any], key: bytes | None) -> None:
        """Encode and send; a record above TREADLE_MAX_EVENT_BYTES has its large fields cut, the cut recorded in it
        (topics.output_size), or raises OutputTooLargeError, which costs the input that made it."""
        await self.send_output(schema_name, key, self.encode_output(schema_name, record, key))

    def encode_output(self, schema_name: str, record: dict[str, Any], key: bytes | None) -> bytes:
        """`record` as the bytes `publish` sends (cut to fit TREADLE_MAX_EVENT_BYTES if it must be)."""
        value, cut = fit(schema_name, record, self.codec.encode, self.settings.max_event_bytes, MAX_OUTPUT_BYTES)
        if cut:
            self.metrics.outputs_truncated.labels(schema_name).inc()
            log.warning("a %s (key %r) was above TREADLE_MAX_EVENT_BYTES=%d: cut %d bytes from its largest fields, "
                        "counted in the record", schema_name.rsplit(".", 1)[-1], key, self.settings.max_event_bytes,
                        cut)  # fmt: skip
        return value

    async def send_output(self, schema_name: str, key: bytes | None, value: bytes) -> None:
        """Send an encoded record of `schema_name` to its topic and count it."""
        topic = self.outputs[schema_name]
        await self.send(topic, key, value)
        counter = self._out_counters.get(schema_name)
        if counter is None:
            counter = self._out_counters[schema_name] = self.metrics.events_out.labels(topic, schema_name)
        counter.inc()

    async def send(self, topic: str, key: bytes | None, value: bytes | None, partition: int | None = None) -> None:
        # Appended to per-partition batches of Faust's producer (processors/faust_transport.BatchingProducer).
        # Faust flushes the producer before it commits input offsets, so an output is on the broker before
        # its inputs count as done; a record that still fails (after the producer's retries) crashes the
        # worker rather than losing it.
        if partition is None:
            partition = self._partition_for(topic, key)
        token = self._topic_tokens.get(topic)
        if token is None:
            token = self._topic_tokens[topic] = len(self._token_topics)
            self._token_topics.append(topic)
        await self.app.producer.append(topic, partition, key, value, self._on_delivered, token)

    def _partition_for(self, topic: str, key: bytes | None) -> int:
        """Kafka's default partition for the key (murmur2, as Faust, aiokafka and Java clients compute it)."""
        partitions = self._partition_counts.get(topic)
        if partitions is None:
            spec = self.catalog.by_name(topic)
            if spec is None:
                raise ValueError(f"{topic} is not a topic of the catalog: send to it with an explicit partition")
            partitions = self._partition_counts[topic] = spec.partitions
        if key is None:
            return random.randrange(partitions)
        hashed = self._key_hashes.get(key)
        if hashed is None:
            if len(self._key_hashes) >= KEY_HASH_CACHE:
                self._key_hashes.clear()
            hashed = self._key_hashes[key] = key_hash(key)
        return hashed % partitions

    def _on_delivered(self, token: int, error: BaseException | None) -> None:
        if error is None or self._crash is not None:
            return
        self.metrics.producer_errors.labels(self._token_topics[token]).inc()
        if isinstance(error, RecordRefusedError):  # the broker refused this record alone: it costs that record
            self.app.producer.track(asyncio.ensure_future(self._refused(error)))  # type: ignore[attr-defined]
            return
        log.critical("an output could not be produced, stopping so its input is redelivered: %r", error)
        self._crash = asyncio.ensure_future(self.app.crash(error))

    async def _refused(self, error: RecordRefusedError) -> None:
        """A dead letter (stage PROCESS) for an output the broker refused, with the reason and the record's bytes
        (cut to fit), instead of a crash that would refuse it again after every restart. A refused dead letter is
        only logged and counted: there is nowhere left to put it."""
        schema = self._topic_schemas().get(error.topic)
        if error.topic == self.outputs.get(DEAD_LETTER):
            log.error("the dead-letter topic refused a dead letter; it is dropped (counted in "
                      "treadle_refused_outputs_total): %s", error)  # fmt: skip
            self.metrics.refused_outputs.labels(error.topic).inc()
            return
        self.metrics.refused_outputs.labels(error.topic).inc()
        reason = (f"publish refused: {error.topic}[{error.partition}] refused this {schema or 'record'} "
                  f"({len(error.value or b''):,} bytes) with {error.cause!r}; the input that made it was processed, "
                  "its other outputs were sent")  # fmt: skip
        log.error("%s (a dead letter keeps it)", reason)
        letter = dead_letter(
            DeadLetterStage.PROCESS, reason, topic=error.topic, partition=error.partition, offset=-1, key=error.key,
            value=error.value, timestamp_ms=int(time.time() * 1000), schema_name=schema,
        )  # fmt: skip
        digest = hashlib.blake2b((error.key or b"") + b"\0" + (error.value or b""), digest_size=12).hexdigest()
        letter["dead_letter_id"] = f"{error.topic}/{error.partition}/refused/{digest}"  # the same on a replay
        self.metrics.dead_letters.labels(DeadLetterStage.PROCESS.value, schema or "unknown").inc()
        await self.publish(DEAD_LETTER, letter, key=error.key)

    def _topic_schemas(self) -> dict[str, str]:
        return {topic: schema for schema, topic in self.outputs.items()}

    def bind_partition(self, partition: int) -> None:
        marker = self._partition_markers.setdefault(partition, _PartitionMarker(partition))
        _current_event.set(weakref.ref(marker))

    def input_backlog(self, partition: int) -> int | None:
        return self.app.input_backlog(partition)  # type: ignore[attr-defined,no-any-return]  # a ResumingApp

    def bind(self, event: InputEvent) -> None:
        self.bind_partition(event.source.partition)

    async def failed(self, processor: str, event: InputEvent, exc: Exception) -> None:
        log.error("processor %s failed on %s[%d]@%d: %r; the event becomes a dead letter", processor,
                  *_where(event.source), exc, exc_info=exc)  # fmt: skip
        failure = event.source.dead_letter(
            DeadLetterStage.PROCESS, f"processor {processor} failed: {exc!r}", event.schema_name, event.record
        )
        await self.publish(DEAD_LETTER, failure, key=event.source.key)
        self.metrics.dead_letters.labels(DeadLetterStage.PROCESS.value, event.schema_name).inc()
        self.metrics.isolated_failures.labels(processor).inc()


def _where(source: SourceMessage) -> tuple[str, int, int]:
    return source.topic, source.partition, source.offset


def default_processors(names: tuple[str, ...] = ("steps",)) -> list[EventProcessor]:
    """The processors named in TREADLE_PROCESSORS, in that order, found through the `treadle.processors`
    entry points (streams/runtime/plugins.py); an unknown or broken one raises PluginError naming it."""
    return ProcessorRegistry.discover().create(names)


def build_pipeline(
    settings: Settings, codec: AvroCodec | None = None, processors: list[EventProcessor] | None = None
) -> Pipeline:
    catalog = TopicCatalog(settings)
    codec = codec or AvroCodec()
    tool_schemas = ToolSchemas.load(settings.tool_schemas)
    app = ResumingApp(
        settings.app_id,
        broker=faust_broker_url(settings.kafka_bootstrap_servers),
        store="rocksdb://",
        datadir=str(settings.worker_dir),
        web_host=settings.bind_host,
        web_bind=settings.bind_host,
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
        # A crashed worker's partitions move after this long (Faust's default is 60 s; operations.md, "Failover");
        # heartbeats five times in it, so one late heartbeat never costs the membership (Kafka advises at most a
        # third). Faust heartbeats from its consumer thread, so a busy event loop does not delay them.
        broker_session_timeout=settings.session_timeout_s,
        broker_heartbeat_interval=settings.session_timeout_s / 5,
        producer_linger=0.005,  # batch output records; acks are awaited once per input batch
        # aiokafka's send() waits while its partition's batch is full until the sender drains it (one request
        # per broker in flight), so 16 KiB batches made a worker wait on round trips mid-batch.
        producer_max_batch_size=PRODUCER_BATCH_BYTES,
        # The step changelog is most of what a worker writes to Kafka (~2 records of ~1.5 KB of Avro per step);
        # zstd shrinks those batches ~5.7x, for the broker's disk and CPU and for recovery (TREADLE_OUTPUT_COMPRESSION).
        producer_compression_type=None if settings.output_compression == "none" else settings.output_compression,
        # Records one getmany hands out: a batch (TREADLE_PROCESS_BATCH_SIZE) is read in several, and each picks the
        # input partitions to read again, so co-partitioned inputs stay in step (streams/runtime/input_alignment.py).
        broker_max_poll_records=min(settings.process_batch_size, POLL_RECORDS),
        broker_commit_every=settings.commit_every,
        # Kafka's default, said out loud: topics and the local broker take this much (topics.settings), and
        # every output fits well within it (TREADLE_MAX_EVENT_BYTES, topics.output_size).
        producer_max_request_size=KAFKA_MAX_REQUEST_BYTES,
        consumer_metadata_max_age_ms=CONSUMER_METADATA_MAX_AGE_MS,  # a moved leader is found again within 10 s
    )
    app.fetch_min_bytes = settings.worker_fetch_min_bytes
    app.gapless_topics = frozenset(s.name for s in catalog if "compact" not in s.config.get("cleanup.policy", ""))
    processors = processors if processors is not None else default_processors(settings.processors)
    for processor in processors:
        processor.setup(app, settings)
    outputs = publishable_topics(catalog)
    pipeline = Pipeline(
        app=app,
        settings=settings,
        catalog=catalog,
        codec=codec,
        intake=Intake(codec, catalog, InputValidator(tool_schemas), max_event_bytes=settings.max_event_bytes),
        processors=processors,
        outputs=outputs,
    )
    pipeline.metrics.rocksdb_memory.watch(lambda: table_writes.memory_report(app))
    for processor in processors:
        attach = getattr(processor, "attach", None)  # optional: processors with timers need the context
        if attach is not None:
            attach(pipeline)
    inputs = app.topic(*[spec.name for spec in catalog.inputs], key_serializer="raw", value_serializer="raw")

    async def intake(messages: list[Any]) -> None:
        try:
            await handle_batch(pipeline, messages)
        except Exception as exc:  # unacked, so redelivered after the restart
            log.critical("the intake failed on a batch of %d input records, stopping: %r", len(messages), exc)
            # Not awaited here: the crash stops the consumer, which waits for this very batch to end (awaiting it
            # inline held a stop for 60 s: `waited 30 s for 1 handed-out input batches`).
            if pipeline._crash is None:
                pipeline._crash = asyncio.ensure_future(app.crash(exc))
            raise

    app.deliver_in_batches(
        inputs, intake, settings.process_batch_size, settings.process_batch_seconds, settings.input_max_skew_s
    )
    return pipeline


async def handle_batch(pipeline: Pipeline, messages: list[Any]) -> None:
    """Decode and validate each record once, dead-letter the bad ones, hand the rest to the processors."""
    valid: list[InputEvent] = []
    metrics = pipeline.metrics
    read_in: Counter[tuple[str, str]] = Counter()
    for message in messages:
        source = SourceMessage.of(message, timestamp_ms=int(message.timestamp * 1000))
        where = (source.topic, source.partition)
        expected = pipeline.next_offsets.get(where)
        if expected is not None and source.offset > expected:
            # Input topics have no transactions or compaction, so offsets are contiguous: a jump means the
            # consumer skipped records (or the partition came back after another worker processed them).
            log.warning("input offsets %s[%d]@%d..%d were not processed here", source.topic, source.partition,
                        expected, source.offset - 1)  # fmt: skip
        pipeline.next_offsets[where] = source.offset + 1
        read = pipeline.intake.read(source)
        if isinstance(read, Rejected) and read.unknown_writer:
            read = await pipeline.intake.read_after_reload(source)
        if isinstance(read, Accepted):
            read_in[(source.topic, read.schema_name)] += 1
            valid.append(InputEvent(read.schema_name, read.record, source))
            continue
        letter = read.dead_letter
        schema = letter.get("schema_name") or "unknown"
        read_in[(source.topic, schema)] += 1
        metrics.dead_letters.labels(letter["stage"], schema).inc()
        log.warning("dead letter from %s[%d]@%d: %s", *_where(source), letter["reason"])
        await pipeline.publish(DEAD_LETTER, letter, key=source.key)
    for (topic, schema), n in read_in.items():
        metrics.events_in.labels(topic, schema).inc(n)
    for processor in pipeline.processors:
        mine = [e for e in valid if e.schema_name in processor.inputs]
        if mine:
            await process_isolated(processor, mine, pipeline)


async def process_isolated(processor: EventProcessor, events: list[InputEvent], pipeline: Pipeline) -> None:
    """Hand `events` to `processor`; if it raises, hand them over again one at a time, so only the events it raises
    on become dead letters (stage PROCESS, naming the processor) and the rest of the batch is folded.

    Redoing the batch is safe because every processor already takes any input again: the worker is at-least-once,
    and a crash replays everything since the last commit, part-folded batches included. So each processor is
    idempotent by event_id (steps, credit and llm_judge skip events their state holds; state versions and safety
    metrics are keyed by event_id), and a retry is the same as that replay, for a part of a batch. Nothing is sent
    twice: a retried event's records that the failed attempt sent already are skipped (ProcessorContext), and one
    that raises again sends nothing from its retry.
    """
    name, metrics = processor.name, pipeline.metrics
    metrics.processor_events_in.labels(name).inc(len(events))
    started = time.perf_counter()
    attempt = ProcessorContext(pipeline, name)
    try:
        await processor.process(events, attempt)
        return
    except Exception as exc:
        if len(events) == 1:
            await pipeline.failed(name, events[0], exc)
            return
        log.error("processor %s raised on a batch of %d events (%r); handing them over one at a time so only the "
                  "events it fails on become dead letters", name, len(events), exc)  # fmt: skip
    finally:
        metrics.processor_seconds.labels(name).inc(time.perf_counter() - started)
    started = time.perf_counter()
    sent_before = set(attempt.sent)
    try:
        for event in events:
            retry = ProcessorContext(pipeline, name, sent_before)
            try:
                await processor.process([event], retry)
            except Exception as exc:
                retry.drop()
                await pipeline.failed(name, event, exc)
            else:
                await retry.release()
    finally:
        metrics.processor_seconds.labels(name).inc(time.perf_counter() - started)
