"""Feeds ClickHouse from Kafka: input topics become raw events, output topics become replay tables.

Its own consumer group and manual commits give at-least-once delivery: offsets are committed only
after the rows they carried are inserted. Replays insert identical rows, which the
ReplacingMergeTree tables and latest-revision views collapse, so the tables stay exact.
"""

from __future__ import annotations

import logging
import time

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from sinks.clickhouse import ClickHouseStore
from sinks.rejected_rows import RejectStage, RowSource
from sinks.sink_group import SinkGroupAssignor, SinkIdentity, SinkRefusedError, StoreOwner, check_store_owner
from sinks.writer import ClickHouseSink
from streams.runtime.metrics import SinkMetrics
from topics.catalog import TopicCatalog, TopicRole, topic_expectation
from topics.codec import AvroCodec, DecodeError
from topics.intake import Accepted, Intake, Rejected, SourceMessage
from topics.settings import CONSUMER_METADATA_MAX_AGE_MS, Settings

log = logging.getLogger(__name__)

# A fetch returns once 64 KiB are there, or after 100 ms: fewer, fuller fetches than aiokafka's 1 byte / 500 ms, which
# under a steady trickle fetched a few records per request (the broker's CPU, on the core it shares with the sink).
FETCH_MIN_BYTES = 65_536
FETCH_MAX_WAIT_MS = 100


class SinkConsumer:
    def __init__(
        self,
        settings: Settings,
        catalog: TopicCatalog,
        codec: AvroCodec,
        intake: Intake,
        store: ClickHouseStore,
    ) -> None:
        self.settings = settings
        self.codec = codec
        self.intake = intake
        self.metrics = SinkMetrics()
        self.sink = ClickHouseSink(
            store, batch_size=settings.sink_batch_size, metrics=self.metrics, codec=codec,
            native_blocks=settings.sink_native_blocks,
        )  # fmt: skip
        self._consumer: AIOKafkaConsumer | None = None
        self.assignor = SinkGroupAssignor(SinkIdentity.of(settings))  # one sink per embedded database
        self._specs = {s.name: s for s in catalog if s.role is not TopicRole.INTERNAL}
        self._expect = {name: topic_expectation(spec) for name, spec in self._specs.items()}  # output decoding
        self._consumed: dict[TopicPartition, int] = {}  # next offset per partition read since the last commit
        self._owner = ""  # StoreOwner.encode() of this sink's database, set by run()
        self._owner_recorded = False
        self.skipped = 0
        # inputs of this batch whose writer schema is not known yet, with where their rows came from
        self._unknown_writer: list[tuple[SourceMessage, RowSource]] = []

    def consumer(self) -> AIOKafkaConsumer:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.settings.kafka_bootstrap_servers,
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=self.settings.sink_batch_size,
            fetch_min_bytes=FETCH_MIN_BYTES,
            fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
            partition_assignment_strategy=(self.assignor,),
            metadata_max_age_ms=CONSUMER_METADATA_MAX_AGE_MS,  # a moved leader is found again within 10 s
        )
        consumer.subscribe(list(self._specs), listener=_RecordOwnerOnAssign(self))
        return consumer

    async def _record_owner(self, assigned: list[TopicPartition]) -> None:
        """Commit one assigned partition's current offset again with this sink's StoreOwner, before any row is
        inserted: a sink killed before its first commit still leaves the record check_store_owner reads."""
        consumer = self._consumer
        if consumer is None or self._owner_recorded:
            return
        tp = assigned[0]
        try:
            offset = await consumer.committed(tp)
            if offset is None:
                offset = (await consumer.beginning_offsets([tp]))[tp]
            await consumer.commit({tp: OffsetAndMetadata(offset, self._owner)})
            self._owner_recorded = True
        except Exception as exc:  # e.g. another rebalance began: the first regular commit records it instead
            log.warning("could not record this sink as the owner of its group's rows yet (%r)", exc)

    @property
    def group_id(self) -> str:
        return f"{self.settings.app_id}-clickhouse-sink"

    async def exposition(self) -> bytes:
        """Prometheus text: insert batches and, as of now, how far the sink is behind each partition."""
        consumer = self._consumer
        if consumer is not None:
            for tp in consumer.assignment():
                end = consumer.highwater(tp)  # from the last fetch response; None before the first
                if end is not None:
                    lag = max(0, end - await consumer.position(tp))
                    self.metrics.consumer_lag.labels(self.group_id, tp.topic, str(tp.partition)).set(lag)
        return self.metrics.exposition()

    async def run(self) -> None:
        owner = StoreOwner.of(self.settings)
        await check_store_owner(self.settings, self.group_id, owner)  # before joining: the owner may be down
        self._owner = owner.encode()
        consumer = self._consumer = self.consumer()
        await consumer.start()
        try:
            await self._loop(consumer)
        finally:
            await consumer.stop()

    async def _loop(self, consumer: AIOKafkaConsumer) -> None:
        first_buffered: float | None = None
        uncommitted = full = False
        timeout_ms = int(self.settings.sink_flush_seconds * 1000)
        while True:
            batches = await consumer.getmany(timeout_ms=timeout_ms, max_records=self.settings.sink_batch_size)
            if self.assignor.refusal is not None:
                raise SinkRefusedError(self.assignor.refusal)  # with no partitions: nothing of ours is pending
            for tp, messages in batches.items():
                if messages:
                    full |= self._add_all(tp.topic, messages)
                    uncommitted = True
                    self._consumed[tp] = messages[-1].offset + 1
            if self._unknown_writer:
                full |= await self._add_after_reload()
            if self.sink.pending and first_buffered is None:
                first_buffered = time.monotonic()
            due = first_buffered is not None and (
                full or time.monotonic() - first_buffered >= self.settings.sink_flush_seconds
            )
            if due:
                await self.sink.flush()
                first_buffered, full = None, False
            if uncommitted and not self.sink.pending:
                await self._commit(consumer)
                uncommitted = False

    async def _commit(self, consumer: AIOKafkaConsumer) -> None:
        """Commit what was read, each offset carrying this sink's StoreOwner (sinks.sink_group.check_store_owner)."""
        assigned = consumer.assignment()
        offsets = {tp: OffsetAndMetadata(o, self._owner) for tp, o in self._consumed.items() if tp in assigned}
        if offsets:
            await consumer.commit(offsets)
            self._owner_recorded = True
        self._consumed.clear()  # also what was read from partitions revoked since

    async def _add_after_reload(self) -> bool:
        """The batch's inputs of unknown writer schemas, read again after reloading the registry (the worker does the
        same before it dead-letters them); True when a table's batch is full."""
        sources, self._unknown_writer = self._unknown_writer, []
        full = False
        for source, row_source in sources:
            read = await self.intake.read_after_reload(source)
            if isinstance(read, Accepted):
                full |= self.sink.add(self._specs[source.topic].kind, read.record, row_source, read.schema_name)
            else:
                self.skipped += 1
        return full

    def _add_all(self, topic: str, messages: list) -> bool:
        """Buffer the rows of one partition's messages; True when a table's batch is full. An output topic's batch
        whose records all stay bytes is taken whole (ClickHouseSink.add_encoded_records), the rest one by one."""
        spec = self._specs[topic]
        if spec.role is not TopicRole.INPUT:
            full = self.sink.add_encoded_records(spec.kind, messages, self._expect[topic])
            if full is not None:
                return full
        full = False
        for message in messages:
            full |= self._add(message)
        return full

    def _add(self, message) -> bool:
        """Buffer the message's rows; True when a table's batch is full (TREADLE_SINK_BATCH_SIZE rows). Never raises
        for the record's sake: one that cannot become rows goes to rejected_rows (sinks/rejected_rows.py)."""
        spec = self._specs[message.topic]
        row_source = RowSource.of(message)
        try:
            if spec.role is TopicRole.INPUT:
                source = SourceMessage.of(message, timestamp_ms=message.timestamp)
                read = self.intake.read(source)
                if isinstance(read, Rejected) and read.unknown_writer:
                    self._unknown_writer.append((source, row_source))  # read again after reloading the registry
                    return False
                if not isinstance(read, Accepted):
                    self.skipped += 1  # the step assembler writes it to dead letters
                    return False
                return self.sink.add(spec.kind, read.record, row_source, read.schema_name)
            expect = self._expect[message.topic]
            return self.sink.add_encoded(spec.kind, message.value, expect=expect, source=row_source)
        except DecodeError as exc:
            self.skipped += 1
            self.sink.reject(RejectStage.MAP, spec.kind, f"undecodable on an output topic: {exc.reason}", row_source)
            return False
        except Exception as exc:
            self.sink.reject(RejectStage.MAP, spec.kind, f"reading the record failed: {exc!r}", row_source)
            return False


class _RecordOwnerOnAssign(ConsumerRebalanceListener):
    """SinkConsumer._record_owner as soon as the group gives this sink partitions."""

    def __init__(self, sink: SinkConsumer) -> None:
        self.sink = sink

    async def on_partitions_revoked(self, revoked: object) -> None:
        return None

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        if assigned:
            await self.sink._record_owner(sorted(assigned))
