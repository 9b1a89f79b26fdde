"""The plans scheduler's fold: plan, status, heartbeat and tick records in, release and self-healing decisions out.

Pure and deterministic: the same input sequence gives the same decisions, whatever the wall clock says. The clock is
event time, the largest event time seen (envelope.event_time, sent_at, ticks), and timers (retry backoff, attempt
deadlines) fire when it passes them. A repeated input changes nothing, so a replay after a crash decides the same.

Admission control: an attempt is counted against one live executor of its resource class whose advertised free
capacity, less what the attempts counted against it that its last heartbeat does not list in `running` hold, covers
its profile in GPU memory, GPUs and CPU slots at once. A timed-out attempt (its executor may still be running it)
holds on until that executor says, in a heartbeat sent after the timeout, that it does not run it. docs/plans.md has
the rules; `PlanScheduler` is the fold.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from topics.names import (
    EXECUTOR_HEARTBEAT,
    PLAN_FINISHED,
    PLAN_SUBMITTED,
    SUBGOAL_ESCALATED,
    SUBGOAL_RELEASED,
    SUBGOAL_REROUTED,
    SUBGOAL_RETRIED,
    SUBGOAL_STATUS,
    SUBGOAL_TIMED_OUT,
)

MICROS = 1_000_000
TIMEOUT = "timeout"


class PlanRefused(ValueError):
    """A submitted plan the scheduler cannot run (cycle, unknown dependency, bad policy): it becomes a dead letter."""

    def __init__(self, plan_id: str, reason: str) -> None:
        super().__init__(f"plan {plan_id!r} refused: {reason}")
        self.plan_id = plan_id
        self.reason = reason


@dataclass(frozen=True)
class Decision:
    """One output record: its schema's full name, Kafka key (the plan's session) and the record."""

    schema: str
    key: str
    record: dict[str, Any]


@dataclass(frozen=True, order=True)
class Resources:
    """GPU memory (MiB), whole GPUs and CPU slots: a profile needed or a capacity free."""

    gpu_memory_mb: int = 0
    gpus: int = 0
    cpu: int = 0

    @classmethod
    def of(cls, record: dict[str, Any]) -> Resources:
        return cls(int(record.get("gpu_memory_mb", 0)), int(record.get("gpus", 0)), int(record.get("cpu", 0)))

    def covers(self, need: Resources) -> bool:
        return self.gpu_memory_mb >= need.gpu_memory_mb and self.gpus >= need.gpus and self.cpu >= need.cpu

    def __sub__(self, other: Resources) -> Resources:
        return Resources(self.gpu_memory_mb - other.gpu_memory_mb, self.gpus - other.gpus, self.cpu - other.cpu)

    def __add__(self, other: Resources) -> Resources:
        return Resources(self.gpu_memory_mb + other.gpu_memory_mb, self.gpus + other.gpus, self.cpu + other.cpu)

    def record(self) -> dict[str, int]:
        return {"gpu_memory_mb": self.gpu_memory_mb, "gpus": self.gpus, "cpu": self.cpu}


class NodeState(StrEnum):
    WAITING = "WAITING"  # a dependency has not succeeded yet
    READY = "READY"  # may be released once capacity covers it
    RELEASED = "RELEASED"  # an attempt is out, no sign of it running yet
    RUNNING = "RUNNING"
    BACKOFF = "BACKOFF"  # failed, waiting for retry_at
    SUCCEEDED = "SUCCEEDED"
    ESCALATED = "ESCALATED"
    CANCELLED = "CANCELLED"


TERMINAL = frozenset({NodeState.SUCCEEDED, NodeState.ESCALATED, NodeState.CANCELLED})


@dataclass
class _Node:
    """One subgoal's progress."""

    spec: dict[str, Any]
    index: int
    plan: _Plan
    dependents: list[str] = field(default_factory=list)
    state: NodeState = NodeState.WAITING
    attempt: int = 0  # the last attempt released (1-based); 0 before the first
    tries: int = 0  # failed attempts of the current phase (the subgoal itself, then its fallback)
    on_fallback: bool = False
    last_seen: int = 0  # event time of the attempt's last sign of life
    executor_id: str | None = None
    error_class: str = ""

    @property
    def id(self) -> str:
        return self.spec["subgoal_id"]

    @property
    def work(self) -> dict[str, Any]:
        """What the current phase runs: the subgoal, or its fallback."""
        return self.spec["fallback"] if self.on_fallback else self.spec

    @property
    def resource_class(self) -> str:
        return self.work.get("resource_class", "cpu")

    @property
    def profile(self) -> Resources:
        return Resources.of(self.work["profile"])

    @property
    def deadline_us(self) -> int:
        return round(float(self.spec["deadline_s"]) * MICROS)

    @property
    def attempt_key(self) -> str:
        return attempt_key(self.plan.session_id, self.plan.plan_id, self.id, self.attempt)


@dataclass
class _Plan:
    session_id: str
    episode_id: str
    plan_id: str
    seq: int
    content: str  # canonical JSON of the submission, to tell a repeat from a different plan under the same id
    nodes: dict[str, _Node] = field(default_factory=dict)
    released: int = 0
    finished: bool = False


@dataclass
class _Executor:
    resource_class: str
    free: Resources
    running: frozenset[str]
    sent_at: int
    expires_at: int


def attempt_key(session_id: str, plan_id: str, subgoal_id: str, attempt: int) -> str:
    """How heartbeats name an attempt in `running`: session_id/plan_id/subgoal_id/attempt."""
    return f"{session_id}/{plan_id}/{subgoal_id}/{attempt}"


class PlanScheduler:
    """The fold over every plan one scheduler instance owns, with the executors' advertised capacity.

    `apply` takes one decoded input record (PlanSubmitted, SubgoalStatus, ExecutorHeartbeat) and `tick` advances event
    time; both return the decisions in the order they were made. `PlanRefused` is raised for a plan that cannot run.
    """

    def __init__(self, work_topic_prefix: str = "treadle.work") -> None:
        self.work_topic_prefix = work_topic_prefix
        self.now = 0
        self._plans: dict[tuple[str, str], _Plan] = {}
        self._executors: dict[str, _Executor] = {}
        # attempts counted against each executor, by attempt key: released and not ended, or timed out (its
        # executor may still run it) with the time it timed out
        self._counted: dict[str, dict[str, tuple[Resources, int | None]]] = {}
        self._unlisted: dict[str, Resources] = {}  # per executor: what its counted attempts hold, less what it lists
        self._ready: dict[str, dict[tuple[int, int], _Node]] = {}  # by resource class, then (plan seq, index)
        self._floor: dict[str, Resources] = {}  # per class: the least of every profile ever ready, component-wise
        self._dirty: set[str] = set()  # resource classes where a subgoal became ready or room grew since the last pass
        # (due, seq, kind, session, plan, subgoal, attempt); kind: "deadline" or "retry"
        self._timers: list[tuple[int, int, str, str, str, str, int]] = []
        self._timer_seq = 0

    # -- inputs -------------------------------------------------------------------------------------------------

    def apply(self, schema_name: str, record: dict[str, Any]) -> list[Decision]:
        """Fold one input record; the decisions it (and the timers its event time passes) lead to."""
        if schema_name == PLAN_SUBMITTED:
            return self.submit(record)
        if schema_name == SUBGOAL_STATUS:
            return self.status(record)
        if schema_name == EXECUTOR_HEARTBEAT:
            return self.heartbeat(record)
        raise ValueError(f"the plans scheduler does not take {schema_name}")

    def tick(self, now: int) -> list[Decision]:
        """Advance event time to `now` (UTC micros): fire due timers, then release what fits."""
        out = self._advance(now)
        self._release(out)
        return out

    def submit(self, record: dict[str, Any]) -> list[Decision]:
        env = record["envelope"]
        session_id, plan_id = env["session_id"], record["plan_id"]
        content = json.dumps(
            {"plan_id": plan_id, "goal": record.get("goal", ""), "subgoals": record["subgoals"]}, sort_keys=True
        )
        known = self._plans.get((session_id, plan_id))
        if known is not None:
            if known.content == content:
                return []  # the same plan again: a redelivery
            raise PlanRefused(plan_id, "a different plan was already submitted under this plan_id")
        validate_plan(plan_id, record["subgoals"])
        out = self._advance(int(env["event_time"]))
        plan = _Plan(session_id, env.get("episode_id", ""), plan_id, len(self._plans), content)
        for index, spec in enumerate(record["subgoals"]):
            plan.nodes[spec["subgoal_id"]] = _Node(spec, index, plan)
        for node in plan.nodes.values():
            for dep in node.spec.get("depends_on", []):
                plan.nodes[dep].dependents.append(node.id)
        self._plans[(session_id, plan_id)] = plan
        for node in plan.nodes.values():
            if not node.spec.get("depends_on"):
                self._make_ready(node)
        self._release(out)
        return out

    def status(self, record: dict[str, Any]) -> list[Decision]:
        env = record["envelope"]
        at = int(env["event_time"])
        out = self._advance(at)
        plan = self._plans.get((env["session_id"], record["plan_id"]))
        node = plan.nodes.get(record["subgoal_id"]) if plan is not None else None
        current = node is not None and node.attempt == record["attempt"]
        if node is not None and current and node.state in (NodeState.RELEASED, NodeState.RUNNING):
            state = record["state"]
            if state in ("RUNNING", "HEARTBEAT"):
                node.state = NodeState.RUNNING
                if at > node.last_seen:
                    node.last_seen = at
                    self._set_timer(node, "deadline", at + node.deadline_us)
            elif state == "SUCCEEDED":
                self._succeed(node, out)
            elif state == "FAILED":
                self._fail(node, record.get("error_class") or "error", out)
        self._release(out)
        return out

    def heartbeat(self, record: dict[str, Any]) -> list[Decision]:
        sent_at = int(record["sent_at"])
        out = self._advance(sent_at)
        executor_id = record["executor_id"]
        known = self._executors.get(executor_id)
        if known is None or sent_at > known.sent_at:  # one not newer than the last (late, repeated) changes nothing
            self._executors[executor_id] = _Executor(
                resource_class=record["resource_class"],
                free=Resources(int(record["free_gpu_memory_mb"]), int(record["free_gpus"]), int(record["free_cpu"])),
                running=frozenset(record.get("running", ())),
                sent_at=sent_at,
                expires_at=sent_at + round(float(record.get("valid_for_s", 30.0)) * MICROS),
            )
            running = self._executors[executor_id].running
            counted = self._counted.setdefault(executor_id, {})
            for key, (_, timed_out_at) in list(counted.items()):
                if timed_out_at is not None and sent_at >= timed_out_at and key not in running:
                    del counted[key]  # it said, after the timeout, that it does not run the attempt
            self._unlisted[executor_id] = sum((p for k, (p, _) in counted.items() if k not in running), Resources())
            self._dirty.add(record["resource_class"])
            if known is not None:
                self._dirty.add(known.resource_class)
        self._release(out)
        return out

    # -- reading the state ---------------------------------------------------------------------------------------

    def subgoal_states(self, session_id: str, plan_id: str) -> dict[str, NodeState]:
        plan = self._plans[(session_id, plan_id)]
        return {node.id: node.state for node in plan.nodes.values()}

    def plan_finished(self, session_id: str, plan_id: str) -> bool:
        return self._plans[(session_id, plan_id)].finished

    def available(self, resource_class: str) -> dict[str, Resources]:
        """Capacity still free per live executor of the class: advertised, less the attempts held against it."""
        return {
            eid: ex.free - self._unlisted.get(eid, Resources())
            for eid, ex in sorted(self._executors.items())
            if ex.resource_class == resource_class and ex.expires_at > self.now
        }

    # -- the fold ------------------------------------------------------------------------------------------------

    def _advance(self, at: int) -> list[Decision]:
        """Move the clock to `at` (never back) and fire the timers it passes, in due order."""
        out: list[Decision] = []
        if at > self.now:
            self.now = at
        while self._timers and self._timers[0][0] <= self.now:
            due, _, kind, session_id, plan_id, subgoal_id, attempt = heapq.heappop(self._timers)
            node = self._plans[(session_id, plan_id)].nodes[subgoal_id]
            if node.attempt != attempt:
                continue  # a timer of an attempt since replaced
            if kind == "retry" and node.state is NodeState.BACKOFF:
                self._make_ready(node)
            elif (
                kind == "deadline"
                and node.state in (NodeState.RELEASED, NodeState.RUNNING)
                and due == node.last_seen + node.deadline_us  # not pushed back by a later sign of life
            ):
                out.append(self._decision(node, SUBGOAL_TIMED_OUT, "timed_out", {
                    "attempt": node.attempt, "last_seen_at": node.last_seen,
                    "deadline_s": float(node.spec["deadline_s"]), "decided_at": self.now,
                }))  # fmt: skip
                self._fail(node, TIMEOUT, out, timed_out=True)
        return out

    def _set_timer(self, node: _Node, kind: str, due: int) -> None:
        self._timer_seq += 1
        plan = node.plan
        heapq.heappush(self._timers, (due, self._timer_seq, kind, plan.session_id, plan.plan_id, node.id, node.attempt))

    def _make_ready(self, node: _Node) -> None:
        node.state = NodeState.READY
        self._ready.setdefault(node.resource_class, {})[(node.plan.seq, node.index)] = node
        self._dirty.add(node.resource_class)
        need, floor = node.profile, self._floor.get(node.resource_class, node.profile)
        self._floor[node.resource_class] = Resources(
            min(need.gpu_memory_mb, floor.gpu_memory_mb), min(need.gpus, floor.gpus), min(need.cpu, floor.cpu)
        )

    def _hold(self, node: _Node) -> None:
        """Count the node's current attempt against its executor."""
        if node.executor_id is None:
            return
        self._counted.setdefault(node.executor_id, {})[node.attempt_key] = (node.profile, None)
        if node.attempt_key not in self._executors[node.executor_id].running:
            self._unlisted[node.executor_id] = self._unlisted.get(node.executor_id, Resources()) + node.profile

    def _let_go(self, node: _Node, timed_out: bool) -> None:
        """The current attempt ended: stop counting it, or (timed out) count it until its executor drops it."""
        executor_id, key = node.executor_id, node.attempt_key
        if executor_id is None or key not in self._counted.get(executor_id, {}):
            return
        if timed_out:
            self._counted[executor_id][key] = (node.profile, self.now)
            return
        profile, _ = self._counted[executor_id].pop(key)
        executor = self._executors[executor_id]
        if key not in executor.running:
            self._unlisted[executor_id] = self._unlisted[executor_id] - profile
        self._dirty.add(executor.resource_class)

    def _release(self, out: list[Decision]) -> None:
        """Release every ready subgoal that fits, in plan then subgoal order (a smaller one may pass a larger one)."""
        dirty, self._dirty = self._dirty, set()
        for resource_class in sorted(dirty):
            ready = self._ready.get(resource_class)
            if not ready:
                continue
            free = self.available(resource_class)
            floor = self._floor[resource_class]  # no ready subgoal of the class needs less than this
            if not any(left.covers(floor) for left in free.values()):
                continue
            for order in sorted(ready):
                node = ready[order]
                need = node.profile
                fits = [(left - need, eid) for eid, left in free.items() if left.covers(need)]
                if not fits:
                    continue
                left, executor_id = min(fits)  # best fit: the least capacity left over, then the executor id
                free[executor_id] = left
                del ready[order]
                self._release_one(node, executor_id, out)
                if not any(room.covers(floor) for room in free.values()):
                    break  # nothing left can fit anywhere: do not walk the rest

    def _release_one(self, node: _Node, executor_id: str, out: list[Decision]) -> None:
        node.attempt += 1
        node.state = NodeState.RELEASED
        node.executor_id = executor_id
        node.last_seen = self.now
        node.plan.released += 1
        self._hold(node)
        self._set_timer(node, "deadline", self.now + node.deadline_us)
        work = node.work
        out.append(self._decision(node, SUBGOAL_RELEASED, "released", {
            "attempt": node.attempt, "resource_class": node.resource_class,
            "work_topic": f"{self.work_topic_prefix}.{node.resource_class}", "executor_id": executor_id,
            "tool": work.get("tool"), "agent": work.get("agent"), "params_json": work.get("params_json", "{}"),
            "profile": node.profile.record(), "deadline_s": float(node.spec["deadline_s"]),
            "fallback": node.on_fallback, "released_at": self.now,
        }))  # fmt: skip

    def _succeed(self, node: _Node, out: list[Decision]) -> None:
        self._let_go(node, timed_out=False)
        node.state = NodeState.SUCCEEDED
        plan = node.plan
        for dependent_id in node.dependents:
            dependent = plan.nodes[dependent_id]
            deps = dependent.spec.get("depends_on", [])
            if dependent.state is NodeState.WAITING and all(plan.nodes[d].state is NodeState.SUCCEEDED for d in deps):
                self._make_ready(dependent)
        self._finish_if_done(plan, out)

    def _fail(self, node: _Node, error_class: str, out: list[Decision], timed_out: bool = False) -> None:
        """An attempt failed or timed out: retry after the backoff, else the fallback, else escalate."""
        self._let_go(node, timed_out)
        node.error_class = error_class
        node.tries += 1
        retry = node.spec.get("retry") or {}
        if node.tries < int(retry.get("max_attempts", 1)):
            backoff = float(retry.get("backoff_s", 0.0)) * float(retry.get("backoff_multiplier", 2.0)) ** (
                node.tries - 1
            )
            retry_at = self.now + round(backoff * MICROS)
            out.append(self._decision(node, SUBGOAL_RETRIED, "retried", {
                "failed_attempt": node.attempt, "next_attempt": node.attempt + 1, "error_class": error_class,
                "retry_at": retry_at, "decided_at": self.now,
            }))  # fmt: skip
            node.state = NodeState.BACKOFF
            if retry_at <= self.now:
                self._make_ready(node)
            else:
                self._set_timer(node, "retry", retry_at)
        elif node.spec.get("fallback") is not None and not node.on_fallback:
            node.on_fallback, node.tries = True, 0
            fallback = node.spec["fallback"]
            out.append(self._decision(node, SUBGOAL_REROUTED, "rerouted", {
                "failed_attempt": node.attempt, "next_attempt": node.attempt + 1, "error_class": error_class,
                "tool": fallback.get("tool"), "agent": fallback.get("agent"), "decided_at": self.now,
            }))  # fmt: skip
            self._make_ready(node)
        else:
            node.state = NodeState.ESCALATED
            cancelled = self._cancel_dependents(node)
            out.append(self._decision(node, SUBGOAL_ESCALATED, "escalated", {
                "attempts": node.attempt, "error_class": error_class, "cancelled": cancelled, "decided_at": self.now,
            }))  # fmt: skip
            self._finish_if_done(node.plan, out)

    def _cancel_dependents(self, node: _Node) -> list[str]:
        """Cancel everything downstream of `node` (none of it can run); their ids in plan order."""
        plan, stack, cancelled = node.plan, list(node.dependents), []
        while stack:
            dependent = plan.nodes[stack.pop()]
            if dependent.state is NodeState.WAITING:  # downstream of a failed node nothing got further
                dependent.state = NodeState.CANCELLED
                cancelled.append(dependent)
                stack.extend(dependent.dependents)
        return [n.id for n in sorted(cancelled, key=lambda n: n.index)]

    def _finish_if_done(self, plan: _Plan, out: list[Decision]) -> None:
        if plan.finished or any(n.state not in TERMINAL for n in plan.nodes.values()):
            return
        plan.finished = True
        by_state = {s: [n.id for n in plan.nodes.values() if n.state is s] for s in TERMINAL}
        out.append(Decision(PLAN_FINISHED, plan.session_id, {
            "decision_id": f"{plan.session_id}/{plan.plan_id}/finished", "session_id": plan.session_id,
            "episode_id": plan.episode_id, "plan_id": plan.plan_id,
            "outcome": "SUCCEEDED" if len(by_state[NodeState.SUCCEEDED]) == len(plan.nodes) else "FAILED",
            "succeeded": by_state[NodeState.SUCCEEDED], "escalated": by_state[NodeState.ESCALATED],
            "cancelled": by_state[NodeState.CANCELLED], "attempts": plan.released, "finished_at": self.now,
        }))  # fmt: skip

    def _decision(self, node: _Node, schema: str, kind: str, fields: dict[str, Any]) -> Decision:
        plan = node.plan
        record = {
            "decision_id": f"{plan.session_id}/{plan.plan_id}/{node.id}/{node.attempt}/{kind}",
            "session_id": plan.session_id, "episode_id": plan.episode_id, "plan_id": plan.plan_id,
            "subgoal_id": node.id, **fields,
        }  # fmt: skip
        return Decision(schema, plan.session_id, record)


def validate_plan(plan_id: str, subgoals: Iterable[dict[str, Any]]) -> None:
    """Raise PlanRefused with the first reason the plan cannot run: ids, dependencies, cycles, policies."""
    subgoals = list(subgoals)
    if not plan_id:
        raise PlanRefused(plan_id, "plan_id is empty")
    if not subgoals:
        raise PlanRefused(plan_id, "the plan has no subgoals")
    ids: dict[str, dict[str, Any]] = {}
    for spec in subgoals:
        sid = spec.get("subgoal_id") or ""
        if not sid:
            raise PlanRefused(plan_id, "a subgoal has an empty subgoal_id")
        if sid in ids:
            raise PlanRefused(plan_id, f"subgoal id {sid!r} appears twice")
        ids[sid] = spec
    for sid, spec in ids.items():
        for dep in spec.get("depends_on", []):
            if dep not in ids:
                raise PlanRefused(plan_id, f"subgoal {sid!r} depends on unknown subgoal {dep!r}")
        _check_policy(plan_id, sid, spec)
    cycle = find_cycle({sid: list(spec.get("depends_on", [])) for sid, spec in ids.items()})
    if cycle:
        raise PlanRefused(plan_id, "dependency cycle: " + " -> ".join(cycle))


def _check_policy(plan_id: str, sid: str, spec: dict[str, Any]) -> None:
    deadline = float(spec.get("deadline_s", 0.0))
    if not (math.isfinite(deadline) and deadline > 0):
        raise PlanRefused(plan_id, f"subgoal {sid!r}: deadline_s must be a positive number, got {deadline}")
    retry = spec.get("retry") or {}
    if int(retry.get("max_attempts", 1)) < 1:
        raise PlanRefused(plan_id, f"subgoal {sid!r}: retry.max_attempts must be at least 1")
    backoff, multiplier = float(retry.get("backoff_s", 0.0)), float(retry.get("backoff_multiplier", 2.0))
    if not (math.isfinite(backoff) and backoff >= 0 and math.isfinite(multiplier) and multiplier >= 1):
        raise PlanRefused(plan_id, f"subgoal {sid!r}: backoff_s must be >= 0 and backoff_multiplier >= 1")
    works = [("", spec)] + ([("fallback ", spec["fallback"])] if spec.get("fallback") is not None else [])
    for what, work in works:
        profile = Resources.of(work["profile"])
        if min(profile.gpu_memory_mb, profile.gpus, profile.cpu) < 0:
            raise PlanRefused(plan_id, f"subgoal {sid!r}: {what}profile has a negative amount")
        try:
            params = json.loads(work.get("params_json", "{}"))
        except ValueError as exc:
            raise PlanRefused(plan_id, f"subgoal {sid!r}: {what}params_json is not JSON ({exc})") from None
        if not isinstance(params, dict):
            raise PlanRefused(plan_id, f"subgoal {sid!r}: {what}params_json is not a JSON object")


def find_cycle(depends_on: dict[str, list[str]]) -> list[str]:
    """One dependency cycle as [a, b, ..., a], or [] for a DAG (iterative DFS: plans may be deep)."""
    colour: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in depends_on:
        if colour.get(root):
            continue
        path, stack = [root], [iter(depends_on[root])]
        colour[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                colour[path.pop()] = 2
                stack.pop()
            elif colour.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif not colour.get(nxt):
                colour[nxt] = 1
                path.append(nxt)
                stack.append(iter(depends_on[nxt]))
    return []
