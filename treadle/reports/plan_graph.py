"""A plan's DAG as `treadle plan show` draws it: layers by dependency depth and the critical path. Pure: no I/O.

The critical path of a plan is its longest chain of dependencies by duration, a subgoal's duration being the time
from when it became ready (its dependencies succeeded) to when it ended (succeeded or escalated). ClickHouse has no
sane way to take a longest path over a DAG, so it is computed here from the rows of plan_subgoals_latest and
subgoal_state_history (treadle.reports.plan_view reads them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime


class PlanGraphError(ValueError):
    """The stored plan is not a DAG (a refused plan: a cycle or an unknown dependency)."""


def layers(depends_on: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """Subgoal ids by dependency depth: layer 0 depends on nothing, a subgoal sits one layer below its deepest
    dependency. Within a layer, the order of `depends_on` (the plan's order)."""
    depth: dict[str, int] = {}
    for sid in _topological(depends_on):
        depth[sid] = 1 + max((depth[d] for d in depends_on[sid]), default=-1)
    out: list[list[str]] = [[] for _ in range(1 + max(depth.values(), default=-1))]
    for sid in depends_on:
        out[depth[sid]].append(sid)
    return out


def critical_path(depends_on: Mapping[str, Sequence[str]], duration: Mapping[str, float]) -> tuple[list[str], float]:
    """(the chain, its total duration): the path through the DAG, along dependency edges, whose durations sum the
    most. Missing durations count as 0; ties go to the subgoal earlier in the plan's order."""
    order = {sid: i for i, sid in enumerate(depends_on)}
    best: dict[str, tuple[float, list[str]]] = {}
    for sid in _topological(depends_on):
        before = max(
            (best[d] for d in sorted(depends_on[sid], key=order.__getitem__)),
            key=lambda found: found[0],
            default=(0.0, []),
        )
        best[sid] = (before[0] + max(0.0, duration.get(sid, 0.0)), [*before[1], sid])
    if not best:
        return [], 0.0
    total, path = max((best[sid] for sid in depends_on), key=lambda found: found[0])
    return path, total


def _topological(depends_on: Mapping[str, Sequence[str]]) -> list[str]:
    """Every subgoal after its dependencies (Kahn, in the plan's order); PlanGraphError for a cycle or an unknown
    dependency."""
    for sid, deps in depends_on.items():
        unknown = [d for d in deps if d not in depends_on]
        if unknown:
            raise PlanGraphError(f"subgoal {sid!r} depends on unknown subgoal {unknown[0]!r} (a refused plan?)")
    waiting = {sid: len(set(deps)) for sid, deps in depends_on.items()}
    dependents: dict[str, list[str]] = {sid: [] for sid in depends_on}
    for sid, deps in depends_on.items():
        for d in set(deps):
            dependents[d].append(sid)
    order = {sid: i for i, sid in enumerate(depends_on)}
    ready = [sid for sid, n in waiting.items() if n == 0]
    out: list[str] = []
    while ready:
        ready.sort(key=order.__getitem__, reverse=True)
        sid = ready.pop()
        out.append(sid)
        for dependent in dependents[sid]:
            waiting[dependent] -= 1
            if waiting[dependent] == 0:
                ready.append(dependent)
    if len(out) != len(depends_on):
        stuck = sorted(set(depends_on) - set(out), key=order.__getitem__)
        raise PlanGraphError(f"the plan's dependencies have a cycle through {', '.join(stuck)} (a refused plan?)")
    return out


@dataclass(frozen=True)
class Attempt:
    """One released attempt of a subgoal (a plan_attempts row)."""

    attempt: int
    executor_id: str
    resource_class: str
    outcome: str  # SUCCEEDED, FAILED, TIMED_OUT, or empty while it runs
    error_class: str
    duration_s: float | None  # released -> ended
    fallback: bool = False
    succeeded_late: bool = False  # timed out, then reported success: the subgoal took it (slow, not dead)


@dataclass(frozen=True)
class Interval:
    """One state of a subgoal with its validity range (a subgoal_state_history row), in UTC microseconds."""

    state: str
    attempt: int
    valid_from: int
    valid_to: int | None  # None: still current


@dataclass
class SubgoalView:
    subgoal_id: str
    depends_on: tuple[str, ...]
    resource_class: str
    tool: str
    history: list[Interval] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    steps: int = 0  # step-path dispatches of its attempts (plan_subgoal_rewards)
    rewarded_steps: int = 0  # those with a woven reward
    reward_sum: float = 0.0  # sum of their fused rewards, last revision

    @property
    def state(self) -> str:
        return self.history[-1].state if self.history else "WAITING"

    @property
    def ready_at(self) -> int | None:
        return next((i.valid_from for i in self.history if i.state == "READY"), None)

    @property
    def ended_at(self) -> int | None:
        return next((i.valid_from for i in self.history if i.state in ("SUCCEEDED", "ESCALATED")), None)

    @property
    def duration_s(self) -> float | None:
        """Ready -> succeeded or escalated (None until then): its weight on the critical path."""
        ready, ended = self.ready_at, self.ended_at
        return None if ready is None or ended is None else max(0, ended - ready) / 1e6


@dataclass
class PlanView:
    session_id: str
    plan_id: str
    goal: str
    submitted_at: int
    subgoals: dict[str, SubgoalView]
    outcome: str = ""  # SUCCEEDED or FAILED once finished
    finished_at: int | None = None

    @property
    def depends_on(self) -> dict[str, list[str]]:
        return {sid: list(s.depends_on) for sid, s in self.subgoals.items()}

    def critical_path(self) -> tuple[list[str], float]:
        durations = {sid: s.duration_s or 0.0 for sid, s in self.subgoals.items()}
        return critical_path(self.depends_on, durations)

    def layers(self) -> list[list[str]]:
        return layers(self.depends_on)


def render_text(plan: PlanView) -> list[str]:
    """The plan as lines of text: a header, the critical path, then each layer's subgoals with state, attempts,
    durations and (for subgoals whose executors dispatched steps) the sum of their steps' rewards; `*` marks the
    subgoals on the critical path."""
    path, total = plan.critical_path()
    on_path = set(path)
    status = plan.outcome or "RUNNING"
    header = f"plan {plan.plan_id} (session {plan.session_id}): {status}, {len(plan.subgoals)} subgoals, submitted " \
             f"{_iso(plan.submitted_at)}"  # fmt: skip
    if plan.finished_at is not None:
        header += f", finished after {(plan.finished_at - plan.submitted_at) / 1e6:.1f} s"
    lines = [header]
    if plan.goal:
        lines.append(f"goal: {plan.goal}")
    label = "critical path" if plan.finished_at is not None else "critical path so far (plan not finished)"
    lines.append(f"{label}: {' -> '.join(path) or '-'} ({total:.1f} s)")
    for depth, ids in enumerate(plan.layers()):
        lines.append(f"layer {depth}")
        for sid in ids:
            s = plan.subgoals[sid]
            mark = "*" if sid in on_path else " "
            took = "-" if s.duration_s is None else f"{s.duration_s:.1f} s"
            deps = f"  <- {', '.join(s.depends_on)}" if s.depends_on else ""
            reward = f"  reward {s.reward_sum:.2f} ({s.rewarded_steps}/{s.steps} steps)" if s.steps else ""
            lines.append(
                f"  {mark} {sid}  {s.state}  [{s.resource_class}]  {len(s.attempts)} attempt(s)  {took}{reward}{deps}"
            )
            for a in s.attempts:
                what = a.outcome or "open"
                if a.error_class and a.outcome in ("FAILED", "TIMED_OUT"):
                    what += f" ({a.error_class})"
                ran = "" if a.duration_s is None else f" {a.duration_s:.1f} s"
                spare = " fallback" if a.fallback else ""
                late = ", succeeded late" if a.succeeded_late else ""
                lines.append(f"      #{a.attempt}{spare} on {a.executor_id or '?'}: {what}{ran}{late}")
    return lines


def _iso(micros: int) -> str:
    return datetime.fromtimestamp(micros / 1e6, UTC).isoformat(timespec="seconds")
