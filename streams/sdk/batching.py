"""The SDK's events appended to per-partition record batches, handed to aiokafka with `send_batch`.

aiokafka's `send()` costs about as much per event as everything else the SDK does: a coroutine,
metadata and partition checks, a future per message and a done callback per future. Appending to a
`BatchBuilder` costs a fraction of that, and a batch needs one future and one callback. Batches go
through the producer's own accumulator and sender, so acks, retries, idempotence and linger stay
the producer's. What `send()` guarantees holds here too:

- order: a partition's batches are handed over one at a time, in append order, and the idempotent
  producer keeps that order in the log (one batch in flight per partition, retried in place);
- partition: `default_partition` is murmur2(key) like Kafka's default partitioner (Java, aiokafka, Faust);
- a record above the producer's max_request_size is refused at once (MessageSizeTooLargeError);
- backpressure: when a partition's batch is full and the one before it is not yet taken by the
  producer, the caller waits, as `send()` waits for a full batch to drain;
- one outcome per event: each event's owner is called back with its batch's result or error.

A batch the broker refuses for what it holds (a record above the topic's max.message.bytes, an invalid record: a
non-retriable error that is not about the producer itself) can be sent again one record at a time
(`isolate_refused`, the worker's choice), so only the records the broker refuses alone fail, each with a
RecordRefusedError that carries it. Retriable errors never get here: the producer retries those itself, with its
backoff, until the batch expires (the worker's producer: 20 minutes).

An idempotent producer numbers each partition's records (sequence numbers) when it takes a batch to send, and
aiokafka does not take the numbers of a refused batch back: the broker still waits for the first of them, so every
later batch to that partition would fail with OutOfOrderSequenceNumber. A refused batch's numbers are therefore
given back (`_give_back_sequence`), as the Java producer does (adjustSequencesDueToFailedBatch).

One batcher serves every stream of one producer, so events of many sessions share batches.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka import errors as kafka_errors
from aiokafka.errors import BrokerResponseError, KafkaError, MessageSizeTooLargeError, ProducerClosed
from aiokafka.partitioner import murmur2
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.structs import TopicPartition

__all__ = [
    "Batch", "DeliveryCallback", "PartitionBatcher", "RecordRefusedError", "default_partition", "key_hash",
    "refused_for_records",
]  # fmt: skip

DeliveryCallback = Callable[[int, BaseException | None], None]  # (token, error or None)
AIOKAFKA_MAX_REQUEST_SIZE = 1_048_576  # aiokafka's default, for a producer that does not say
_NO_HEADERS: list[Any] = []  # every record's headers (the record builder takes a list; it only reads it)
_SIZE_SLACK = 256  # above any record overhead estimate_size_in_bytes adds: below it, no need to compute it


# Non-retriable broker errors about the producer, not the records: sending records again alone cannot help.
_PRODUCER_ERRORS = tuple(
    getattr(kafka_errors, name)
    for name in ("InvalidProducerEpoch", "OutOfOrderSequenceNumber", "UnknownProducerIdError", "ProducerFenced",
                 "TransactionalIdAuthorizationFailed", "ClusterAuthorizationFailedError", "UnsupportedVersionError")
    if hasattr(kafka_errors, name)
)  # fmt: skip


def refused_for_records(error: BaseException | None) -> bool:
    """Whether the broker refused a produce for what the batch holds (retrying the same records cannot succeed,
    but each record alone may): a non-retriable broker error that is not about the producer's own state."""
    return isinstance(error, BrokerResponseError) and not error.retriable and not isinstance(error, _PRODUCER_ERRORS)


class RecordRefusedError(KafkaError):
    """The broker refused this one record, sent alone (`cause`, e.g. MessageSizeTooLargeError); it carries the
    record, so its owner can say what was lost (the worker dead-letters it)."""

    retriable = False

    def __init__(self, topic: str, partition: int, key: bytes | None, value: bytes | None, cause: BaseException):
        super().__init__(f"{topic}[{partition}] refused a {len(value or b''):,}-byte record: {cause!r}")
        self.topic, self.partition, self.key, self.value, self.cause = topic, partition, key, value, cause


def key_hash(key: bytes) -> int:
    """murmur2 of the key with the sign bit cleared: the part of the default partition that a caller may cache."""
    return murmur2(key) & 0x7FFFFFFF


def default_partition(key: bytes, partitions: int) -> int:
    """Kafka's default partition for a key (Java clients, aiokafka's DefaultPartitioner, Faust agree)."""
    return key_hash(key) % partitions


class Batch:
    """One partition's records being gathered; `done` resolves after every owner heard the outcome."""

    __slots__ = ("builder", "count", "done", "full", "owners", "records", "tokens")

    def __init__(self, builder: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.builder = builder
        # the BatchBuilder's record builder, appended to directly: BatchBuilder.append's keyword call and checks
        # cost a third of an append; `count` is its record count (`_relative_offset`), set when it is handed over
        self.records = builder._builder
        self.count = 0
        self.full = False
        # each record's owner and token, side by side: no tuple per record for the garbage collector to visit
        self.owners: list[DeliveryCallback] = []
        self.tokens: list[int] = []
        self.done: asyncio.Future[None] = loop.create_future()

    def finish(self, error: BaseException | None) -> None:
        if self.done.done():
            return
        for callback, token in zip(self.owners, self.tokens, strict=True):
            callback(token, error)
        self.done.set_result(None)


class _Partition:
    """A partition's open batch, the task handing its batches over, and who waits for room."""

    __slots__ = ("open", "partition", "room", "task", "topic")

    def __init__(self, topic: str, partition: int) -> None:
        self.topic = topic
        self.partition = partition
        self.open: Batch | None = None
        self.task: asyncio.Task[None] | None = None
        self.room: asyncio.Future[None] | None = None


_BATCHERS: weakref.WeakValueDictionary[int, PartitionBatcher] = weakref.WeakValueDictionary()


class PartitionBatcher:
    """Record batches per (topic, partition) for one started producer, on the producer's event loop."""

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer
        self._loop = asyncio.get_running_loop()
        self._partitions: dict[tuple[str, int], _Partition] = {}
        # aiokafka keeps it private; send() refuses records above it, so the batcher must too
        self.max_request_size = int(getattr(producer, "_max_request_size", AIOKAFKA_MAX_REQUEST_SIZE))
        self._closed: BaseException | None = None
        self.failed: BaseException | None = None  # the first delivery error (a flush must not look like success)
        # Send a batch the broker refused for its records again, a record at a time (refused_for_records); a record
        # refused alone reaches its owner as RecordRefusedError, and does not count as `failed`.
        self.isolate_refused = False
        self._pending: set[asyncio.Future[Any]] = set()  # records sent again alone, and work owners `track`ed

    @classmethod
    def for_producer(cls, producer: AIOKafkaProducer) -> PartitionBatcher:
        """The batcher every stream on `producer` shares (kept while some stream holds it)."""
        batcher = _BATCHERS.get(id(producer))
        if batcher is None or batcher.producer is not producer or batcher._closed is not None:
            batcher = cls(producer)
            _BATCHERS[id(producer)] = batcher
        return batcher

    def append(
        self, topic: str, partition: int, key: bytes | None, value: bytes | None, owner: DeliveryCallback, token: int
    ) -> Batch | None:
        """Add a record to its partition's open batch; None when that batch is full (`await room(...)`, retry).

        The batch is handed to the producer by a task that runs after the caller yields, so records
        appended in one go share batches. Raises MessageSizeTooLargeError at once, like `send()`.
        """
        if self._closed is not None:
            raise ProducerClosed(str(self._closed))
        if len(key or b"") + len(value or b"") + _SIZE_SLACK > self.max_request_size:
            size = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, [])
            if size > self.max_request_size:
                raise MessageSizeTooLargeError(
                    f"The message is {size} bytes when serialized which is larger than the maximum request size "
                    "you have configured with the max_request_size configuration"
                )
        state = self._partitions.get((topic, partition))
        if state is None:
            state = self._partitions[(topic, partition)] = _Partition(topic, partition)
        batch = state.open
        if batch is None:
            batch = state.open = Batch(self.producer.create_batch(), self._loop)
        if state.task is None:
            state.task = self._loop.create_task(self._hand_over(state))
        if batch.full or batch.records.append(batch.count, None, key, value, _NO_HEADERS) is None:
            batch.full = True  # the task takes it next
            return None
        batch.count += 1
        batch.owners.append(owner)
        batch.tokens.append(token)
        return batch

    async def append_when_room(
        self, topic: str, partition: int, key: bytes | None, value: bytes | None, owner: DeliveryCallback, token: int
    ) -> Batch:
        """`append`, waiting for room while the partition's batch is full (as aiokafka's `send()` waits)."""
        while (batch := self.append(topic, partition, key, value, owner, token)) is None:
            await self.room(topic, partition)
        return batch

    async def handed_over(self) -> None:
        """Wait until every record appended so far is in the producer's accumulator, so its flush() covers it (and
        records being sent again alone, and what owners `track`, are done)."""
        tasks = [state.task for state in self._partitions.values() if state.task is not None]
        tasks += self._pending
        if tasks:
            await asyncio.gather(*(asyncio.shield(task) for task in tasks), return_exceptions=True)

    @property
    def settling(self) -> bool:
        """Records are being sent again alone, or an owner's follow-up (a dead letter) is under way."""
        return bool(self._pending)

    def track(self, work: asyncio.Future[Any]) -> None:
        """Make `handed_over` (so the producer's flush, so an offset commit) wait for `work`, e.g. a dead letter an
        owner sends for a RecordRefusedError."""
        self._pending.add(work)
        work.add_done_callback(self._pending.discard)

    async def room(self, topic: str, partition: int) -> None:
        """Wait until the partition's full batch is taken by the producer (then `append` has room again)."""
        state = self._partitions[(topic, partition)]
        if state.open is None or not state.open.full or self._closed is not None:
            return
        if state.room is None:
            state.room = self._loop.create_future()
        await asyncio.shield(state.room)  # a cancelled caller must not cancel the others' wait

    async def _hand_over(self, state: _Partition) -> None:
        """Hand the partition's batches to the producer one at a time, so their order is the append order."""
        try:
            while (batch := state.open) is not None:
                state.open = None
                self._wake(state)
                await self._submit(state, batch)
        finally:
            state.task = None
            self._wake(state)

    @staticmethod
    def _wake(state: _Partition) -> None:
        if state.room is not None:
            if not state.room.done():
                state.room.set_result(None)
            state.room = None

    async def _submit(self, state: _Partition, batch: Batch) -> None:
        try:
            builder = batch.builder
            builder._relative_offset = batch.count  # what BatchBuilder.append would have counted (record_count())
            if batch.full:
                builder.close()  # as BatchBuilder.append closes a full one: the producer sends it without lingering
            # waits while the partition's previous batch is still in the producer's queue (aiokafka's add_batch)
            delivery = await self.producer.send_batch(builder, state.topic, partition=state.partition)
        except asyncio.CancelledError:
            batch.finish(ProducerClosed("the stream stopped before this batch reached the producer"))
            raise
        except Exception as exc:
            self._finished(state, batch, exc)
            return
        delivery.add_done_callback(lambda future: self._finished(state, batch, _error(future)))

    def _finished(self, state: _Partition, batch: Batch, error: BaseException | None) -> None:
        self._give_back_sequence(state, batch.builder, error)
        if error is not None and self.isolate_refused and refused_for_records(error) and self._closed is None:
            self.track(self._loop.create_task(self._one_at_a_time(state, batch, error)))
            return
        if error is not None and self.failed is None:
            self.failed = error
        batch.finish(error)

    async def _one_at_a_time(self, state: _Partition, batch: Batch, error: BaseException) -> None:
        """Send the records of a refused batch again, each alone: only those the broker refuses alone fail (each
        owner hears RecordRefusedError); the others are delivered. Their order after the batches that followed
        this one is lost: only a batch the broker refused gets here."""
        try:
            buffer = getattr(batch.builder, "_buffer", None)  # the bytes that were sent (BatchBuilder keeps them)
            records = [(r.key, r.value) for r in MemoryRecords(bytes(buffer)).next_batch()] if buffer else []
        except Exception:  # unreadable: the batch fails as a whole, as it would without isolation
            records = []
        if len(records) != len(batch.owners):
            self.failed = self.failed or error
            batch.finish(error)
            return
        for (key, value), owner, token in zip(records, batch.owners, batch.tokens, strict=True):
            outcome: BaseException | None = error
            if len(records) > 1:  # a batch of one was refused already: no need to ask again
                try:
                    single = self.producer.create_batch()
                    single.append(timestamp=None, key=key, value=value)
                    delivery = await self.producer.send_batch(single, state.topic, partition=state.partition)
                    # in a callback, as _finished: it runs before the producer takes the partition's next batch
                    delivery.add_done_callback(
                        lambda future, single=single: self._give_back_sequence(state, single, _error(future))
                    )
                    await delivery
                    outcome = None
                except Exception as exc:
                    outcome = exc
            if outcome is not None and refused_for_records(outcome):
                outcome = RecordRefusedError(state.topic, state.partition, key, value, outcome)
            elif outcome is not None and self.failed is None:
                self.failed = outcome
            owner(token, outcome)
        if not batch.done.done():
            batch.done.set_result(None)

    def _give_back_sequence(self, state: _Partition, builder: Any, error: BaseException | None) -> None:
        """Take back the sequence numbers an idempotent producer gave a batch the broker refused, so the partition's
        next batch carries the number the broker waits for. aiokafka advances a partition's number when it takes a
        batch to send (MessageAccumulator._pop_batch) and never takes it back: without this, one refused batch
        makes every later batch to its partition fail with OutOfOrderSequenceNumber (the worker's flush then raises,
        and the worker stops). https://github.com/aio-libs/aiokafka/issues/1017 reports that stuck state.

        Called from the delivery callback, before the producer's sender takes the partition's next batch (a
        partition has one batch in flight, and the sender runs again only after this callback). The numbers are
        given back only when no batch took numbers after the refused one."""
        manager = getattr(self.producer, "_txn_manager", None)
        if manager is None or not refused_for_records(error):
            return  # not idempotent (no sequence numbers), or the batch was not refused
        try:
            sent = MemoryRecords(bytes(builder._buffer)).next_batch()
        except Exception:  # the sent bytes are not readable: leave the numbers as the producer has them
            return
        if sent is None or sent.producer_id != manager.producer_id or sent.base_sequence < 0:
            return
        tp = TopicPartition(state.topic, state.partition)
        current = manager.sequence_number(tp)
        if (sent.base_sequence + sent.last_offset_delta + 1) % 2**32 == current % 2**32:
            manager.increment_sequence_number(tp, sent.base_sequence - current)

    def abort(self, error: KafkaError) -> None:
        """Fail every batch not yet handed over and stop the hand-over tasks (the producer is being stopped)."""
        self._closed = error
        for state in self._partitions.values():
            if state.task is not None:
                state.task.cancel()
            if state.open is not None:
                state.open.finish(error)
                state.open = None
            self._wake(state)
        if _BATCHERS.get(id(self.producer)) is self:
            del _BATCHERS[id(self.producer)]


def _error(future: asyncio.Future[Any]) -> BaseException | None:
    """The outcome of a delivery future, retrieved (so asyncio never logs it as unretrieved)."""
    if future.cancelled():
        return asyncio.CancelledError("delivery cancelled")
    return future.exception()
