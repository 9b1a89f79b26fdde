"""Self-diagnosis as an evaluator: repeated failures, reward variance per action and stalls, as evaluation_metrics
rows, with advice the plans scheduler acts on.

Three metrics, each about an *action* (a tool or agent with its params; the `rule` column is `tool#params_hash`):
- `repeated_failure`: the failure (a FAILED subgoal status, or a tool result not OK) that brings the failures of its
  action within TREADLE_DIAGNOSIS_FAILURE_WINDOW_S of event time to TREADLE_DIAGNOSIS_FAILURE_THRESHOLD or more; value:
  that count. The first such failure of a burst also writes a `SchedulerAdvice` (SKIP_RETRIES) to plan_events, key
  "plans": the scheduler reads it like any plan event, so its decisions stay a function of that log.
- `reward_variance`: each reward (RewardSignal joined to its step's dispatch by logical_event_id) once the action has
  TREADLE_DIAGNOSIS_VARIANCE_MIN_SAMPLES rewards of that source and name; value: their sample variance.
- `stall`: a RUNNING subgoal attempt without a heartbeat or an end past its deadline_s, or a dispatched step without a
  tool result past its deadline (TREADLE_DIAGNOSIS_STEP_TIMEOUT_S without one); value: seconds since the last sign of
  life.

Why RewardSignal and not the woven rewards: the worker hands processors its input topics only, and a RewardSignal names
its step (logical_event_id), which lives in the same partition as the step's dispatch (both keyed by session), so the
join is one table read; the woven rewards are an output the worker does not read back.

State: one Faust table (RocksDB + changelog, co-partitioned with the inputs), JSON per key, written as each event is
folded, so a restarted worker goes on from the changelog: failure windows, variance accumulators, subgoal specs, the
steps' actions and the watches (what must show life by when). Plan events are all keyed "plans", so everything about
plans lives in that one partition; step events are keyed by session, so step failures and rewards are counted per
input partition (one partition per deployment makes them global). Time is event time, one clock per log and partition:
the largest event time of the plan events (heartbeats' sent_at included), and of the step events, seen there. Before
each event is folded, the watches its clock passed are reported stalled, so the rows do not depend on how the input
was batched. The detection logic is processors.plans.symptoms.
"""

from __future__ import annotations

import heapq
import json
import logging
from collections import defaultdict
from typing import Any

import faust

from processors.evaluation import metric_record
from processors.plans.symptoms import (
    MICROS,
    FailureWindow,
    RewardVariance,
    Watch,
    action_rule,
    params_hash,
    severity_of_failures,
    subgoal_action,
)
from streams.runtime import table_writes
from streams.runtime.processor import InputEvent, ProcessingContext
from topics.names import (
    DISPATCH,
    EVALUATION_METRIC,
    EXECUTOR_HEARTBEAT,
    PLAN_EVENTS_KEY,
    PLAN_SUBMITTED,
    REWARD,
    SCHEDULER_ADVICE,
    SUBGOAL_STATUS,
    TOOL_RESULT,
)
from topics.settings import Settings

log = logging.getLogger(__name__)

REPEATED_FAILURE = "repeated_failure"
REWARD_VARIANCE = "reward_variance"
STALL = "stall"
CLOCK = "clock/"  # clock/plan and clock/step: a partition's event time in each log
WATCH = "watch/"  # watch/plan/<attempt key> and watch/step/<logical_event_id>
PLAN, STEP = "plan", "step"  # the two logs: plan events (one key, "plans") and step events (keyed by session)


class PlanDiagnosis:
    """Flags repeated failures, reward variance and stalls per action; advises the plans scheduler to skip retries."""

    name = "plan_diagnosis"
    kind = "evaluator"
    inputs = frozenset({PLAN_SUBMITTED, SUBGOAL_STATUS, EXECUTOR_HEARTBEAT, DISPATCH, TOOL_RESULT, REWARD})

    def __init__(self) -> None:
        self.table: Any = None  # faust.Table[bytes, bytes]
        defaults = Settings.model_fields
        self.threshold: int = defaults["diagnosis_failure_threshold"].default
        self.window_us = round(defaults["diagnosis_failure_window_s"].default * MICROS)
        self.min_samples: int = defaults["diagnosis_variance_min_samples"].default
        self.variance_alert: float = defaults["diagnosis_variance_alert"].default
        self.step_timeout_us = round(defaults["diagnosis_step_timeout_s"].default * MICROS)
        # per (partition, PLAN or STEP): event time, the watches (by key) and a heap of (due, watch key)
        self._clock: dict[tuple[int, str], int] = {}
        self._watches: dict[tuple[int, str], dict[str, Watch]] = defaultdict(dict)
        self._due: dict[tuple[int, str], list[tuple[int, str]]] = defaultdict(list)
        self._indexed_for: frozenset[Any] | None = None

    def setup(self, app: faust.App, settings: Settings) -> None:
        self.table = table_writes.bytes_table(
            app, self.name, settings, help="Self-diagnosis: failure windows, reward variance, watches (JSON)."
        )
        self.threshold = settings.diagnosis_failure_threshold
        self.window_us = round(settings.diagnosis_failure_window_s * MICROS)
        self.min_samples = settings.diagnosis_variance_min_samples
        self.variance_alert = settings.diagnosis_variance_alert
        self.step_timeout_us = round(settings.diagnosis_step_timeout_s * MICROS)

    async def process(self, events: list[InputEvent], ctx: ProcessingContext) -> None:
        self._index_if_moved()
        moved: set[tuple[int, str]] = set()
        for event in events:
            where = (event.source.partition, PLAN if event.schema_name in _PLAN_INPUTS else STEP)
            try:
                if self._move_clock(where, _event_time(event)):
                    moved.add(where)
                await self._report_stalls(where, ctx)
                await self._fold(event, ctx)
            except Exception as exc:  # odd input: dead-letter the event, keep going
                await ctx.failed(self.name, event, exc)
        for partition, log_name in sorted(moved):
            value = b"%d" % self._clock[(partition, log_name)]
            await table_writes.put_in_partition(self.table, f"{CLOCK}{log_name}".encode(), value, partition, ctx)

    # -- the table ------------------------------------------------------------------------------------------------

    def _get(self, key: str, partition: int) -> dict[str, Any] | None:
        stored = table_writes.get_in_partition(self.table, key.encode(), partition)
        return json.loads(stored) if stored is not None else None

    async def _put(self, key: str, value: dict[str, Any], partition: int, ctx: ProcessingContext) -> None:
        data = json.dumps(value, separators=(",", ":")).encode()
        await table_writes.put_in_partition(self.table, key.encode(), data, partition, ctx)

    async def _delete(self, key: str, partition: int, ctx: ProcessingContext) -> None:
        await table_writes.delete_in_partition(self.table, key.encode(), partition, ctx)

    def _index_if_moved(self) -> None:
        """Rebuild the clocks and watches from the table when the assignment changed (a start, a rebalance)."""
        topic = self.table.changelog_topic.get_topic_name()
        assignment = frozenset(tp for tp in self.table.app.assignor.assigned_actives() if tp.topic == topic)
        if assignment == self._indexed_for:
            return
        self._clock.clear()
        self._watches.clear()
        self._due.clear()
        for tp in assignment:
            for log_name in (PLAN, STEP):
                clock = table_writes.get_in_partition(self.table, f"{CLOCK}{log_name}".encode(), tp.partition)
                self._clock[(tp.partition, log_name)] = int(clock) if clock is not None else 0
            for key in table_writes.keys_in_order(self.table, tp.partition):
                if key.startswith(WATCH.encode()):
                    value = table_writes.get_in_partition(self.table, key, tp.partition)
                    if value is not None:
                        self._index(tp.partition, key.decode(), Watch.from_json(json.loads(value)))
        self._indexed_for = assignment

    def _index(self, partition: int, key: str, watch: Watch) -> None:
        where = (partition, _log_of(key))
        self._watches[where][key] = watch
        heapq.heappush(self._due[where], (watch.due, key))

    # -- time and stalls ------------------------------------------------------------------------------------------

    def _move_clock(self, where: tuple[int, str], at: int) -> bool:
        if at > self._clock.get(where, 0):
            self._clock[where] = at
            return True
        return False

    async def _report_stalls(self, where: tuple[int, str], ctx: ProcessingContext) -> None:
        """Report every watch the clock of this partition's log passed, in due order (ties by key), and forget it."""
        now, heap, watches = self._clock.get(where, 0), self._due[where], self._watches[where]
        partition = where[0]
        while heap and heap[0][0] <= now:
            due, key = heapq.heappop(heap)
            watch = watches.get(key)
            if watch is None or watch.due != due:
                continue  # ended, or pushed back by a later sign of life
            del watches[key]
            await self._delete(key, partition, ctx)
            what = key.removeprefix(WATCH)
            silent_s = (now - watch.since) / MICROS
            evidence = f"{what}: no sign of life for {silent_s:.1f} s (due {(due - watch.since) / MICROS:.1f} s after)"
            rule = action_rule(watch.tool, watch.params_hash)
            metric = metric_record(self.name, STALL, rule, silent_s, "medium", {"envelope": watch.judged}, evidence)
            await ctx.publish(EVALUATION_METRIC, metric, key=watch.judged["session_id"].encode())

    async def _watch(self, key: str, watch: Watch, partition: int, ctx: ProcessingContext) -> None:
        known = self._watches[(partition, _log_of(key))].get(key)
        if known is not None and known.since >= watch.since:
            return  # an older or repeated sign of life
        self._index(partition, key, watch)
        await self._put(key, watch.to_json(), partition, ctx)

    async def _unwatch(self, key: str, partition: int, ctx: ProcessingContext) -> None:
        if self._watches[(partition, _log_of(key))].pop(key, None) is not None:
            await self._delete(key, partition, ctx)

    # -- folding --------------------------------------------------------------------------------------------------

    async def _fold(self, event: InputEvent, ctx: ProcessingContext) -> None:
        schema = event.schema_name
        if schema == PLAN_SUBMITTED:
            await self._plan(event, ctx)
        elif schema == SUBGOAL_STATUS:
            await self._status(event, ctx)
        elif schema == DISPATCH:
            await self._dispatch(event, ctx)
        elif schema == TOOL_RESULT:
            await self._tool_result(event, ctx)
        elif schema == REWARD:
            await self._reward(event, ctx)
        # an executor heartbeat only moves the clock

    async def _plan(self, event: InputEvent, ctx: ProcessingContext) -> None:
        record, partition = event.record, event.source.partition
        session = record["envelope"]["session_id"]
        for spec in record["subgoals"]:
            key = f"subgoal/{session}/{record['plan_id']}/{spec['subgoal_id']}"
            if self._get(key, partition) is None:  # a repeat (or a different plan the scheduler refuses) keeps it
                await self._put(key, {"spec": _work_spec(spec), "fallback_from": None, "ended": 0}, partition, ctx)

    async def _status(self, event: InputEvent, ctx: ProcessingContext) -> None:
        record, partition = event.record, event.source.partition
        env = record["envelope"]
        subgoal_key = f"subgoal/{env['session_id']}/{record['plan_id']}/{record['subgoal_id']}"
        subgoal = self._get(subgoal_key, partition)
        if subgoal is None:
            return  # a plan not submitted (the scheduler ignores it too)
        spec, attempt, at = subgoal["spec"], int(record["attempt"]), int(env["event_time"])
        tool, hashed = subgoal_action(spec, attempt, subgoal["fallback_from"])
        watch_key = f"{WATCH}{PLAN}/{env['session_id']}/{record['plan_id']}/{record['subgoal_id']}/{attempt}"
        state = record["state"]
        if state in ("RUNNING", "HEARTBEAT"):
            if attempt <= subgoal.get("ended", 0):
                return  # an attempt that ended, or that a later one replaced, waking up: nothing to watch
            if attempt - 1 > subgoal.get("ended", 0):  # a later attempt runs, so the earlier ones are over
                subgoal["ended"] = attempt - 1
                await self._put(subgoal_key, subgoal, partition, ctx)
            await self._watch(watch_key, Watch(at + spec["deadline_us"], at, tool, hashed, env), partition, ctx)
            return
        await self._unwatch(watch_key, partition, ctx)
        if attempt > subgoal.get("ended", 0):  # SUCCEEDED or FAILED
            subgoal["ended"] = attempt
            await self._put(subgoal_key, subgoal, partition, ctx)
        if state != "FAILED":
            return
        advised = await self._failure("subgoal", tool, hashed, record, partition, ctx)
        first_fallback = int((spec.get("retry") or {}).get("max_attempts", 1)) + 1
        earlier = subgoal["fallback_from"] is None or attempt + 1 < subgoal["fallback_from"]
        if advised and spec.get("fallback") is not None and attempt + 1 < first_fallback and earlier:
            # the scheduler reroutes this failure to the fallback (advice in force): its next attempt runs the fallback
            await self._put(subgoal_key, {**subgoal, "fallback_from": attempt + 1}, partition, ctx)

    async def _failure(
        self, source: str, tool: str, hashed: str, judged: dict[str, Any], partition: int, ctx: ProcessingContext
    ) -> bool:
        """Count one failure of an action; its metric and advice. Whether advice was in force before it."""
        env = judged["envelope"]
        at, event_id = int(env["event_time"]), str(env["event_id"])
        key = f"fail/{source}/{action_rule(tool, hashed)}"
        stored = self._get(key, partition)
        window = FailureWindow.from_json(stored) if stored is not None else FailureWindow()
        advised_before = window.advised_until > at
        count = window.add(at, event_id, self.window_us)
        if count is None:
            return advised_before  # a replay, or too old to count
        rule = action_rule(tool, hashed)
        if count >= self.threshold:
            evidence = f"{count} failures of {tool} ({source}) within {self.window_us / MICROS:g} s"
            severity = severity_of_failures(count, self.threshold)
            metric = metric_record(self.name, REPEATED_FAILURE, rule, count, severity, judged, evidence)
            await ctx.publish(EVALUATION_METRIC, metric, key=env["session_id"].encode())
        if window.should_advise(count, at, self.threshold):
            window.advised_until = at + self.window_us
            advice = {
                "advice_id": f"{self.name}:skip_retries:{rule}:{event_id}", "action": "SKIP_RETRIES", "tool": tool,
                "params_hash": hashed, "failures": count, "window_s": self.window_us / MICROS,
                "reason": f"{count} failures within {self.window_us / MICROS:g} s ({source})", "evaluator": self.name,
                "source_event_id": event_id, "advised_at": at, "valid_until": window.advised_until,
            }  # fmt: skip
            await ctx.publish(SCHEDULER_ADVICE, advice, key=PLAN_EVENTS_KEY.encode())
            log.info("advising the plans scheduler to skip retries of %s (%s) until %d: %s",
                     tool, hashed, window.advised_until, advice["reason"])  # fmt: skip
        await self._put(key, window.to_json(), partition, ctx)
        return advised_before

    async def _dispatch(self, event: InputEvent, ctx: ProcessingContext) -> None:
        record, partition = event.record, event.source.partition
        env = record["envelope"]
        key = f"step/{env['logical_event_id']}"
        step = self._get(key, partition) or _new_step()
        if step["tool"] is not None:
            return  # a repeated dispatch
        step["tool"], step["params_hash"] = record["tool"], params_hash(record["params_json"])
        at = int(env["event_time"])
        if not step["result"]:
            due = int(record["deadline"]) if record.get("deadline") else at + self.step_timeout_us
            watch = Watch(max(due, at), at, step["tool"], step["params_hash"], env)
            await self._watch(f"{WATCH}{STEP}/{env['logical_event_id']}", watch, partition, ctx)
        pending, step["pending"] = step["pending"], []
        await self._put(key, step, partition, ctx)
        for schema, judged in pending:  # what arrived before the dispatch, now that its action is known
            if schema == TOOL_RESULT:
                await self._failure("tool_result", step["tool"], step["params_hash"], judged, partition, ctx)
            else:
                await self._reward_of(step, judged, partition, ctx)

    async def _tool_result(self, event: InputEvent, ctx: ProcessingContext) -> None:
        record, partition = event.record, event.source.partition
        env = record["envelope"]
        key = f"step/{env['logical_event_id']}"
        step = self._get(key, partition) or _new_step()
        await self._unwatch(f"{WATCH}{STEP}/{env['logical_event_id']}", partition, ctx)
        if step["result"]:
            return  # a repeated result
        step["result"] = True
        failed = record["status"] != "OK"
        if failed and step["tool"] is None:
            step["pending"].append([TOOL_RESULT, {"envelope": env}])
        await self._put(key, step, partition, ctx)
        if failed and step["tool"] is not None:
            await self._failure("tool_result", step["tool"], step["params_hash"], {"envelope": env}, partition, ctx)

    async def _reward(self, event: InputEvent, ctx: ProcessingContext) -> None:
        record, partition = event.record, event.source.partition
        env = record["envelope"]
        if (env.get("attributes") or {}).get("scope") == "episode":
            return  # judges no single action
        key = f"step/{env['logical_event_id']}"
        step = self._get(key, partition) or _new_step()
        judged = {"envelope": env, "source": record["source"], "name": record["name"], "value": record["value"]}
        if step["tool"] is None:
            if all(p[1]["envelope"]["event_id"] != env["event_id"] for p in step["pending"]):
                step["pending"].append([REWARD, judged])
                await self._put(key, step, partition, ctx)
            return
        await self._reward_of(step, judged, partition, ctx)

    async def _reward_of(
        self, step: dict[str, Any], judged: dict[str, Any], partition: int, ctx: ProcessingContext
    ) -> None:
        rule = action_rule(step["tool"], step["params_hash"])
        key = f"var/{rule}/{judged['source']}/{judged['name']}"
        stored = self._get(key, partition)
        stats = RewardVariance.from_json(stored) if stored is not None else RewardVariance()
        if not stats.add(float(judged["value"]), str(judged["envelope"]["event_id"])):
            return  # counted already
        await self._put(key, stats.to_json(), partition, ctx)
        if stats.n >= self.min_samples:
            severity = "high" if stats.variance >= self.variance_alert else "low"
            evidence = f"{judged['source']}/{judged['name']}: n={stats.n}, mean={stats.mean:.4g}"
            metric = metric_record(self.name, REWARD_VARIANCE, rule, stats.variance, severity, judged, evidence)
            await ctx.publish(EVALUATION_METRIC, metric, key=judged["envelope"]["session_id"].encode())


_PLAN_INPUTS = frozenset({PLAN_SUBMITTED, SUBGOAL_STATUS, EXECUTOR_HEARTBEAT})


def _log_of(watch_key: str) -> str:
    return PLAN if watch_key.startswith(f"{WATCH}{PLAN}/") else STEP


def _event_time(event: InputEvent) -> int:
    if event.schema_name == EXECUTOR_HEARTBEAT:
        return int(event.record["sent_at"])
    return int(event.record["envelope"]["event_time"])


def _new_step() -> dict[str, Any]:
    """What plan_diagnosis keeps of a step: its action once dispatched, whether its result came, what waits for it."""
    return {"tool": None, "params_hash": None, "result": False, "pending": []}


def _work_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """What plan_diagnosis keeps of a subgoal: the actions it and its fallback run, its retries and its deadline."""
    fallback = spec.get("fallback")
    keep = ("tool", "agent", "params_json")
    return {
        **{k: spec.get(k) for k in keep},
        "retry": {"max_attempts": int((spec.get("retry") or {}).get("max_attempts", 1))},
        "fallback": {k: fallback.get(k) for k in keep} if fallback is not None else None,
        "deadline_us": round(float(spec["deadline_s"]) * MICROS),
    }
