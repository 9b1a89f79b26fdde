"""The step assembler as a Faust processor: StepState per logical_event_id in a RocksDB table.

Per batch, each touched step is read once, folded with all its events, and the rows the change can alter are
published once (a reward while the step still waits for a required source alters none: see publishes_all);
the fold is order-independent, so batching changes no result. Changed steps are written to the table
(RocksDB + changelog) before the next offset commit, once however many batches changed them
(streams/runtime/write_behind.py).

Event time: every input event advances its partition's watermark (processors/steps/watermarks.py). A step
still missing a required reward source waits in a per-partition timer queue until the watermark
passes its close time; orphan rewards (no dispatch) wait until their orphan deadline. Both queues
are checked after each batch, in the partitions it read (its input moved their watermarks), and by a
timer every TREADLE_WINDOW_TICK_S, so steps close even when no input arrives. The queues live in memory
and are rebuilt from the table when the worker starts.

Catching up (TREADLE_CATCH_UP_BACKLOG input records or more left in Kafka for the partition): a step still waiting
for a required source does not publish its pending row, which its rewards in the backlog would supersede moments
later; once caught up, the steps that still wait publish theirs. Final and late-rewards rows are never deferred.

Resuming after a silence (Watermarks.holding: every input topic holds the partition's watermark until it has
delivered): a dispatched step that changes publishes nothing until the hold ends, then its rows as they stand. The
events of the topics not read yet could change them, so the rows are the same whichever topic is fetched first. An
offset commit meanwhile publishes the held steps that wait for nothing first (a crash must not lose a final row).

Steps do not stay forever: once the watermark is TREADLE_STEP_RETENTION_S past a step's horizon (no reward can
be woven into it any more), the timer deletes its state (processors/steps/expiry.py), so the table, and with it
the worker's RocksDB memory and disk, are bounded by the steps of the last horizon + retention.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import faust

from processors.steps.assembler import STEP_INPUTS, StepAssembler, StepState, Weave, is_episode_reward
from processors.steps.expiry import StepExpiry
from processors.steps.policy import Imputation, PolicyBook, load_policy_file
from processors.steps.policy_topic import PolicyTopic
from processors.steps.recent_values import RecentValues
from processors.steps.source_watch import SourceWatch
from processors.steps.state_codec import StepStateCodec
from processors.steps.watermarks import Watermarks
from streams.runtime import table_writes
from streams.runtime.decoded_rows import DecodedRows
from streams.runtime.processor import InputEvent, ProcessingContext
from streams.runtime.write_behind import WriteBehind
from topics.catalog import TopicCatalog
from topics.names import DISPATCH, LATE_REWARD, REWARD
from topics.settings import Settings

log = logging.getLogger(__name__)

CLOSE = "close"
POLICY_REFRESH_S = 5.0
STEP_CACHE_SIZE = 10_000  # parsed step states kept between batches (~10 KB each as Python objects)
EXPIRE_PER_TICK = 20_000  # steps deleted per partition and tick at most, so one tick never stalls the input
UNWRITTEN_STEPS = 10_000  # changed steps held back before a write-out (else at the next offset commit)


@dataclass(slots=True)
class _Before:
    """What the late-rewards metric needs to know of a step before a batch or tick changed it."""

    orphans: tuple[str, ...]
    dispatched: bool
    folded: set[str] = field(default_factory=set)  # event ids folded since

    @classmethod
    def of(cls, state: StepState) -> _Before:
        return cls(tuple(state.orphans) if state.orphans else (), state.dispatch is not None)

    def newly_not_woven(self, late: dict[str, Any]) -> bool:
        """A late-rewards row counts once: an orphan when first reported; a reward after grace when folded, or when
        the dispatch that makes it late arrives (unless it was counted as an orphan already)."""
        event_id, reason = late["event_id"], late["reason"]
        if reason == "ORPHAN_RESOLVED" or event_id in self.orphans:
            return False
        return reason == "ORPHAN" or event_id in self.folded or not self.dispatched


@dataclass(slots=True)
class _Touched:
    state: StepState
    event: InputEvent  # any event of the step: all share its session's partition
    before: _Before
    changed: bool = False
    reshaped: bool = False  # a dispatch or tool result was folded, or a window passed
    repeated: bool = False  # an event was already folded: a replay, or a duplicate sent by the producer
    emitted: bool = False  # this process had published every row of the step before the batch
    new: bool = False  # the step was in neither the table nor memory: its expiry entry needs no look-up

    @property
    def republishes(self) -> bool:
        """A repeated event republishes the step's rows, unless this process published them itself: a record it
        failed to produce would have crashed it, and a restarted worker reads the step from the table again."""
        return self.repeated and not self.emitted


class StepTooLargeError(ValueError):
    """An event that would make its step's state too large to store and produce."""


def publishes_all(weave: Weave | None, folded: set[str], *, reshaped: bool, repeated: bool) -> bool:
    """Whether a change to a step publishes all its rows, or only its late-rewards rows.

    `folded`: the event ids the change folded in; `reshaped`: a dispatch or tool result among them, or a window
    passed; `repeated`: an event was already folded, and this process has not published the step's rows itself
    (_Touched.republishes). A reward folded while the step still waits for a required source changes only the
    pending Transition's revision and updated_at, and a reward after grace only adds its late-rewards row: neither
    is worth a Transition. The next visible change publishes the higher revision (the final rows always come:
    passing the last waiting window is a visible change). A repeated event republishes everything, in case a crash
    lost the first publication (it may replay an input whose offset was not committed).
    """
    if repeated or reshaped or weave is None:
        return True
    return not weave.waiting and any(event_id in folded for event_id, _, _ in weave.on_time)


class StepProcessor:
    name = "steps"
    kind = "core"
    inputs = frozenset(STEP_INPUTS)

    def __init__(self, assembler: StepAssembler | None = None) -> None:
        self.assembler = assembler or StepAssembler()
        self.table: Any = None  # faust.Table[bytes, bytes]
        self.watermarks = Watermarks(5.0, 30.0)
        self.ctx: ProcessingContext | None = None
        # partition -> heap of (due event time us, logical_event_id, CLOSE or the orphan reward's event_id)
        self._due: dict[int, list[tuple[int, str, str]]] = defaultdict(list)
        # partition -> logical_event_id -> due time of its live CLOSE entry; other CLOSE entries are stale
        self._waiting: dict[int, dict[str, int]] = defaultdict(dict)
        self._indexed_for: frozenset[Any] | None = None  # the assignment the timer queues were built for
        self._lock = asyncio.Lock()
        self._recent = RecentValues()  # for rolling-mean imputation
        self.policy_topic: PolicyTopic | None = None
        self._decoded: DecodedRows[StepState] = DecodedRows(STEP_CACHE_SIZE)
        self.expiry = StepExpiry()
        self._indexed: DecodedRows[int] = DecodedRows(STEP_CACHE_SIZE)  # key -> expiry time known to be indexed
        self._unwritten: WriteBehind[StepState] = WriteBehind(UNWRITTEN_STEPS)  # written out before commits
        self.catch_up_backlog = 0  # TREADLE_CATCH_UP_BACKLOG; 0: pending rows are never deferred
        self.credits_episodes = True  # whether the credit processor runs here (else episode rewards are not woven)
        self._warned_episode_reward = False
        # partition -> steps whose pending rows were deferred while catching up there (published once caught up)
        self._deferred: dict[int, set[bytes]] = defaultdict(set)
        # partition -> dispatched steps that changed while a resume held its watermark (published when it ends)
        # (with what the late-rewards metric needs to know of it before its first held-back change)
        self._resuming: dict[int, dict[bytes, _Before]] = defaultdict(dict)
        # steps with orphans reported by the batch or tick under way: published once their state is on the broker
        self._orphaned: list[tuple[StepState, bytes, ProcessingContext, _Before, Weave | None, bool]] = []
        self.states = StepStateCodec()  # the table's bytes; attach() gives it the worker's codec (and registry)
        self.max_step_bytes = Settings.model_fields["max_event_bytes"].default  # TREADLE_MAX_EVENT_BYTES
        self.source_watch = SourceWatch()  # required sources that went silent (warned: log + metric)

    def setup(self, app: faust.App, settings: Settings) -> None:
        self.table = table_writes.bytes_table(
            app, self.name, settings, help="StepState per logical_event_id (processors/steps/state_codec.py)."
        )
        self.expiry.setup(app, settings, self.name)
        self.catch_up_backlog = settings.catch_up_backlog
        self.max_step_bytes = settings.max_event_bytes
        self.credits_episodes = "credit" in settings.processors
        app.before_commit.append(self.write_out)  # type: ignore[attr-defined]  # a ResumingApp
        if settings.reward_policy is not None:
            self.assembler.policies = PolicyBook([load_policy_file(settings.reward_policy)])
        catalog = TopicCatalog(settings)
        topics = [spec.name for spec in catalog.inputs if spec.value_schema in self.inputs]
        self.watermarks = Watermarks(settings.watermark_lag_s, settings.idle_timeout_s, topics=topics)
        policies = catalog["reward_policies"].name
        self.policy_topic = PolicyTopic(settings.kafka_bootstrap_servers, policies)

        @app.task
        async def refresh_reward_policies() -> None:
            while True:
                await asyncio.sleep(POLICY_REFRESH_S)
                try:
                    await self.refresh_policies()
                except Exception as exc:  # keep weaving with the policies known so far
                    log.warning("could not refresh reward policies: %s", exc)

        @app.timer(settings.window_tick_s, name=f"{self.name}-windows")
        async def close_due_windows() -> None:
            if self.ctx is not None:
                await self.tick(self.ctx)

    def attach(self, ctx: ProcessingContext) -> None:
        self.ctx = ctx
        self.states = StepStateCodec(ctx.codec)

    async def write_out(self) -> None:
        """Write the changed steps to the table (RocksDB + changelog): before every offset commit, when a rebalance
        revokes partitions and when the worker stops (ResumingApp.before_commit). Rows a resume holds back that wait
        for nothing go out first: an input whose offset is committed must never leave a final row unpublished."""
        if self.ctx is not None:
            async with self._lock:
                await self._publish_resumed(self.ctx, final_only=True)
                await self._write_out(self.ctx)

    async def _write_out(self, ctx: ProcessingContext) -> None:
        active, dropped = set(self._active_partitions()), 0
        for unwritten in self._unwritten.take():
            if unwritten.partition not in active:
                dropped += 1  # revoked: its offsets are not committed here, the new owner replays its inputs
                continue
            value = self.states.encode(unwritten.value)
            await table_writes.put_in_partition(self.table, unwritten.key, value, unwritten.partition, ctx)
        if dropped:
            log.info("%d changed steps of partitions no longer assigned here were not written: their new owner "
                     "replays their inputs", dropped)  # fmt: skip

    async def refresh_policies(self) -> None:
        """Learn policy versions pushed with `treadle policy push` (the worker also does it at start)."""
        if self.policy_topic is not None:
            await self.policy_topic.refresh(self.assembler.policies)

    # --- batches -------------------------------------------------------------------------------------------------

    async def process(self, events: list[InputEvent], ctx: ProcessingContext) -> None:
        async with self._lock:
            await self._process(events, ctx)

    async def _process(self, events: list[InputEvent], ctx: ProcessingContext) -> None:
        touched: dict[bytes, _Touched] = {}
        newest: dict[tuple[int, str], int] = {}  # (partition, topic) -> newest event time in the batch
        joined_at = time.time()
        signalled: set[str] = set()  # reward sources heard in this batch, and whether steps arrived (SourceWatch)
        dispatched = False
        for event in events:
            env = event.record["envelope"]
            if event.schema_name == REWARD:
                signalled.add(event.record["source"])
            elif event.schema_name == DISPATCH:
                dispatched = True
            where = (event.source.partition, event.source.topic)
            if env["event_time"] > newest.get(where, -1):
                newest[where] = env["event_time"]
            if is_episode_reward(event.schema_name, event.record):
                self._episode_reward(event)  # credit assignment (processors/credit/processor.py) spreads it
                continue
            key = env["logical_event_id"].encode()
            entry = touched.get(key)
            try:
                if entry is None:
                    loaded = self._load(key, event.source.partition)
                    state = loaded or StepState(key.decode())
                    state.partition = event.source.partition
                    entry = touched[key] = _Touched(
                        state, event, _Before.of(state), emitted=state.emitted, new=loaded is None
                    )
                if (too_large := self._too_large(entry.state, event)) is not None:
                    await ctx.failed(self.name, event, too_large)
                    continue
                joined_before = _joined_rewards(entry.state)
                folded = self.assembler.fold(entry.state, event.schema_name, event.record, event.source.value)
                if folded:
                    entry.changed = True
                    entry.before.folded.add(env["event_id"])
                    if event.schema_name == REWARD:
                        self._remember(event.record)
                    else:
                        entry.reshaped = True
                    _observe_joins(entry.state, joined_before, joined_at, ctx)
                else:
                    entry.repeated = True
            except Exception as exc:  # corrupt state or a bug: dead-letter this event, keep the batch going
                await ctx.failed(self.name, event, exc)
        self.source_watch.saw(joined_at, signalled, dispatched)
        for (partition, topic), event_time in newest.items():
            self.watermarks.observe(partition, topic, event_time)
        catching_up: dict[int, bool] = {}
        for partition in {e.event.source.partition for e in touched.values()}:
            self.watermarks.advance(partition)
            catching_up[partition] = self._catching_up(partition, ctx)
        for key, entry in touched.items():
            state, partition = entry.state, entry.event.source.partition
            settled, weave = self._settle(state, ctx)
            if settled:
                entry.changed = entry.reshaped = True
            if entry.changed:
                self._changed(key, state, partition)
                await self._index_expiry(key, state, partition, ctx, new=entry.new)
            else:
                self._decoded.forget(key)  # a failed fold may have changed it without a write
            repeated = entry.republishes
            if not entry.changed and not repeated:
                continue  # only events this process folded and published already: its rows and timers stand
            if weave is None and state.dispatch is not None:
                weave = self.assembler.weave(state)  # once for both below
            self._schedule(state, weave)
            if self._held_back(key, partition, state, entry.before):
                continue
            everything = publishes_all(weave, entry.before.folded, reshaped=entry.reshaped, repeated=repeated)
            if everything and not repeated and self._defers(key, partition, state, weave, catching_up[partition]):
                everything = False  # its late-rewards rows only: a pending row waits until caught up
            await self._publish(state, entry.event.session_key, ctx, entry.before, weave, everything)
        await self._publish_orphaned(ctx)
        for partition, behind in catching_up.items():  # the windows the batch moved the watermark past close now
            await self._fire_due(partition, self.watermarks.watermark(partition), ctx, behind)

    def _too_large(self, state: StepState, event: InputEvent) -> StepTooLargeError | None:
        """Why the event must not join its step: the step's events together would pass TREADLE_MAX_EVENT_BYTES, so
        the step's table record (RocksDB and changelog: every event it holds) and its rows could not be produced."""
        raw = event.source.value
        if raw is None or event.record["envelope"]["event_id"] in state.raw:
            return None  # already held (a replay): folding it again adds nothing
        held = sum(map(len, state.raw.values()))
        if held + len(raw) <= self.max_step_bytes:
            return None
        return StepTooLargeError(
            f"step {state.logical_event_id} holds {held:,} bytes of events; this {len(raw):,}-byte event would take "
            f"it past the {self.max_step_bytes:,}-byte limit (TREADLE_MAX_EVENT_BYTES) of one step's table record"
        )

    def _episode_reward(self, event: InputEvent) -> None:
        """Say once if episode rewards arrive with no credit processor to spread them: they stay in raw_events."""
        if self.credits_episodes or self._warned_episode_reward:
            return
        self._warned_episode_reward = True
        log.warning("episode reward %s (scope=episode) is not woven into any step: the credit processor is not "
                    "running here, so it stays in raw_events only; add `credit` to TREADLE_PROCESSORS to spread "
                    "episode rewards over their episode's steps (this is said once)",
                    event.record["envelope"]["event_id"])  # fmt: skip

    def _changed(self, key: bytes, state: StepState, partition: int) -> None:
        """The step changed: written out before the next offset commit (streams/runtime/write_behind.py)."""
        state.emitted = False  # until _publish sends its rows
        self._unwritten.mark(key, partition, state)
        self._decoded.wrote(key, state, self._generation())

    # --- windows -------------------------------------------------------------------------------------------------

    async def tick(self, ctx: ProcessingContext) -> None:
        """Advance idle watermarks; close due steps and report due orphans, in every partition."""
        async with self._lock:
            app = self.table.app
            if not app.tables.actives_ready:
                return  # recovering: the table is not complete yet
            self._check_sources(ctx)
            assignment = frozenset(app.consumer.assignment())
            if assignment != self._indexed_for:
                await self._write_out(ctx)  # the index is rebuilt from the table
                self._rebuild_index()
                self._indexed_for = assignment
            open_steps = 0
            for partition in list(self._due):
                watermark = self.watermarks.advance(partition)
                lag = self.watermarks.lag_s(partition)
                if lag is not None:
                    ctx.metrics.watermark_lag.labels(str(partition)).set(lag)
                await self._fire_due(partition, watermark, ctx)
                open_steps += len(self._waiting[partition])
            ctx.metrics.open_steps.set(open_steps)
            for partition in self._active_partitions():
                self.watermarks.advance(partition)
                progress = self.watermarks.expiry_watermark(partition)  # not the idle advance: see watermarks.py
                if progress is not None:
                    await self._expire_due(partition, progress, ctx)

    def _check_sources(self, ctx: ProcessingContext) -> None:
        """Warn (log + treadle_required_source_silent) when a step has waited longer than its window for a source the
        active policy requires, which has sent nothing since: such steps stay pending until it does (SourceWatch)."""
        now = time.time()
        policy = self.assembler.policies.for_dispatch(int(now * 1_000_000))
        silent, recovered = self.source_watch.check(policy, now)
        for quiet in silent:
            ctx.metrics.required_source_silent.labels(quiet.source).set(1)
            heard = "" if quiet.ever_seen else " (nothing since this worker started)"
            log.warning("reward source %r is required by reward policy %r but has sent nothing for %.0f s%s, longer "
                        "than its window (%.0f s), while steps wait for it: they stay pending until it sends. Enable "
                        "the processor that emits it (TREADLE_PROCESSORS; `treadle processors` lists them), start "
                        "the job that sends it, or make it optional in the policy", quiet.source, policy.version,
                        quiet.silent_s, heard, quiet.window_s)  # fmt: skip
        for source in recovered:
            ctx.metrics.required_source_silent.labels(source).set(0)
            log.info("reward source %r is sending again (or no longer required)", source)

    async def _fire_due(
        self, partition: int, watermark: int | None, ctx: ProcessingContext, catching_up: bool | None = None
    ) -> None:
        """Close the partition's due steps and report its due orphans; `catching_up` if the caller knows it."""
        heap, waiting = self._due[partition], self._waiting[partition]
        due: set[str] = set()
        while heap and watermark is not None and heap[0][0] <= watermark:
            at, lid, what = heapq.heappop(heap)
            if what != CLOSE:
                due.add(lid)
            elif waiting.get(lid) == at:  # else stale: the step was rescheduled or no longer waits
                del waiting[lid]
                due.add(lid)
        if catching_up is None:
            catching_up = self._catching_up(partition, ctx)
        for lid in sorted(due):
            key = lid.encode()
            state = self._load(key, partition)
            if state is None:
                continue
            before = _Before.of(state)
            weave = None
            if self._settle(state, ctx)[0]:
                self._changed(key, state, partition)
                weave = self.assembler.weave(state) if state.dispatch is not None else None
                if not self._held_back(key, partition, state, before):
                    everything = not self._defers(key, partition, state, weave, catching_up)
                    await self._publish(state, state.session_key, ctx, before, weave, everything)
            self._schedule(state, weave)
        await self._publish_orphaned(ctx)
        if self._unwritten.full():
            await self._write_out(ctx)
        if self._resuming.get(partition) and not self.watermarks.holding(partition):
            await self._publish_resumed(ctx, partition)
        if not catching_up:
            await self._publish_deferred(ctx, [partition])

    # --- catching up ---------------------------------------------------------------------------------------------

    def _catching_up(self, partition: int, ctx: ProcessingContext) -> bool:
        """Unknown counts as catching up: right after start, before a fetch reported every input topic's end."""
        if self.catch_up_backlog == 0:
            return False
        backlog = ctx.input_backlog(partition)
        return backlog is None or backlog >= self.catch_up_backlog

    def _defers(self, key: bytes, partition: int, state: StepState, weave: Weave | None, catching_up: bool) -> bool:
        """Whether a change that would publish all the step's rows defers them: while the worker catches up on the
        step's partition and a dispatched step still waits for a required source, its pending row would be
        superseded within moments (its rewards are in the backlog), so only its late-rewards rows go out now. In a
        catch-up this halves the Transitions a worker sends, and the sink inserts. Final rows are never deferred,
        nor are the rows of a step with no dispatch (its orphan reports)."""
        deferred = self._deferred[partition]
        if catching_up and state.dispatch is not None and weave is not None and weave.waiting:
            deferred.add(key)
            return True
        deferred.discard(key)  # its rows go out now
        return False

    def _held_back(self, key: bytes, partition: int, state: StepState, before: _Before) -> bool:
        """Whether a changed step keeps its rows until the resume that holds its partition's watermark ends (see the
        module docstring); a step with no dispatch has only orphan reports, which the held watermark cannot make."""
        held = self._resuming[partition]
        if state.dispatch is None or not self.watermarks.holding(partition):
            earlier = held.pop(key, None)
            if earlier is not None:  # held back before: it publishes now, as of before its first held-back change
                before.orphans, before.dispatched = earlier.orphans, earlier.dispatched
                before.folded |= earlier.folded
            return False
        if key in held:
            held[key].folded |= before.folded
        else:
            held[key] = before
        self._deferred[partition].discard(key)
        return True

    async def _publish_resumed(
        self, ctx: ProcessingContext, partition: int | None = None, final_only: bool = False
    ) -> None:
        """The resume's hold on `partition` ended: every step held back there publishes its rows as they stand now.
        `final_only` (before an offset commit, every partition): only the steps that wait for nothing, which no later
        change is bound to republish; the others stay held (like a pending row deferred while catching up)."""
        active = set(self._active_partitions())
        for held_partition in [partition] if partition is not None else list(self._resuming):
            held = self._resuming.get(held_partition)
            if not held:
                continue
            for key, before in sorted(held.items()):
                state = self._load(key, held_partition)
                weave = self.assembler.weave(state) if state is not None and state.dispatch is not None else None
                if final_only and weave is not None and weave.waiting:
                    continue
                del held[key]
                if weave is not None and held_partition in active:  # revoked: its new owner replays its inputs
                    await self._publish(state, state.session_key, ctx, before, weave)  # type: ignore[union-attr]

    async def _publish_deferred(self, ctx: ProcessingContext, partitions: list[int]) -> None:
        """Caught up: publish the pending rows deferred in `partitions` of steps that still wait (the others have
        published their rows since)."""
        if not any(self._deferred.get(partition) for partition in partitions):
            return
        active = set(self._active_partitions())
        for partition in partitions:
            keys = self._deferred.pop(partition, None)
            if not keys or partition not in active:
                continue  # revoked: its new owner publishes the step's rows when they change
            for key in sorted(keys):
                state = self._load(key, partition)
                if state is None or state.dispatch is None:
                    continue  # expired since
                weave = self.assembler.weave(state)
                if weave.waiting:
                    await self._publish(state, state.session_key, ctx, _Before.of(state), weave)

    # --- expiry --------------------------------------------------------------------------------------------------

    async def _index_expiry(
        self, key: bytes, state: StepState, partition: int, ctx: ProcessingContext, new: bool = False
    ) -> None:
        """Make sure the step has its expiry entry: looked up once per generation, not only for new steps (after a
        crash the local table may hold a step whose entry never reached the changelog). A `new` step (not in the
        table) writes its entry without the look-up: writing one again is harmless (processors/steps/expiry.py)."""
        expires = self.expiry.expires_us(self.assembler.horizon_us(state))
        if self._indexed.get(key, self._generation()) == expires:
            return
        if new or not self.expiry.is_indexed(expires, state.logical_event_id, partition):
            await self.expiry.index(expires, state.logical_event_id, partition, ctx)
        self._indexed.wrote(key, expires, self._generation())

    async def _expire_due(self, partition: int, watermark: int, ctx: ProcessingContext) -> None:
        for due in self.expiry.due(partition, watermark, EXPIRE_PER_TICK):
            await self.expiry.unindex(due, partition, ctx)
            key = due.logical_event_id.encode()
            state = self._load(key, partition)
            if state is None:
                continue
            expires = self.expiry.expires_us(self.assembler.horizon_us(state))
            if expires > watermark:  # its horizon moved since the entry was written
                await self.expiry.index(expires, due.logical_event_id, partition, ctx)
                self._indexed.wrote(key, expires, self._generation())
                continue
            self._unwritten.discard(key)
            await table_writes.delete_in_partition(self.table, key, partition, ctx)
            self._decoded.forget(key)
            self._indexed.forget(key)
            ctx.metrics.expired_steps.inc()

    def _active_partitions(self) -> list[int]:
        topic = self.table.changelog_topic.get_topic_name()
        return sorted(tp.partition for tp in self.table.app.assignor.assigned_actives() if tp.topic == topic)

    def _load(self, key: bytes, partition: int) -> StepState | None:
        """The step's state, parsed once per generation; changed steps not written out yet come from memory."""
        state = self._unwritten.get(key) or self._decoded.get(key, self._generation())
        if state is None:
            stored = table_writes.get_in_partition(self.table, key, partition)
            state = self.states.decode(stored) if stored is not None else None
        return state

    def _generation(self) -> int:
        return self.table.app.consumer_generation_id

    def _settle(self, state: StepState, ctx: ProcessingContext) -> tuple[bool, Weave | None]:
        """Apply what the watermark implies now: close the window, report orphans. Whether the state changed, and
        its weave if one was made on the way and still holds (StepAssembler.settle_windows)."""
        watermark = self.watermarks.watermark(state.partition) if state.partition is not None else None
        if watermark is None:
            return False, None
        if state.dispatch is None:
            changed = False
            for event_id, reward in sorted(state.rewards.items()):
                if event_id not in state.orphans and self.assembler.orphan_deadline_us(reward) <= watermark:
                    self.assembler.orphan(state, event_id)
                    changed = True
            return changed, None
        return self.assembler.settle_windows(state, watermark, self._recent)

    def _schedule(self, state: StepState, weave: Weave | None = None) -> None:
        if state.partition is None:
            return
        heap = self._due[state.partition]
        if state.dispatch is None:
            for event_id, reward in state.rewards.items():
                if event_id not in state.orphans:
                    heapq.heappush(heap, (self.assembler.orphan_deadline_us(reward), state.logical_event_id, event_id))
            return
        lid, waiting = state.logical_event_id, self._waiting[state.partition]
        next_window = self.assembler.next_window_us(state, weave)
        if next_window is None:
            waiting.pop(lid, None)  # its heap entry, if any, is stale now
        elif waiting.get(lid) != next_window:
            waiting[lid] = next_window
            heapq.heappush(heap, (next_window, lid, CLOSE))

    def _rebuild_index(self) -> None:
        """After a (re)start or rebalance, find the steps still waiting for a watermark in the table."""
        self._due.clear()
        self._waiting.clear()
        count = 0
        for _, stored in self.table.data.items():
            state = self.states.decode(stored)
            self._schedule(state)
            count += 1
        waiting = sum(len(h) for h in self._due.values())
        log.info("step windows: %d steps in the table, %d waiting for the watermark", count, waiting)

    # --- output --------------------------------------------------------------------------------------------------

    async def _publish(
        self,
        state: StepState,
        key: bytes,
        ctx: ProcessingContext,
        before: _Before,
        weave: Weave | None = None,
        everything: bool = True,
    ) -> None:
        """The step's current rows, or only its late-rewards rows (see publishes_all); orphans included.
        Counts rewards newly not woven. A step that reports new orphans waits for _publish_orphaned."""
        if state.dispatch is None and any(event_id not in before.orphans for event_id in state.orphans):
            self._orphaned.append((state, key, ctx, before, weave, everything))
            return
        await self._send_rows(state, key, ctx, before, weave, everything)

    async def _send_rows(
        self,
        state: StepState,
        key: bytes,
        ctx: ProcessingContext,
        before: _Before,
        weave: Weave | None,
        everything: bool,
    ) -> None:
        if everything or weave is None:
            records = self.assembler.outputs(state, weave)
        else:
            records = self.assembler.late_rows(state, weave)
        if state.dispatch is None:
            records += [(LATE_REWARD, self.assembler.orphan(state, event_id)) for event_id in state.orphans]
        for schema_name, record in records:
            await ctx.publish(schema_name, record, key=key)
            if schema_name == LATE_REWARD and before.newly_not_woven(record):
                ctx.metrics.late_rewards.labels(record["source"]).inc()
        state.emitted = everything or weave is None

    async def _publish_orphaned(self, ctx: ProcessingContext) -> None:
        """Publish the steps holding new orphan reports once their state (the orphans marked) is on the broker.

        An orphan is reported when the watermark passes its deadline, and after a restart the watermark is rebuilt
        from the inputs replayed: if the dispatch is among them, the step is woven with no orphan report, and an
        ORPHAN row the dead worker had published would never be resolved (seen as stale ORPHAN late_rewards rows
        after a kill -9). With the state written through first, the restarted worker knows what it reported, and
        the dispatch resolves it (ORPHAN_RESOLVED). Orphans are rare, so one producer flush per batch or tick that
        has any costs little."""
        if not self._orphaned:
            return
        orphaned, self._orphaned = self._orphaned, []
        states = []
        for state, *_ in orphaned:
            assert state.partition is not None
            states.append((state.logical_event_id.encode(), self.states.encode(state), state.partition))
        await table_writes.put_acked(self.table, states, ctx)  # the orphans marked on the broker before reported
        for key, _, _ in states:
            self._unwritten.discard(key)
        for state, key, step_ctx, before, weave, everything in orphaned:
            await self._send_rows(state, key, step_ctx, before, weave, everything)

    def _remember(self, reward: dict[str, Any]) -> None:
        if not self.assembler.policies.imputes_rolling_means:
            return  # nothing reads them (the common case: skip the policy and spec look-ups for every reward)
        policy = self.assembler.policies.for_dispatch(reward["envelope"]["event_time"])
        spec = self.assembler.spec_for(policy, reward["source"], reward["name"])
        if spec.imputation is not Imputation.ROLLING_MEAN:
            return  # nothing reads it (a policy that starts imputing it later starts from its next values)
        self._recent.add(spec.key, float(reward["value"]), spec.rolling_count)


def _joined_rewards(state: StepState) -> int:
    """Rewards that have met their dispatch (a reward that came first joins when the dispatch does)."""
    return len(state.rewards) if state.dispatch is not None else 0


def _observe_joins(state: StepState, joined_before: int, now: float, ctx: ProcessingContext) -> None:
    newly_joined = _joined_rewards(state) - joined_before
    if newly_joined > 0:
        assert state.dispatch is not None
        waited = max(0.0, now - state.dispatch["envelope"]["event_time"] / 1e6)
        for _ in range(newly_joined):
            ctx.metrics.reward_join_latency.observe(waited)
