"""Faust's Kafka transport, mended where it lost input, and with batch delivery and batched outputs.

After recovering its tables, Faust positions every input partition with aiokafka's
`seek_to_committed()`, which seeks only where the committed offset is a positive number
(aiokafka/consumer/consumer.py: `if offset and offset > 0`). Meanwhile, during recovery, Faust's
`Consumer.getmany()` drops records fetched for partitions that are not active yet
(faust/transport/consumer.py; faust-streaming/faust#596 describes the same window). A partition
without a commit (a worker killed before its first commit, every 2.8 s) therefore kept the position
the fetcher had reached, and the records before it were never processed: a restart right after a
crash sat idle with a full input topic. Seen in this project's kill -9 test about one run in ten.

The fix is where the positioning happens: after aiokafka's seek, partitions it left alone seek to
their earliest offset, before any record of the new assignment is processed.

The same drop also happens after that seek: `getmany()` hands out a fetched record only if its partition
is in the consumer's set of active partitions *while it iterates*, and recovery changes that set in
between (seen in the state graph's kill -9 test, about one restart in fifteen: "input offsets ... were not
processed here", and Faust then commits past them). So records fetched and not handed out while the flow
stays active are fetched again: their partition seeks back to the first of them.

And one more: `_drain_messages()` races each record's delivery against a flow stop (`wait_first(callback(message),
suspend_flow.wait())`), cancels the loser, and marks the offset read either way. A record whose delivery lost
that race (a rebalance, e.g. when the group evicts the member a kill -9 left behind) was neither processed nor
fetched again: seen as "input offsets ...@140..140 were not processed here". Records of batch topics (the
worker's input, below) no longer take that path; for the others (e.g. standby changelogs) deliveries are shielded
from that cancellation, and each waits for the one before it, so they finish, in order.

And a drop the re-fetch above cannot see: a record dropped while a later record of its partition is handed out (a
drop in one getmany, the next record in the next). Input topics have no gaps, so a record handed out past a hole now
makes the partition read again from the hole first (ResumingConsumer._went_past_a_hole); before, the hole was passed,
and the session's events were folded out of order, which the state graph, recognising redeliveries by seq, turned
into a lost event (issue 25's crash-rebalance test, three workers and a kill -9). The topics agents read (the
contracts processor's StateVersions, the state processor's flush requests) have no gaps either and are read the same
way (ResumingConsumer._reads_whole): Faust acked their holes as gaps, which lost a step's contract check in CI.

Batches. Faust hands records to agents one at a time: a task pair per record to race the flow stop, a
conductor that builds an Event and queues it, a Stream that pops it and acks it. Measured at about 150 µs
per record, that alone capped a worker below 3,000 input events/s on one core. Topics registered with
`ResumingApp.deliver_in_batches` skip all of it: each fetched batch goes to one handler call, its records
tracked as in flight (so a rebalance waits for them, like for a stream's) and acked once the handler is done.
A batch is never cancelled half way: it finishes, then the rebalance goes on.

Commits. Faust's fetch loop commits every `broker_commit_every` acked records and waits for it: a producer flush and
an offset commit, two round trips. Here the loop starts that commit and goes on reading, as it does while Faust's
commit timer commits. So a commit takes its offsets before the app's before-commit hooks (the write-out of held-back
table values) run, not after: what is acked while a hook awaits waits for the next commit.
"""

from __future__ import annotations

import asyncio
import functools
import io
import logging
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import FrameType
from typing import Any

import faust
from aiokafka import TopicPartition
from faust.exceptions import ProducerSendError
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types.tuples import ack_lock
from mode.utils.futures import notify

from streams.runtime.input_alignment import (
    MAX_SKEW_S,
    InputAlignment,
    fetch_offsets,
    records_behind,
    records_left,
)
from streams.sdk.batching import DeliveryCallback, PartitionBatcher

log = logging.getLogger(__name__)

FETCH_MAX_WAIT_MS = 100  # longest a broker holds a fetch with nothing new (also the idle fetch period)
# A fetch returns once this much is there (or after FETCH_MAX_WAIT_MS). With 1 byte (aiokafka's default) a worker
# under a steady trickle fetched a few records per request, and the broker paid for every request on the core it
# shares with the sink (weaving bench, paced 5,000 events/s). Sparse input waits at most FETCH_MAX_WAIT_MS longer.
# The default of TREADLE_WORKER_FETCH_MIN_BYTES (ResumingApp.fetch_min_bytes).
FETCH_MIN_BYTES = 16_384
STALL_REPORT_S = 30.0  # a rebalance waiting this long for unacked input logs what every asyncio task awaits
HOLE_TRIES = 3  # an input partition is read again from a hole this many times before the hole is taken as real
STOP_WAIT_S = 15.0  # a stopping worker waits this long for a batch being folded, then stops without it (replayed)
BatchHandler = Callable[[list[Any]], Awaitable[None]]  # takes Faust ConsumerMessages, in fetch order


class ResumingConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        # Faust hard-codes fetch_max_wait_ms=1500. aiokafka sends one fetch per broker at a time, so a fetch
        # the broker holds for partitions with nothing new also holds back the partitions just drained:
        # measured as 0.5-1.5 s stalls with a full backlog. Set before start(), which builds the fetcher.
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS
        consumer._fetch_min_bytes = getattr(transport.app, "fetch_min_bytes", FETCH_MIN_BYTES)
        return consumer

    async def seek_to_committed(self) -> Mapping[Any, int]:
        committed = await super().seek_to_committed()
        skipped = [tp for tp, offset in committed.items() if offset is None or offset <= 0]
        if skipped:
            await self.call_thread(self._ensure_consumer().seek_to_beginning, *skipped)
        return committed


class ResumingConsumer(faust_aiokafka.Consumer):
    _fetched: dict[Any, tuple[int, int]]  # the batch getmany is handing out: tp -> (first, last offset)
    _alignment: InputAlignment | None = None  # of the batch topics, once the app has them
    _aligned_generation: int | None = None
    _background_commit: asyncio.Future[Any] | None = None  # the commit the fetch loop started, if any
    _commit_crash: asyncio.Future[Any] | None = None  # the crash a failed background commit started
    _next_input: dict[Any, int]  # partition read whole -> the offset its next record handed out must have
    _whole_topics: dict[str, bool]  # topic -> whether its holes are read again (_reads_whole)
    _fetching_s: float = 0.0  # seconds spent in fetches: InputAlignment's clock (why not wall time: its doc)
    _hole_tries: dict[Any, tuple[int, int]]  # partition read whole -> (offset read again from, times)
    _in_batch: dict[Any, int]  # input partition -> offset of its first record in the batch being read or folded
    _side_batches: dict[str, asyncio.Future[None]]  # topic read in batches of its own -> its batch being handled
    _side_crash: asyncio.Future[Any] | None = None  # the crash a failed handler of such a topic started

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._next_input = {}
        self._in_batch = {}
        self._side_batches = {}
        self._whole_topics = {}
        self._hole_tries = {}
        deliver = self.callback
        last: asyncio.Future[Any] | None = None

        async def deliver_fully(message: Any) -> Any:
            nonlocal last
            if last is not None and not last.done():
                await asyncio.shield(last)  # the record before this one finishes first
            last = asyncio.ensure_future(deliver(message))
            return await asyncio.shield(last)

        self.callback = deliver_fully

    async def wait_empty(self) -> None:
        """Faust's wait (a rebalance, a stop) until every input message handed out is acked; past STALL_REPORT_S
        it logs, once, the stack of every asyncio task, so a batch that never acks shows what it awaits. Faust's own
        report covers agents only, and this app folds its input outside agents."""
        report = asyncio.ensure_future(self._report_stall(STALL_REPORT_S))
        try:
            if not self.app.should_stop:
                await super().wait_empty()
                return
            # Stopping: a batch that never finishes must not hold the stop (SIGTERM was once ignored for 60 s). Its
            # offsets are not committed, so the next owner of its partitions folds it again.
            try:
                await asyncio.wait_for(super().wait_empty(), STOP_WAIT_S)
            except TimeoutError:
                log.warning("stopping without the %d input batches still being folded after %.0f s: their offsets "
                            "are not committed, so they are processed again after the restart",
                            len(self._unacked_messages), STOP_WAIT_S)  # fmt: skip
                self._unacked_messages.clear()
        finally:
            report.cancel()

    async def _report_stall(self, after_s: float) -> None:
        await asyncio.sleep(after_s)
        log.warning("waited %.0f s for %d handed-out input batches or messages to be acked (a rebalance or stop "
                    "cannot go on until they are); what every task awaits:\n%s",
                    after_s, len(self._unacked_messages), task_stacks())  # fmt: skip

    async def _drain_messages(self, fetcher: Any) -> None:
        """Faust's fetch loop, with records of batch topics handed over a batch at a time.

        A batch is what the fetches brought, read a getmany at a time (each picks the input partitions again,
        streams/runtime/input_alignment.py), topped up for up to the app's `batch_linger_s` while input trickles in
        (fewer, larger batches: fewer intermediate revisions to emit), never past `batch_max_records`, and never
        once the flow stops: a rebalance waits for the batch's acks.
        """
        app: ResumingApp = self.app  # type: ignore[assignment]
        try:
            while not (self.should_stop or fetcher.should_stop):
                batch: list[Any] = []
                revocations = app.revocations
                try:
                    await self._read_into(batch, 1.0)
                    deadline = time.monotonic() + app.batch_linger_s
                    while batch and len(batch) < app.batch_max_records and self.flow_active and not self.should_stop:
                        had = len(batch)
                        await self._read_into(batch, max(0.0, deadline - time.monotonic()))
                        if len(batch) == had and time.monotonic() >= deadline:
                            break  # nothing more fetched, and the linger is over
                    if batch:
                        await self._hand_over(app.batch_handler, batch, revocations)
                finally:
                    self._in_batch.clear()
                if self._commit_every is not None and self._n_acked >= self._commit_every:
                    self._commit_in_background()
                await asyncio.sleep(0)
        except self.consumer_stopped_errors:
            if not self.transport.app.should_stop:
                raise
            log.info("broker stopped the consumer while the worker stops")

    async def _hand_over(self, handle: BatchHandler | None, batch: list[Any], revocations: int) -> None:
        """`batch` to `handle` (acked once it returns) when no rebalance began since it was read, else read again."""
        if self._in_flight(batch, revocations):
            await self._deliver(handle, batch)
        else:
            await self._read_again(batch)

    def _in_flight(self, batch: list[Any], revocations: int) -> bool:
        """Whether `batch` may be handled (_may_deliver); if so it is in flight from here: a rebalance waits for its
        acks (its first record stands for it among Faust's unacked messages)."""
        if not self._may_deliver(revocations):
            return False
        self._unacked_messages.add(batch[0])
        return True

    def _may_deliver(self, revocations: int) -> bool:
        """Whether a batch read since the app's `revocations` count was this may be folded: no rebalance began.

        A batch becomes in flight (a rebalance waits for its acks) only here, once read, not when its first record
        is: a read waits on Faust's consumer thread, which a rebalance keeps busy until the in-flight input is
        acked, so a batch in flight while still being read stalled both for good ("waited 30 s for 31 handed-out
        input batches", issue 24). A batch read across a rebalance is read again instead (_read_again): nothing
        of it was acked. Checked and marked with no await in between, so a rebalance that begins later waits for
        the batch."""
        app: ResumingApp = self.app  # type: ignore[assignment]
        return self.flow_active and app.revocations == revocations

    async def _read_again(self, batch: list[Any]) -> None:
        """A batch read across a rebalance (not folded): each of its partitions still assigned reads again from its
        first record in the batch. The rebalance's own seek to the committed offsets is not enough: a read that
        began before it can end after it, and the batch then holds records read after that seek too."""
        first: dict[Any, int] = {}
        for message in batch:
            if first.get(message.tp, message.offset) >= message.offset:
                first[message.tp] = message.offset
        assigned = self.assignment()
        for tp, offset in first.items():
            if tp in assigned:
                await self.seek(tp, offset)
        where = ", ".join(f"{tp.topic}[{tp.partition}]@{offset}" for tp, offset in first.items())
        log.info("a rebalance began while %d input records were read into a batch: not folded here; they are read "
                 "again from %s", len(batch), where)  # fmt: skip

    async def _read_into(self, batch: list[Any], timeout: float) -> None:
        """One getmany: records of batch topics are tracked and added to `batch`; those of a topic read in batches of
        its own (ResumingApp.read_in_batches) go to its handler once the getmany ends; others as Faust delivers."""
        app: ResumingApp = self.app  # type: ignore[assignment]
        batch_topics, side_handlers, side = app.batch_topics, app.side_handlers, {}
        revocations = app.revocations
        read_offset = self._read_offset
        alignment = self._input_alignment()
        reads_whole = self._whole_topics
        holes: set[Any] = set()  # input partitions read again from a hole: the rest of this getmany is dropped
        async for tp, message in self.getmany(timeout=timeout):
            offset = message.offset
            if tp in holes:
                continue
            last = read_offset[tp]
            if last is not None and offset < last:
                continue  # read already (Faust drops these too)
            whole = reads_whole.get(tp.topic)
            if whole is None:
                whole = reads_whole[tp.topic] = self._reads_whole(tp.topic)
            if whole and await self._went_past_a_hole(tp, offset):
                holes.add(tp)
                continue
            if last and offset - last > 1 and self.app.topics.acks_enabled_for(message.topic):
                await self._add_gap(tp, last + 1, offset)  # compaction or transaction markers
            if whole:
                self._next_input[tp] = offset + 1
            if tp.topic in batch_topics:
                if app.on_first_input is not None:
                    app.on_first_input()
                    app.on_first_input = None
                batch.append(message)
                self._in_batch.setdefault(tp, offset)
                alignment.read(tp, message.timestamp)
            elif tp.topic in side_handlers:
                side.setdefault(tp.topic, []).append(message)
            else:
                await self.wait_first(self.callback(message), self.suspend_flow.wait())
            read_offset[tp] = offset
        for topic, records in side.items():
            await self._hand_over_side(topic, side_handlers[topic], records, revocations)

    async def _hand_over_side(self, topic: str, handle: BatchHandler, batch: list[Any], revocations: int) -> None:
        """A batch of a topic read in batches of its own, handled beside the fetch loop (which goes on reading and
        folding the inputs while the handler awaits its acks), one batch of each topic at a time, in order."""
        running = self._side_batches.get(topic)
        if running is not None and not running.cancelled():
            await asyncio.shield(running)  # the batch before this one finishes first; one that failed raises here
        if not self._in_flight(batch, revocations):
            await self._read_again(batch)
            return
        handled = self._side_batches[topic] = asyncio.ensure_future(self._deliver(handle, batch))
        handled.add_done_callback(functools.partial(self._on_side_done, topic, len(batch)))

    def _on_side_done(self, topic: str, size: int, done: asyncio.Future[None]) -> None:
        """A handler that raised stops the worker: its batch is not acked, and nothing after it on its partitions
        could be committed, so its records are handled again after the restart."""
        if done.cancelled() or done.exception() is None:
            return
        exc = done.exception()
        log.critical("the handler of %s failed on a batch of %d records, stopping (they are read again after the "
                     "restart): %r", topic, size, exc)  # fmt: skip
        self._side_crash = asyncio.ensure_future(self.crash(exc))  # type: ignore[arg-type]

    def _reads_whole(self, topic: str) -> bool:
        """Whether a hole in `topic`'s offsets read here is read again (_went_past_a_hole) rather than committed past.

        The batch topics, and every topic an agent (or ResumingApp.read_in_batches) reads with acks on (its offsets
        are committed) that is written without transactions and never compacted: treadle's own
        (ResumingApp.gapless_topics) and the app's internal ones. Their offsets are contiguous, so a hole is records
        a fetch dropped. Faust's own answer to a hole is to ack it as a gap, which for an agent's input (the contracts
        processor read the state processor's StateVersions with one then) lost the records in it: a step with no
        postcondition check after a rebalance and a kill -9 (seen once in CI). Table changelogs are compacted, so
        their holes are real; so are the commit markers of a topic written with transactions (another system's,
        read by a plugin's agent): those keep Faust's way."""
        app: ResumingApp = self.app  # type: ignore[assignment]
        if topic in app.batch_topics:
            return True
        if topic in app.tables.changelog_topics:
            return False
        readers = [t for t in app.topics if topic in t.topics]
        if not readers or not all(getattr(t, "acks", False) and not getattr(t, "compacting", None) for t in readers):
            return False
        return topic in app.gapless_topics or all(getattr(t, "internal", False) for t in readers)

    async def _went_past_a_hole(self, tp: Any, offset: int) -> bool:
        """Whether `offset` lies past records of `tp` (a partition read whole) that were never handed out; if so, `tp`
        is read again from the first of them.

        Input topics have no compaction and no transactions, so their offsets are contiguous, and a record handed out
        past a hole means the fetch dropped records (Faust's getmany drops those of a partition that is not active
        while it iterates, e.g. during a table recovery). Handing out the rest anyway folded a session's events out
        of order: the state graph recognises redeliveries by seq, so the dropped event, read again after the next
        rebalance, counted as a duplicate and was never applied (seen with three workers and a kill -9,
        `input offsets ...@12..12 were not processed here`). A hole that stays after HOLE_TRIES reads is taken as
        real (records deleted by retention) and passed."""
        expected = self._next_input.get(tp)
        if expected is None or offset <= expected:
            return False
        sought, tries = self._hole_tries.get(tp, (None, 0))
        tries = tries + 1 if sought == expected else 1
        if tries > HOLE_TRIES:
            log.warning("input offsets %s[%d]@%d..%d are gone (deleted by retention?); reading on from %d",
                        tp.topic, tp.partition, expected, offset - 1, offset)  # fmt: skip
            self._hole_tries.pop(tp, None)
            return False
        self._hole_tries[tp] = (expected, tries)
        log.warning("input offsets %s[%d]@%d..%d were not handed out before @%d; reading them again first",
                    tp.topic, tp.partition, expected, offset - 1, offset)  # fmt: skip
        await self.seek(tp, expected)
        return True

    async def seek(self, partition: Any, offset: int) -> None:
        await super().seek(partition, offset)
        self._next_input[partition] = offset  # the next record of an input partition must be this one

    async def perform_seek(self) -> None:
        """Faust's seek of every partition to its committed offset; input partitions expect that offset next."""
        await super().perform_seek()
        self._next_input = {tp: offset for tp, offset in self._read_offset.items() if offset is not None}

    async def _deliver(self, handle: BatchHandler | None, batch: list[Any]) -> None:
        if handle is None:
            raise RuntimeError("records of a batch topic arrived before ResumingApp.deliver_in_batches was called")

        async def fold_then_ack() -> None:
            try:
                await handle(batch)
            except BaseException:
                # Not acked (its offsets stay uncommitted, so it is redelivered), but no longer awaited: a stop or a
                # rebalance waiting for it would otherwise wait forever (`waited 30 s for 1 handed-out input batches`).
                self._unacked_messages.discard(batch[0])
                notify(self._waiting_for_ack)
                raise
            self._ack_all(batch)

        # Shielded: cancelling the fetch loop (a stop) must not leave a batch half folded.
        await asyncio.shield(fold_then_ack())

    def _ack_all(self, batch: list[Any]) -> None:
        """Faust's Consumer.ack for every record of a handled batch, with its lock taken, its topics looked up and
        its ack waiter woken once per batch, not per record (~2% of a worker's CPU). Only the batch's first record is
        among Faust's unacked messages (a weak set: adding and removing each record cost ~1% more)."""
        committed_offsets, acked_indexes, acked = self._committed_offset, self._acked_index, self._acked
        acks_enabled: dict[str, bool] = {}
        with ack_lock:
            for message in batch:
                if message.acked:
                    continue
                message.acked = True
                enabled = acks_enabled.get(message.topic)
                if enabled is None:
                    enabled = acks_enabled[message.topic] = self.app.topics.acks_enabled_for(message.topic)
                if not enabled:
                    continue
                tp, offset = message.tp, message.offset
                committed = committed_offsets[tp]
                if committed is not None and offset < committed:
                    continue  # committed already
                acked_index = acked_indexes[tp]
                if offset not in acked_index:
                    acked_index.add(offset)
                    acked[tp].append(offset)
                    self._n_acked += 1
            if batch:
                self._unacked_messages.discard(batch[0])
            notify(self._waiting_for_ack)

    def _commit_in_background(self) -> None:
        """Commit every `broker_commit_every` acked records without pausing the input: Faust awaits that commit in
        its fetch loop, and its producer flush and offset commit are round trips (0.03-0.55 s each, ~15% of a
        catch-up spent idle in the weaving bench). One commit at a time; the next is due after as many records."""
        if self._commit_fut is not None or (self._background_commit and not self._background_commit.done()):
            return  # one is under way: Faust's commit timer or the last one started here
        self._n_acked = 0
        self._background_commit = asyncio.ensure_future(self.commit())
        self._background_commit.add_done_callback(self._on_background_commit)

    def _on_background_commit(self, task: asyncio.Future[Any]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.critical("an offset commit failed, stopping so uncommitted input is redelivered: %r", exc)
        self._commit_crash = asyncio.ensure_future(self.crash(exc))  # type: ignore[arg-type]

    async def _commit_tps(self, tps: Any, start_new_transaction: bool) -> bool:
        """Faust's commit (flush the producer, then commit acked offsets), with the app's before-commit hooks first:
        held-back table writes reach the producer, so the flush covers them (streams/runtime/write_behind.py).

        The offsets are taken before the hooks run, not after as Faust would: a batch acked while a hook awaits
        (input goes on during a commit) may have changed values the hook has already written out, and its offsets
        must wait for the next commit."""
        app: ResumingApp = self.app  # type: ignore[assignment]
        offsets = self._filter_committable_offsets(tps)
        await app._before_commit()
        if not offsets:
            return False
        try:
            await self._handle_attached(offsets)  # Faust's attached messages (none here; kept for parity)
        except ProducerSendError as exc:
            await self.crash(exc)
            return False
        return await self._commit_offsets(offsets, start_new_transaction=start_new_transaction)

    def folded_to(self, tp: Any) -> int | None:
        """The offset below which every record of input partition `tp` is folded (read into a batch whose fold
        ended); None while unknown."""
        first = self._in_batch.get(tp)
        return first if first is not None else fetch_offsets(self.aiokafka_consumer, tp)[0]

    @property
    def aiokafka_consumer(self) -> Any:
        """aiokafka's consumer, run in Faust's consumer thread (positions, highwaters); None before it starts."""
        return getattr(getattr(self, "_thread", None), "_consumer", None)

    def _input_alignment(self) -> InputAlignment:
        app: ResumingApp = self.app  # type: ignore[assignment]
        if self._alignment is None or self._alignment.topics != app.batch_topics:
            self._alignment = InputAlignment(app.batch_topics, app.input_max_skew_s)
        return self._alignment

    async def _getmany(self, active_partitions: Any, timeout: float) -> Any:
        """Faust's fetch of the active partitions, less input partitions that read ahead of their co-partitioned
        inputs (InputAlignment)."""
        alignment = self._input_alignment()
        if self.app.consumer_generation_id != self._aligned_generation:
            alignment.reset()  # a new assignment: positions start over
            self._aligned_generation = self.app.consumer_generation_id
        if active_partitions:
            consumer = self.aiokafka_consumer
            active_partitions = alignment.readable(
                active_partitions, lambda tp: records_left(consumer, tp), self._fetching_s
            )
        started = time.monotonic()
        try:
            return await super()._getmany(active_partitions, timeout)
        finally:
            self._fetching_s += time.monotonic() - started

    def _new_consumer_thread(self) -> ResumingConsumerThread:
        return ResumingConsumerThread(self, loop=self.loop, beacon=self.beacon)

    async def _wait_next_records(self, timeout: float) -> Any:
        records, active = await super()._wait_next_records(timeout)
        self._fetched = {tp: (rs[0].offset, rs[-1].offset) for tp, rs in (records or {}).items() if rs}
        return records, active

    async def getmany(self, timeout: float) -> AsyncIterator[Any]:
        """Faust's getmany; then partitions with records it fetched but did not hand out seek back to them."""
        generation = self.app.consumer_generation_id
        self._fetched = {}
        handed: dict[Any, int] = {}
        async for tp, message in super().getmany(timeout):
            handed[tp] = message.offset + 1
            yield tp, message
        if not self.flow_active or self.app.consumer_generation_id != generation:
            return  # a rebalance: Faust seeks every partition to its committed offset itself
        assigned = self.assignment()
        for tp, (first, last) in self._fetched.items():
            resume = handed.get(tp, first)
            if resume <= last and tp in assigned:
                log.info("fetching %s[%d]@%d..%d again: Faust fetched them but did not hand them out",
                         tp.topic, tp.partition, resume, last)  # fmt: skip
                await self.seek(tp, resume)


def task_stacks() -> str:
    """The stack of every task of the running event loop (where each one awaits), as text: each coroutine down the
    chain of awaits. asyncio's own Task.print_stack shows only a task's outer coroutine, so a stall report of Faust's
    services showed `await task` and no more (issue 24's rebalance hang)."""
    out = io.StringIO()
    for task in sorted(asyncio.all_tasks(), key=lambda t: t.get_name()):
        out.write(f"--- {task.get_name()}: {task.get_coro()!r}\n")
        frames = awaited_frames(task.get_coro())
        if frames:
            out.writelines(traceback.StackSummary.extract((f, f.f_lineno) for f in frames).format())
        else:
            task.print_stack(file=out)
    return out.getvalue()


def awaited_frames(coro: Any) -> list[FrameType]:
    """The frames of `coro` and of each coroutine, generator or async generator it awaits in turn."""
    frames: list[FrameType] = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:
            break
        frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
    return frames


class StopTimeoutError(RuntimeError):
    """A stopping worker gave up waiting for work in progress; its input is not committed (so it is replayed)."""


class ProducerFlushError(RuntimeError):
    """An appended record was not acked: what it derived from must be processed again."""


class BatchingProducer(faust_aiokafka.Producer):
    """Faust's producer, plus `append`: records gathered into per-partition batches (streams/sdk/batching.py).

    aiokafka's `send()` cost about 24 µs per record, and a worker sends two or three records per input event
    (outputs and changelog writes): a third of its CPU. Appending to a batch costs a fraction of that, and
    the batches go through the same producer (acks, retries, idempotence). `flush()` hands the open
    batches over first, so Faust's flush before an offset commit still covers every record appended.
    """

    _batcher: PartitionBatcher | None = None

    def _settings_extra(self) -> Mapping[str, Any]:
        """acks=all and idempotence, as the SDK's producer: Faust sets them only for exactly-once, so a retried
        batch (a leader failover mid-request) could be written twice or out of order within its partition."""
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}

    async def append(
        self, topic: str, partition: int, key: bytes | None, value: bytes | None, owner: DeliveryCallback, token: int
    ) -> None:
        """Queue a record for `partition`; `owner(token, error)` hears its outcome (error None when acked)."""
        batcher = self._batcher
        if batcher is None:
            batcher = self._batcher = PartitionBatcher(self._ensure_producer())
            batcher.isolate_refused = True  # a record the broker refuses costs that record (Pipeline.on_delivered)
        if batcher.append(topic, partition, key, value, owner, token) is None:  # no coroutine while there is room
            await batcher.append_when_room(topic, partition, key, value, owner, token)

    async def flush(self) -> None:
        """Every record appended so far is acked, or this raises (so Faust does not commit input offsets). A batch
        the broker refused for its records is sent again a record at a time while this waits, and the dead letters
        for records refused alone are sent too (Pipeline.on_delivered): so the flush goes round until none is."""
        if self._batcher is not None:
            await self._batcher.handed_over()
        await super().flush()
        while self._batcher is not None and self._batcher.settling:
            await self._batcher.handed_over()
            await super().flush()
        if self._batcher is not None and self._batcher.failed is not None:
            raise ProducerFlushError(f"a record could not be produced: {self._batcher.failed!r}")

    def track(self, work: Any) -> None:
        """Make the next flush (so the next offset commit) wait for `work` (PartitionBatcher.track)."""
        if self._batcher is None:
            self._batcher = PartitionBatcher(self._ensure_producer())
            self._batcher.isolate_refused = True
        self._batcher.track(work)

    async def on_stop(self) -> None:
        if self._batcher is not None:
            await self._batcher.handed_over()
        await super().on_stop()


class ResumingTransport(faust_aiokafka.Transport):
    Consumer = ResumingConsumer
    Producer = BatchingProducer


class ResumingApp(faust.App):
    """faust.App whose consumers use ResumingTransport (the broker URLs must be kafka://)."""

    batch_topics: frozenset[str] = frozenset()
    # Topics written without transactions and never compacted (treadle's own: build_pipeline sets the catalog's), so
    # an agent reading one gets the batch topics' hole check (ResumingConsumer._reads_whole).
    gapless_topics: frozenset[str] = frozenset()
    batch_handler: BatchHandler | None = None
    side_handlers: dict[str, BatchHandler]  # topic -> its handler (read_in_batches)
    batch_max_records: int = 1000
    batch_linger_s: float = 0.0
    input_max_skew_s: float = MAX_SKEW_S  # how far (record time) an input partition may read ahead of the others
    fetch_min_bytes: int = FETCH_MIN_BYTES  # TREADLE_WORKER_FETCH_MIN_BYTES: a fetch returns once this much is there
    # Called once, when the first record of a batch topic is read (before it is decoded): a benchmark's clock starts
    # there, so the input a worker reads while it is still starting up (its sink, its web page) is timed too.
    on_first_input: Callable[[], None] | None = None
    # Run, in order, before every offset commit, when a rebalance revokes partitions and when the consumer stops:
    # held-back table writes (streams/runtime/write_behind.py) reach the tables while this worker still owns them.
    before_commit: list[Callable[[], Awaitable[None]]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.before_commit = []
        self.side_handlers = {}
        self._hooks_timed_out = False
        self.revocations = 0  # rebalances begun (each revokes every partition first): ResumingConsumer._may_deliver

    async def _on_partitions_revoked(self, revoked: Any) -> None:
        self.revocations += 1
        if not self.should_stop:
            await self._before_commit()
        await super()._on_partitions_revoked(revoked)

    async def _stop_consumer(self) -> None:
        try:
            await self._before_commit()
        except StopTimeoutError as exc:
            log.warning("%s", exc)
        await super()._stop_consumer()

    async def _before_commit(self) -> None:
        if not self.should_stop:
            for hook in self.before_commit:
                await hook()
            return
        # Stopping: a hook waits for a batch being folded (it holds its processor's lock); one that never finishes
        # must not hold the stop. Raising keeps the commit that called it from committing what was not written out.
        if self._hooks_timed_out:
            raise StopTimeoutError("the write-out of changed table values timed out while stopping; not committing")
        try:
            await asyncio.wait_for(self._run_hooks(), STOP_WAIT_S)
        except TimeoutError:
            self._hooks_timed_out = True
            raise StopTimeoutError(
                f"the write-out of changed table values did not finish within {STOP_WAIT_S:.0f} s of the stop; "
                "nothing more is committed, and what was not is processed again after the restart"
            ) from None

    async def _run_hooks(self) -> None:
        for hook in self.before_commit:
            await hook()

    def deliver_in_batches(
        self,
        topic: faust.TopicT,
        handler: BatchHandler,
        max_records: int = 1000,
        linger_s: float = 0.0,
        max_skew_s: float = MAX_SKEW_S,
    ) -> None:
        """Consume `topic` (one or more topic names) without an agent: `handler` gets the records in batches.

        A batch is what the fetches brought, read a getmany (at most broker_max_poll_records) at a time, topped up
        for up to `linger_s` while fewer than `max_records` (so it may pass `max_records` by one getmany). The
        topics' partitions are read in step by record time, `max_skew_s` apart at most (InputAlignment).
        """
        self.batch_topics = frozenset(topic.topics)
        self.batch_handler = handler
        self.batch_max_records = max_records
        self.batch_linger_s = linger_s
        self.input_max_skew_s = max_skew_s
        self.topics.add(topic)  # the conductor subscribes to it; its records never reach a channel

    def read_in_batches(self, topic: faust.TopicT, handler: BatchHandler) -> None:
        """Consume `topic` without an agent and apart from the inputs (no alignment with them): `handler` gets the
        records of each fetch (one getmany) as they came, and they are acked once it returns, as an agent's are
        after its loop body. An agent cost ~200 µs of the worker's CPU per record (Faust hands each one over through
        tasks of its own: `wait_first`, the conductor, the stream's queue), more than most handlers spend on it."""
        for name in topic.topics:
            self.side_handlers[name] = handler
        self.topics.add(topic)  # the conductor subscribes to it; its records never reach a channel

    def input_backlog(self, partition: int) -> int | None:
        """Records of the batch topics' `partition` still in Kafka past those handed out, as of the last fetch: how
        far behind this worker is there. None until a fetch has reported on each of them (right after start)."""
        consumer = self.consumer.aiokafka_consumer  # type: ignore[attr-defined]  # a ResumingConsumer
        total = 0
        for topic in self.batch_topics:
            behind = records_behind(consumer, TopicPartition(topic, partition))
            if behind is None:
                return None
            total += behind
        return total

    def _new_transport(self) -> ResumingTransport:
        return ResumingTransport(self.conf.broker_consumer, self)
