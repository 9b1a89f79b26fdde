"""The plans scheduler's fold: plan, status, heartbeat and tick records in, release and self-healing decisions out.

Pure and deterministic: the same input sequence gives the same decisions, whatever the wall clock says. The clock is
event time, the largest event time seen (envelope.event_time, sent_at, ticks), and timers (retry backoff, attempt
deadlines) fire when it passes them. A repeated input changes nothing, so a replay after a crash decides the same.

Admission control: an attempt is counted against one live executor of its resource class whose advertised free
capacity, less what the attempts counted against it that its last heartbeat does not list in `running` hold, covers
its profile in GPU memory, GPUs and CPU slots at once. A timed-out attempt (its executor may still be running it)
holds on until that executor says, in a heartbeat sent after the timeout, that it does not run it. A ready subgoal
that waited `aging_s` goes first and, when it does not fit, keeps one executor for itself, so backfill cannot starve
a large profile. Memory follows the work in flight: finished plans leave only a digest for redelivery checks (for a
retention), executors gone for good are forgotten with their holds. docs/plans.md has the rules; `PlanScheduler` is
the fold.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from processors.plans.symptoms import work_action
from topics.names import (
    EXECUTOR_HEARTBEAT,
    PLAN_FINISHED,
    PLAN_SUBMITTED,
    RELEASE_DELIVERED,
    SCHEDULER_ADVICE,
    SUBGOAL_ESCALATED,
    SUBGOAL_RELEASED,
    SUBGOAL_REROUTED,
    SUBGOAL_RETRIED,
    SUBGOAL_STATUS,
    SUBGOAL_TIMED_OUT,
)
from topics.plan_checks import PlanRefused, Resources, attempt_key, validate_plan  # shared with the SDK

MICROS = 1_000_000
TIMEOUT = "timeout"


@dataclass(frozen=True)
class Decision:
    """One output record: its schema's full name, Kafka key (the plan's session) and the record."""

    schema: str
    key: str
    record: dict[str, Any]


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
LIVE = frozenset({NodeState.RELEASED, NodeState.RUNNING})
_NEVER = 2**63  # an event time no input reaches


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
    armed: bool = False  # whether the current attempt's deadline runs (its release delivered, or a sign of life)
    executor_id: str | None = None
    error_class: str = ""
    ready_at: int = 0  # event time it last became ready (the aging rule)
    ready_gen: int = 0  # which readiness the ready queues' entries belong to (older entries are stale)
    timed_out: list[int] = field(default_factory=list)  # attempts the scheduler timed out (a late success counts)
    profile: Resources = field(init=False)  # what the current phase needs

    def __post_init__(self) -> None:
        self.profile = Resources.of(self.spec["profile"])

    def reroute(self) -> None:
        """The subgoal's tries are spent: its fallback runs from now on."""
        self.on_fallback, self.tries = True, 0
        self.profile = Resources.of(self.spec["fallback"]["profile"])

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
    digest: bytes  # of the submission's canonical JSON, to tell a repeat from a different plan under the same id
    nodes: dict[str, _Node] = field(default_factory=dict)
    released: int = 0
    finished: bool = False


@dataclass(frozen=True)
class _FinishedPlan:
    """What is kept of a finished plan until it is forgotten: enough to recognise a redelivery, and its end states."""

    digest: bytes
    finished_at: int
    subgoal_ids: tuple[str, ...]
    states: tuple[NodeState, ...]


@dataclass
class _Executor:
    resource_class: str
    free: Resources
    running: frozenset[str]
    sent_at: int
    expires_at: int
    # as far as the scheduler can tell: free plus the attempts listed, when sent
    capacity: Resources = field(default_factory=Resources)


@dataclass
class _ReadyQueue:
    """One resource class's ready subgoals: by (plan seq, index), in heaps of entries per distinct profile (release
    order: plan seq, index, gen) and in one heap in waiting order (ready_at, gen, plan seq, index). An entry whose
    node was released, or became ready again since (a newer entry stands for it), is stale and dropped when it
    surfaces."""

    nodes: dict[tuple[int, int], _Node] = field(default_factory=dict)
    by_profile: dict[Resources, list[tuple[int, int, int]]] = field(default_factory=dict)
    by_age: list[tuple[int, int, int, int]] = field(default_factory=list)

    def add(self, node: _Node) -> None:
        key = (node.plan.seq, node.index)
        self.nodes[key] = node
        heapq.heappush(self.by_profile.setdefault(node.profile, []), (*key, node.ready_gen))
        heapq.heappush(self.by_age, (node.ready_at, node.ready_gen, *key))

    def current(self, seq: int, index: int, gen: int) -> _Node | None:
        node = self.nodes.get((seq, index))
        return node if node is not None and node.ready_gen == gen else None

    def head(self, profile: Resources) -> tuple[int, int, int] | None:
        """The first live entry of a profile's heap (stale ones dropped; an emptied heap removed)."""
        heap = self.by_profile[profile]
        while heap and self.current(*heap[0]) is None:
            heapq.heappop(heap)
        if not heap:
            del self.by_profile[profile]
            return None
        return heap[0]

    def clear(self) -> None:
        self.by_profile.clear()
        self.by_age.clear()


class PlanScheduler:
    """The fold over every plan one scheduler instance owns, with the executors' advertised capacity.

    `apply` takes one decoded input record (PlanSubmitted, SubgoalStatus, ExecutorHeartbeat) and `tick` advances event
    time; both return the decisions in the order they were made. `PlanRefused` is raised for a plan that cannot run.

    The keyword settings are event-time durations: `aging_s`, how long a ready subgoal waits before smaller later ones
    stop passing it; `finished_retention_s` and `finished_limit`, how long (and how many) finished plans are remembered
    to recognise a redelivered submission; `executor_forget_s`, how long after its advertisement expired an executor
    (and the holds of timed-out attempts on it) is forgotten.

    `delivery_markers`: a released attempt's deadline starts at its ReleaseDelivered marker (the plans processor
    appends one to the log when it sends the release) or its first sign of life, not at the release. A worker
    catching up on a backlog releases at the backlog's older event time; the rest of the backlog (heartbeats written
    meanwhile) must not time the attempt out before it went out. Off, release and delivery are one moment (a fold
    driven directly, as in tests and benchmarks).
    """

    def __init__(
        self,
        work_topic_prefix: str = "treadle.work",
        *,
        aging_s: float = 60.0,
        finished_retention_s: float = 3600.0,
        finished_limit: int = 100_000,
        executor_forget_s: float = 600.0,
        delivery_markers: bool = False,
    ) -> None:
        self.work_topic_prefix = work_topic_prefix
        self.delivery_markers = delivery_markers
        self.now = 0
        self._aging_us = round(aging_s * MICROS) if math.isfinite(aging_s) else _NEVER
        self._retention_us = round(finished_retention_s * MICROS)
        self._finished_limit = finished_limit
        self._forget_us = round(executor_forget_s * MICROS)
        self._plans: dict[tuple[str, str], _Plan] = {}
        self._finished: dict[tuple[str, str], _FinishedPlan] = {}  # in the order they finished
        self._plan_seq = 0
        self._ready_gen = 0
        self._executors: dict[str, _Executor] = {}
        self._by_class: dict[str, list[str]] = {}  # executor ids per resource class, sorted
        # attempts counted against each executor, by attempt key: released and not ended, or timed out or
        # superseded (its executor may still run it) with the time from which a heartbeat not listing it frees it
        self._counted: dict[str, dict[str, tuple[Resources, int | None]]] = {}
        self._unlisted: dict[str, Resources] = {}  # per executor: what its counted attempts hold, less what it lists
        self._forget_at = _NEVER  # the earliest event time an executor may be forgotten
        self._ready: dict[str, _ReadyQueue] = {}  # by resource class
        self._floor: dict[str, Resources] = {}  # per class: the least of every profile ever ready, component-wise
        self._dirty: set[str] = set()  # resource classes where a subgoal became ready or room grew since the last pass
        self._advice: dict[tuple[str, str], int] = {}  # (tool or agent, params hash) -> skip retries until (advice)
        # (due, seq, kind, session, plan, subgoal, attempt); kind: "deadline" or "retry"
        self._timers: list[tuple[int, int, str, str, str, str, int]] = []
        self._timer_seq = 0
        self._timers_compact_at = 4096

    # -- inputs -------------------------------------------------------------------------------------------------

    def apply(self, schema_name: str, record: dict[str, Any]) -> list[Decision]:
        """Fold one input record; the decisions it (and the timers its event time passes) lead to."""
        if schema_name == PLAN_SUBMITTED:
            return self.submit(record)
        if schema_name == SUBGOAL_STATUS:
            return self.status(record)
        if schema_name == EXECUTOR_HEARTBEAT:
            return self.heartbeat(record)
        if schema_name == SCHEDULER_ADVICE:
            return self.advise(record)
        if schema_name == RELEASE_DELIVERED:
            return self.delivered(record)
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
        digest = hashlib.blake2b(content.encode(), digest_size=16).digest()
        known = self._plans.get((session_id, plan_id)) or self._finished.get((session_id, plan_id))
        if known is not None:
            if known.digest == digest:
                return []  # the same plan again: a redelivery
            raise PlanRefused(plan_id, "a different plan was already submitted under this plan_id")
        validate_plan(plan_id, record["subgoals"])
        out = self._advance(int(env["event_time"]))
        plan = _Plan(session_id, env.get("episode_id", ""), plan_id, self._plan_seq, digest)
        self._plan_seq += 1
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
        attempt, state = record["attempt"], record["state"]
        if node is None or not 1 <= attempt <= node.attempt:
            pass  # unknown, finished, or an attempt never released: nothing to do
        elif attempt == node.attempt and node.state in LIVE:
            if state in ("RUNNING", "HEARTBEAT"):
                node.state = NodeState.RUNNING
                self._sign_of_life(node, at)
            elif state == "SUCCEEDED":
                self._succeed(node, out)
            elif state == "FAILED":
                self._fail(node, record.get("error_class") or "error", out)
        elif state in ("SUCCEEDED", "FAILED"):  # an attempt that already ended for the scheduler
            self._drop_hold(attempt_key(plan.session_id, plan.plan_id, node.id, attempt))
            if state == "SUCCEEDED" and attempt in node.timed_out and node.state not in TERMINAL:
                self._succeed(node, out, late=True)  # it was slow, not dead: the work is done
        self._release(out)
        return out

    def heartbeat(self, record: dict[str, Any]) -> list[Decision]:
        sent_at = int(record["sent_at"])
        out = self._advance(sent_at)
        executor_id = record["executor_id"]
        known = self._executors.get(executor_id)
        expires_at = sent_at + round(float(record.get("valid_for_s", 30.0)) * MICROS)
        # one not newer than the last (late, repeated) changes nothing; nor does an already expired one from an
        # executor not known (or forgotten): it could only bring back holds that are gone
        if (known is None and expires_at > self.now) or (known is not None and sent_at > known.sent_at):
            resource_class = record["resource_class"]
            self._executors[executor_id] = _Executor(
                resource_class=resource_class,
                free=Resources(int(record["free_gpu_memory_mb"]), int(record["free_gpus"]), int(record["free_cpu"])),
                running=frozenset(record.get("running", ())),
                sent_at=sent_at,
                expires_at=expires_at,
            )
            if known is None or known.resource_class != resource_class:
                if known is not None:
                    self._by_class[known.resource_class].remove(executor_id)
                    self._dirty.add(known.resource_class)
                self._by_class.setdefault(resource_class, []).append(executor_id)
                self._by_class[resource_class].sort()
            running = self._executors[executor_id].running
            counted = self._counted.setdefault(executor_id, {})
            for key, (_, timed_out_at) in list(counted.items()):
                if timed_out_at is not None and sent_at >= timed_out_at and key not in running:
                    del counted[key]  # it said, after the timeout, that it does not run the attempt
            unlisted, listed = Resources(), Resources()
            for key, (profile, _) in counted.items():
                if key in running:
                    listed += profile
                else:
                    unlisted += profile
            self._unlisted[executor_id] = unlisted
            self._executors[executor_id].capacity = self._executors[executor_id].free + listed
            self._dirty.add(resource_class)
            self._forget_at = min(self._forget_at, expires_at + self._forget_us)
        self._release(out)
        return out

    def delivered(self, record: dict[str, Any]) -> list[Decision]:
        """A ReleaseDelivered marker: the processor sent the attempt's release at `sent_at`, so (with
        `delivery_markers`) its deadline runs from then. One for an attempt no longer current, or a repeat, changes
        nothing (a marker later than the last sign of life pushes the deadline back, as a sign of life would)."""
        at = int(record["sent_at"])
        out = self._advance(at)
        plan = self._plans.get((record["session_id"], record["plan_id"]))
        node = plan.nodes.get(record["subgoal_id"]) if plan is not None else None
        if node is not None and record["attempt"] == node.attempt and node.state in LIVE:
            self._sign_of_life(node, at)
        self._release(out)
        return out

    def _sign_of_life(self, node: _Node, at: int) -> None:
        """The current attempt was delivered or is running at `at`: its deadline runs from its latest sign."""
        if at > node.last_seen or not node.armed:
            node.last_seen = max(node.last_seen, at)
            node.armed = True
            self._set_timer(node, "deadline", node.last_seen + node.deadline_us)

    def advise(self, record: dict[str, Any]) -> list[Decision]:
        """Self-diagnosis advice (SchedulerAdvice, SKIP_RETRIES): until `valid_until`, a subgoal running this tool and
        params goes to its fallback at its next failure instead of spending its remaining retries. The advice is on
        the log like every input, so the decisions stay a function of it; a repeat changes nothing."""
        out = self._advance(int(record["advised_at"]))
        self._advice = {action: until for action, until in self._advice.items() if until > self.now}  # expired ones
        if record["action"] == "SKIP_RETRIES":
            action = (record["tool"], record["params_hash"])
            self._advice[action] = max(self._advice.get(action, 0), int(record["valid_until"]))
        self._release(out)
        return out

    def _advised(self, node: _Node) -> bool:
        """Whether advice in force says the node's work should skip its remaining retries (only before a fallback)."""
        if not self._advice or node.on_fallback or node.spec.get("fallback") is None:
            return False
        return self._advice.get(work_action(node.work), 0) > self.now

    # -- reading the state ---------------------------------------------------------------------------------------

    def subgoal_states(self, session_id: str, plan_id: str) -> dict[str, NodeState]:
        """Each subgoal's state; a finished plan's end states while it is remembered (KeyError once forgotten)."""
        plan = self._plans.get((session_id, plan_id))
        if plan is None:
            done = self._finished[(session_id, plan_id)]
            return dict(zip(done.subgoal_ids, done.states, strict=True))
        return {node.id: node.state for node in plan.nodes.values()}

    def plan_finished(self, session_id: str, plan_id: str) -> bool:
        if (session_id, plan_id) in self._finished:
            return True
        return self._plans[(session_id, plan_id)].finished

    def available(self, resource_class: str) -> dict[str, Resources]:
        """Capacity still free per live executor of the class: advertised, less the attempts held against it."""
        out = {}
        for eid in self._by_class.get(resource_class, ()):
            ex = self._executors[eid]
            if ex.expires_at > self.now:
                out[eid] = ex.free - self._unlisted[eid] if eid in self._unlisted else ex.free
        return out

    def unplaceable(self) -> list[tuple[str, str, str, str]]:
        """(session, plan, subgoal, resource class) of each ready subgoal that no live executor of its class could
        hold even when idle (its profile is over the executor's capacity as far as the scheduler can tell: what it
        advertises free plus the attempts it lists as running). Such a subgoal is not refused, since an executor
        may join later; it waits, and this is for a metric or a log line."""
        out = []
        for resource_class in sorted(self._ready):
            capacities = [self._executors[eid].capacity for eid in self.available(resource_class)]
            for key in sorted(self._ready[resource_class].nodes):
                node = self._ready[resource_class].nodes[key]
                if not any(cap.covers(node.profile) for cap in capacities):
                    out.append((node.plan.session_id, node.plan.plan_id, node.id, resource_class))
        return out

    def footprint(self) -> dict[str, int]:
        """How much the fold holds (plans, finished plans remembered, executors, holds, ready entries, timers,
        advice in force)."""
        return {
            "plans": len(self._plans),
            "finished_remembered": len(self._finished),
            "executors": len(self._executors),
            "holds": sum(len(c) for c in self._counted.values()),
            "ready": sum(len(q.nodes) for q in self._ready.values()),
            "ready_entries": sum(sum(map(len, q.by_profile.values())) + len(q.by_age) for q in self._ready.values()),
            "timers": len(self._timers),
            "advice": len(self._advice),
        }

    # -- the fold ------------------------------------------------------------------------------------------------

    def _advance(self, at: int) -> list[Decision]:
        """Move the clock to `at` (never back), fire the timers it passes in due order, and forget what has aged out."""
        out: list[Decision] = []
        if at > self.now:
            self.now = at
        while self._timers and self._timers[0][0] <= self.now:
            timer = heapq.heappop(self._timers)
            if not self._timer_matters(timer):
                continue  # of a finished plan, of an attempt since replaced, or pushed back by a later sign of life
            _, _, kind, session_id, plan_id, subgoal_id, _ = timer
            node = self._plans[(session_id, plan_id)].nodes[subgoal_id]
            if kind == "retry":
                self._make_ready(node)
            else:
                out.append(self._decision(node, SUBGOAL_TIMED_OUT, "timed_out", {
                    "attempt": node.attempt, "last_seen_at": node.last_seen,
                    "deadline_s": float(node.spec["deadline_s"]), "decided_at": self.now,
                }))  # fmt: skip
                node.timed_out.append(node.attempt)
                self._fail(node, TIMEOUT, out, timed_out=True)
        if self.now >= self._forget_at:
            self._forget_executors()
        self._forget_finished()
        return out

    def _forget_finished(self) -> None:
        """Forget the oldest finished plans past the retention, or past the limit."""
        while self._finished:
            oldest = next(iter(self._finished))
            too_many = len(self._finished) > self._finished_limit
            if not too_many and self._finished[oldest].finished_at + self._retention_us > self.now:
                return
            del self._finished[oldest]

    def _forget_executors(self) -> None:
        """Forget executors whose advertisement expired `executor_forget_s` ago, with the holds of timed-out attempts
        on them. One still counted for an attempt not ended (not timed out yet) is kept until that attempt ends."""
        self._forget_at = _NEVER
        for executor_id in sorted(self._executors):
            executor = self._executors[executor_id]
            gone_at = executor.expires_at + self._forget_us
            if gone_at > self.now:
                self._forget_at = min(self._forget_at, gone_at)
            elif any(timed_out_at is None for _, timed_out_at in self._counted.get(executor_id, {}).values()):
                self._forget_at = min(self._forget_at, self.now + self._forget_us)  # look again later
            else:
                del self._executors[executor_id]
                self._by_class[executor.resource_class].remove(executor_id)
                self._counted.pop(executor_id, None)
                self._unlisted.pop(executor_id, None)

    def _set_timer(self, node: _Node, kind: str, due: int) -> None:
        self._timer_seq += 1
        plan = node.plan
        heapq.heappush(self._timers, (due, self._timer_seq, kind, plan.session_id, plan.plan_id, node.id, node.attempt))
        if len(self._timers) > self._timers_compact_at:
            self._timers = [t for t in self._timers if self._timer_matters(t)]
            heapq.heapify(self._timers)  # (due, seq) is unique: the same pops, in the same order, as before
            self._timers_compact_at = max(4096, 2 * len(self._timers))

    def _timer_matters(self, timer: tuple[int, int, str, str, str, str, int]) -> bool:
        """Whether a timer can still fire (the test `_advance` applies when it is due)."""
        due, _, kind, session_id, plan_id, subgoal_id, attempt = timer
        plan = self._plans.get((session_id, plan_id))
        node = plan.nodes[subgoal_id] if plan is not None else None
        if node is None or node.attempt != attempt:
            return False
        if kind == "retry":
            return node.state is NodeState.BACKOFF
        return node.state in LIVE and due == node.last_seen + node.deadline_us

    def _make_ready(self, node: _Node) -> None:
        node.state = NodeState.READY
        node.ready_at = self.now
        self._ready_gen += 1
        node.ready_gen = self._ready_gen
        self._ready.setdefault(node.resource_class, _ReadyQueue()).add(node)
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

    def _let_go(self, node: _Node, zombie_from: int | None = None) -> None:
        """The current attempt ended: stop counting it, or (timed out, superseded: its executor may still run it)
        count it until its executor says, in a heartbeat sent at or after `zombie_from`, that it does not run it."""
        executor_id, key = node.executor_id, node.attempt_key
        if executor_id is None or key not in self._counted.get(executor_id, {}):
            return
        if zombie_from is not None:
            self._counted[executor_id][key] = (node.profile, zombie_from)
            return
        self._drop_hold(key, executor_id)

    def _drop_hold(self, key: str, executor_id: str | None = None) -> None:
        """An attempt ended (its executor reported it): what it held is free again."""
        holders = [executor_id] if executor_id is not None else [e for e in self._counted if key in self._counted[e]]
        for holder in holders:
            profile, _ = self._counted[holder].pop(key)
            executor = self._executors[holder]
            if key not in executor.running:
                self._unlisted[holder] = self._unlisted[holder] - profile
            self._dirty.add(executor.resource_class)

    def _release(self, out: list[Decision]) -> None:
        """Release every ready subgoal that fits: first those that waited `aging_s` or more, oldest first, then the
        rest in plan then subgoal order (a smaller one may pass a larger one that waited less than `aging_s`)."""
        dirty, self._dirty = self._dirty, set()
        for resource_class in sorted(dirty):
            queue = self._ready.get(resource_class)
            if queue is None:
                continue
            if queue.nodes:
                free = self.available(resource_class)
                floor = self._floor[resource_class]  # no ready subgoal of the class needs less than this
                if any(left.covers(floor) for left in free.values()):
                    aged_since = self.now - self._aging_us  # ready at or before this: waited aging_s or more
                    if queue.by_age and queue.by_age[0][0] <= aged_since:
                        self._release_aged(queue, free, floor, aged_since, out)
                    if free:
                        self._release_in_order(queue, free, out)
            if not queue.nodes:
                queue.clear()

    def _release_in_order(self, queue: _ReadyQueue, free: dict[str, Resources], out: list[Decision]) -> None:
        """Release, in plan then subgoal order, each ready subgoal whose profile fits some room (best fit, ties by
        executor id). Rooms only shrink during a pass, so this is the walk in that order skipping what does not
        fit; it looks only at the first entry of each distinct profile that still fits somewhere."""
        fitting = [p for p in queue.by_profile if any(room.covers(p) for room in free.values())]
        while fitting:
            first = None
            for profile in fitting:
                head = queue.head(profile)
                if head is not None and (first is None or head < first[0]):
                    first = (head, profile)
            if first is None:
                return
            (seq, index, _), need = first
            heapq.heappop(queue.by_profile[need])
            node = queue.nodes.pop((seq, index))
            left, executor_id = min((left - need, eid) for eid, left in free.items() if left.covers(need))
            free[executor_id] = left  # best fit: the least capacity left over, then the executor id
            self._release_one(node, executor_id, out)
            fitting = [p for p in fitting if p in queue.by_profile and any(r.covers(p) for r in free.values())]

    def _release_aged(
        self, queue: _ReadyQueue, free: dict[str, Resources], floor: Resources, aged_since: int, out: list[Decision]
    ) -> None:
        """Release the subgoals that waited `aging_s` or more, oldest first. One that does not fit reserves the
        executor nearest to holding it: later subgoals are not counted against that executor in this pass, so its
        room grows until the aged one fits."""
        heap, skipped = queue.by_age, []
        while heap and heap[0][0] <= aged_since:
            entry = heapq.heappop(heap)
            node = queue.current(entry[2], entry[3], entry[1])
            if node is None:
                continue  # released, or ready again since
            need = node.profile
            fits = [(left - need, eid) for eid, left in free.items() if left.covers(need)]
            if fits:
                left, executor_id = min(fits)
                free[executor_id] = left
                del queue.nodes[(node.plan.seq, node.index)]
                self._release_one(node, executor_id, out)
            else:
                skipped.append(entry)
                reserved = self._nearest(need, free)
                if reserved is None:
                    continue  # no live executor could ever hold it: let the others pass
                del free[reserved]
            if not any(room.covers(floor) for room in free.values()):
                break  # nothing left can fit anywhere
        for entry in skipped:
            heapq.heappush(heap, entry)

    def _nearest(self, need: Resources, free: dict[str, Resources]) -> str | None:
        """The executor (among `free`) whose capacity covers `need` and that misses the least of it now."""
        best = None
        for eid, room in free.items():
            if self._executors[eid].capacity.covers(need):
                short = Resources(
                    max(0, need.gpu_memory_mb - room.gpu_memory_mb), max(0, need.gpus - room.gpus),
                    max(0, need.cpu - room.cpu),
                )  # fmt: skip
                if best is None or (short, eid) < best:
                    best = (short, eid)
        return best[1] if best is not None else None

    def _release_one(self, node: _Node, executor_id: str, out: list[Decision]) -> None:
        node.attempt += 1
        node.state = NodeState.RELEASED
        node.executor_id = executor_id
        node.last_seen = self.now
        node.plan.released += 1
        self._hold(node)
        node.armed = not self.delivery_markers  # else the deadline waits for the marker (or a sign of life)
        if node.armed:
            self._set_timer(node, "deadline", self.now + node.deadline_us)
        work = node.work
        out.append(self._decision(node, SUBGOAL_RELEASED, "released", {
            "attempt": node.attempt, "resource_class": node.resource_class,
            "work_topic": f"{self.work_topic_prefix}.{node.resource_class}", "executor_id": executor_id,
            "tool": work.get("tool"), "agent": work.get("agent"), "params_json": work.get("params_json", "{}"),
            "profile": node.profile.record(), "deadline_s": float(node.spec["deadline_s"]),
            "fallback": node.on_fallback, "released_at": self.now,
        }))  # fmt: skip

    def _succeed(self, node: _Node, out: list[Decision], late: bool = False) -> None:
        """The subgoal's work is done: by its current attempt, or (`late`) by an earlier one. After a late success
        a current attempt still out is superseded: it holds its room like a timed-out one until its executor drops
        it; a subgoal waiting to be released or retried is not released again."""
        if node.state in LIVE:
            # superseded: work not started by its deadline is dropped by its executor, so it holds until then
            self._let_go(node, node.last_seen + node.deadline_us if late else None)
        elif node.state is NodeState.READY:
            queue = self._ready[node.resource_class]
            del queue.nodes[(node.plan.seq, node.index)]
            self._dirty.add(node.resource_class)  # (so the pass drops its queue's entries once it is empty)
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
        self._let_go(node, self.now if timed_out else None)
        node.error_class = error_class
        node.tries += 1
        retry = node.spec.get("retry") or {}
        if node.tries < int(retry.get("max_attempts", 1)) and not self._advised(node):
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
            node.reroute()
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
        """Emit PlanFinished once every subgoal ended, and keep only what recognises a redelivery of the plan."""
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
        key = (plan.session_id, plan.plan_id)
        del self._plans[key]
        self._finished[key] = _FinishedPlan(
            plan.digest, self.now, tuple(plan.nodes), tuple(n.state for n in plan.nodes.values())
        )
        self._forget_finished()

    def _decision(self, node: _Node, schema: str, kind: str, fields: dict[str, Any]) -> Decision:
        plan = node.plan
        record = {
            "decision_id": f"{plan.session_id}/{plan.plan_id}/{node.id}/{node.attempt}/{kind}",
            "session_id": plan.session_id, "episode_id": plan.episode_id, "plan_id": plan.plan_id,
            "subgoal_id": node.id, **fields,
        }  # fmt: skip
        return Decision(schema, plan.session_id, record)
