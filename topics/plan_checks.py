"""What makes a submitted plan runnable: the refusals the plans scheduler and the SDK's `submit_plan` share.

Pure (no I/O) and here, in the contract layer, so the SDK can refuse a cyclic or malformed plan before it is sent
with the very reasons the scheduler would dead-letter it with (`PlanScheduler` calls `validate_plan` too).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


class PlanRefused(ValueError):
    """A submitted plan the scheduler cannot run (cycle, unknown dependency, bad policy): it becomes a dead letter."""

    def __init__(self, plan_id: str, reason: str) -> None:
        super().__init__(f"plan {plan_id!r} refused: {reason}")
        self.plan_id = plan_id
        self.reason = reason


def validate_plan(plan_id: str, subgoals: Iterable[dict[str, Any]]) -> None:
    """Raise PlanRefused with the first reason the plan cannot run: ids, dependencies, cycles, policies.

    `subgoals` are PlanSubmitted's Subgoal records (Avro field names)."""
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
        profile = work["profile"]
        amounts = (profile.get("gpu_memory_mb", 0), profile.get("gpus", 0), profile.get("cpu", 0))
        if min(int(amount) for amount in amounts) < 0:
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


def attempt_key(session_id: str, plan_id: str, subgoal_id: str, attempt: int) -> str:
    """How heartbeats name an attempt in `running`: session_id/plan_id/subgoal_id/attempt."""
    return f"{session_id}/{plan_id}/{subgoal_id}/{attempt}"
