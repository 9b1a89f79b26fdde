"""The `plans` processor: the plans scheduler (processors.plans.dag.PlanScheduler) run over the plan_events log.

Every plan, subgoal status and executor heartbeat is on one partition of plan_events (key 'plans'), so one worker
folds them all in log order and the decisions are a function of the log. Each decision goes to plan_decisions (key:
the plan's session); a release also goes to its resource class's work topic, `<prefix>.work.<class>`, made on demand
with the deployment's partitions and replication. A plan the scheduler refuses (a cycle, an unknown dependency, a
bad policy, a resource class that cannot name a topic) is a dead letter at stage VALIDATE with the reason: the input
is wrong, not the worker, so it is filed with the other invalid inputs rather than as a processor failure (PROCESS).

Time is event time from the log: heartbeats, statuses and plans move the scheduler's clock. Nothing times out on a
log that stays silent (no live executor heartbeats), since a tick from the wall clock would make decisions depend on
when the worker ran; executors heartbeat every few seconds, so a live deployment's clock keeps moving.

Deadlines run from delivery. Right after sending a release the processor appends a ReleaseDelivered marker (the
send time) to plan_events, and the scheduler (delivery_markers=True) starts the attempt's deadline when it folds the
marker. A worker back from an outage releases what its backlog makes ready at that backlog's older event time; the
heartbeats further on in the backlog would time such an attempt out before it even went out, but its marker lands
after them. After a recovery, a release re-made whose marker a dead worker did not write gets it (once).

Crash safety. The fold lives in memory. When a worker first sees the partition, or sees it again past a gap (kill
-9, restart, rebalance), it folds the log from the start (or from where it stopped) up to the first record it is
handed, sending nothing (processors.plans.recovery), then goes on live. Decisions a dead worker made after its last
commit are made again identically; the decision ids already on plan_decisions and on the work topics since that
record was written are read back first and not sent again, so an attempt is released once. Memory: the scheduler
forgets finished plans and long-gone executors itself, at points of event time, so a replay forgets the same.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import faust

from processors.plans import recovery
from processors.plans.dag import Decision, PlanRefused, PlanScheduler
from streams.runtime.processor import InputEvent, ProcessingContext
from streams.sdk.batching import default_partition
from topics.admin import ensure_topics
from topics.catalog import TopicCatalog, work_topic_spec
from topics.codec import AvroCodec, DeadLetterStage
from topics.intake import Accepted, Intake, SourceMessage
from topics.names import (
    DEAD_LETTER,
    PLAN_EVENTS_KEY,
    PLAN_INPUT_SCHEMAS,
    PLAN_SUBMITTED,
    RELEASE_DELIVERED,
    SUBGOAL_RELEASED,
)
from topics.settings import Settings
from topics.tool_schemas import ToolSchemas
from topics.validation import InputValidator

log = logging.getLogger(__name__)

_TOPIC_CHARS = re.compile(r"[A-Za-z0-9._-]+")
_MAX_TOPIC_NAME = 249  # Kafka's limit


@dataclass
class PartitionFold:
    """The scheduler of one plan_events partition and where it is in the log."""

    scheduler: PlanScheduler
    next_offset: int  # the next input offset to fold
    # After a recovery: decision ids already on each output topic (not sent again), until the log passes `sent_until`
    sent: dict[str, set[str]] | None = None
    sent_until: int = 0
    marked: set[str] | None = None  # after a recovery: releases whose ReleaseDelivered marker is on the log already
    skipped: int = 0  # re-made decisions found on the broker already since the last recovery

    def already_sent(self, topic: str, decision_id: str) -> bool:
        found = self.sent is not None and decision_id in self.sent.get(topic, ())
        self.skipped += found
        return found


def work_topic_problem(plan: dict[str, Any], prefix: str) -> str | None:
    """Why a subgoal's resource class (or its fallback's) cannot name a work topic, or None."""
    for spec in plan["subgoals"]:
        for work in (spec, spec.get("fallback")):
            if work is None:
                continue
            cls = work.get("resource_class", "cpu")
            if not _TOPIC_CHARS.fullmatch(cls) or len(f"{prefix}.{cls}") > _MAX_TOPIC_NAME:
                return (
                    f"subgoal {spec.get('subgoal_id')!r}: resource_class {cls!r} cannot name a work topic "
                    f"({prefix}.<class>: ASCII letters, digits, '.', '_' and '-', at most {_MAX_TOPIC_NAME} in all)"
                )
    return None


def fold_input(scheduler: PlanScheduler, schema_name: str, record: dict[str, Any]) -> list[Decision]:
    """One input through the scheduler as the processor folds it, live and in a recovery alike: a plan whose resource
    classes cannot name work topics is refused too. PlanRefused for a refusal."""
    if schema_name == PLAN_SUBMITTED:
        problem = work_topic_problem(record, scheduler.work_topic_prefix)
        if problem is not None:
            raise PlanRefused(record["plan_id"], problem)
    return scheduler.apply(schema_name, record)


class PlansProcessor:
    """Plans as events: release subgoals to executors by capacity, retry, reroute, time out and escalate."""

    name = "plans"
    kind = "core"
    inputs = frozenset(PLAN_INPUT_SCHEMAS)

    def __init__(self) -> None:
        self.settings: Settings | None = None
        self.catalog: TopicCatalog | None = None
        self.work_topic_prefix = ""
        self.folds: dict[int, PartitionFold] = {}
        self._work_partitions: dict[str, int] = {}  # work topics known to exist -> their partition count
        self._intake: Intake | None = None

    def setup(self, app: faust.App, settings: Settings) -> None:
        self.settings = settings
        self.catalog = TopicCatalog(settings)
        self.work_topic_prefix = work_topic_spec(settings, "").name.rstrip(".")  # `<prefix>.work`
        # The recovery reads the log as the worker's intake does, so it folds exactly the records the intake took.
        self._intake = Intake(
            AvroCodec(), self.catalog, InputValidator(ToolSchemas.load(settings.tool_schemas)),
            max_event_bytes=settings.max_event_bytes,
        )  # fmt: skip

    async def process(self, events: list[InputEvent], ctx: ProcessingContext) -> None:
        for event in events:
            try:
                await self._process_one(event, ctx)
            except BaseException:
                # A recovery or a send failed part-way: the fold may be ahead of what was sent. Drop it, so the next
                # record (the worker's retry of this batch, one event at a time, or a restart) recovers afresh.
                self.folds.pop(event.source.partition, None)
                raise

    async def _process_one(self, event: InputEvent, ctx: ProcessingContext) -> None:
        source = event.source
        fold = self.folds.get(source.partition)
        if fold is None or source.offset > fold.next_offset:
            fold = await self._recover(source, fold, ctx)
        if source.offset < fold.next_offset:
            return  # folded here already (handed out again after a rebalance)
        fold.next_offset = source.offset + 1
        try:
            decisions = fold_input(fold.scheduler, event.schema_name, event.record)
        except PlanRefused as exc:
            await self._refuse(event, exc, ctx)
            return
        except Exception as exc:  # a fault in the fold: this input is a dead letter (PROCESS), the log goes on
            await ctx.failed(self.name, event, exc)
            return
        for decision in decisions:
            await self._emit(fold, decision, ctx)
        if fold.sent is not None and fold.next_offset >= fold.sent_until:
            fold.sent = fold.marked = None  # past what a dead worker could have decided: every decision is new
            log.info("plans scheduler of %s[%d] caught up with the log as of its recovery: %d records of decisions "
                     "made again were on the broker already and were not sent again", source.topic, source.partition,
                     fold.skipped)  # fmt: skip

    async def _emit(self, fold: PartitionFold, decision: Decision, ctx: ProcessingContext) -> None:
        assert self.catalog is not None
        record, key = decision.record, decision.key.encode()
        if decision.schema == SUBGOAL_RELEASED:
            topic = record["work_topic"]
            partitions = self._work_partitions.get(topic) or await self._work_topic(record["resource_class"])
            if not fold.already_sent(topic, record["decision_id"]):
                value = ctx.codec.encode(SUBGOAL_RELEASED, record)
                await ctx.send(topic, key, value, default_partition(key, partitions))
            if fold.marked is None or record["decision_id"] not in fold.marked:
                await self._mark_delivered(record, ctx)
        if not fold.already_sent(self.catalog["plan_decisions"].name, record["decision_id"]):
            await ctx.publish(decision.schema, record, key=key)

    @staticmethod
    async def _mark_delivered(release: dict[str, Any], ctx: ProcessingContext) -> None:
        """Append the release's ReleaseDelivered marker to plan_events: the attempt's deadline starts when it folds,
        at the time the work went out, not at the release's event time (older while a backlog is caught up on)."""
        marker = {name: release[name] for name in ("decision_id", "session_id", "plan_id", "subgoal_id", "attempt")}
        marker["sent_at"] = time.time_ns() // 1000  # after the work's send: never before the work record's timestamp
        await ctx.publish(RELEASE_DELIVERED, marker, key=PLAN_EVENTS_KEY.encode())

    async def _work_topic(self, resource_class: str) -> int:
        """The partition count of the class's work topic, made if missing (then cached by name)."""
        assert self.settings is not None
        spec = work_topic_spec(self.settings, resource_class)
        (state,) = await ensure_topics([spec], self.settings.kafka_bootstrap_servers)
        partitions = self._work_partitions[spec.name] = state.partitions
        if state.created:
            log.info("made work topic %s (%d partitions) for resource class %r", spec.name, partitions,
                     resource_class)  # fmt: skip
        return partitions

    async def _refuse(self, event: InputEvent, exc: PlanRefused, ctx: ProcessingContext) -> None:
        reason = f"plan refused by the plans scheduler: {exc.reason}"
        log.warning("dead letter from %s[%d]@%d: %s", event.source.topic, event.source.partition,
                    event.source.offset, reason)  # fmt: skip
        letter = event.source.dead_letter(DeadLetterStage.VALIDATE, reason, event.schema_name, event.record)
        await ctx.publish(DEAD_LETTER, letter, key=event.source.key)
        ctx.metrics.dead_letters.labels(DeadLetterStage.VALIDATE.value, event.schema_name).inc()

    async def _recover(
        self, source: SourceMessage, fold: PartitionFold | None, ctx: ProcessingContext
    ) -> PartitionFold:
        """Fold the log up to `source` without sending anything, and read back the decisions already sent."""
        assert self.catalog is not None and self.settings is not None and self._intake is not None
        started = time.monotonic()
        servers = self.settings.kafka_bootstrap_servers
        self.folds.pop(source.partition, None)  # back only once whole (a failure part-way leaves none)
        if fold is None:
            fold = PartitionFold(scheduler_for(self.settings, self.work_topic_prefix), next_offset=0)
        first, folded = fold.next_offset, 0
        async for message in recovery.read_partition(servers, source.topic, source.partition, first, source.offset):
            read = self._intake.read(SourceMessage.of(message, timestamp_ms=message.timestamp))
            if isinstance(read, Accepted) and read.schema_name in self.inputs:
                try:
                    fold_input(fold.scheduler, read.schema_name, read.record)
                except Exception:  # refused or failed when it was live too: a dead letter already
                    pass
                folded += 1
        fold.next_offset, fold.skipped = source.offset, 0
        work = [t for t in await recovery.topic_names(servers) if t.startswith(f"{self.work_topic_prefix}.")]
        outputs = [self.catalog["plan_decisions"].name, *work]
        fold.sent = await recovery.sent_decision_ids(servers, outputs, source.timestamp_ms, ctx.codec)
        fold.sent_until = await recovery.end_offset(servers, source.topic, source.partition)
        # a release re-made below whose marker a dead worker did not write gets it now (once); one with it, not again
        fold.marked = await recovery.marked_releases(
            servers, source.topic, source.partition, source.offset, fold.sent_until, ctx.codec
        )
        log.info("plans scheduler of %s[%d]: folded %d input records (offsets %d..%d) in %.1f s; %d decisions already "
                 "sent since the first record to redo are not sent again (%d releases marked delivered already)",
                 source.topic, source.partition, folded, first, source.offset - 1, time.monotonic() - started,
                 sum(len(ids) for ids in fold.sent.values()), len(fold.marked))  # fmt: skip
        self.folds[source.partition] = fold
        return fold


def scheduler_for(settings: Settings, work_topic_prefix: str) -> PlanScheduler:
    """The deployment's scheduler: deadlines from delivery markers, memory limits and aging from settings."""
    return PlanScheduler(
        work_topic_prefix=work_topic_prefix,
        aging_s=settings.plan_aging_s,
        finished_retention_s=settings.plan_finished_retention_s,
        finished_limit=settings.plan_finished_limit,
        executor_forget_s=settings.plan_executor_forget_s,
        delivery_markers=True,
    )
