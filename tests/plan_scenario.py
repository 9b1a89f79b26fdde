"""Two plans run through the real scheduler fold (processors.plans.dag.PlanScheduler), for the plan tables' tests.

p-ok (4 subgoals) succeeds after a failed attempt (OOM, retried after a backoff) and a timed-out attempt (retried;
its slow executor then reports success, which completes the subgoal while the retry runs); p-bad (3 subgoals)
escalates one subgoal, cancelling its dependent. One CPU slot shared by both plans makes p-bad's subgoals queue.
Event times are seconds after T0, which is on a whole minute.
"""

from __future__ import annotations

from typing import Any

from processors.plans.dag import MICROS, Decision, PlanScheduler
from topics.names import EXECUTOR_HEARTBEAT, PLAN_SUBMITTED, SUBGOAL_STATUS

T0 = 1_800_000_000 * MICROS
SESSION = "s-plans"


def at(seconds: float) -> int:
    return T0 + round(seconds * MICROS)


def envelope(seconds: float, logical: str, n: int) -> dict[str, Any]:
    return {
        "event_id": f"0190b6c2-0000-7000-8000-{n:012d}", "session_id": SESSION, "agent_id": "planner",
        "episode_id": "ep-1", "logical_event_id": logical, "seq": n, "event_time": at(seconds),
        "policy_version": "", "trace_id": "", "attributes": {},
    }  # fmt: skip


def subgoal(sid: str, *deps: str, cls: str = "cpu", gpu_mb: int = 0, gpus: int = 0, deadline_s: float = 30.0,
            attempts: int = 1, backoff_s: float = 0.0) -> dict[str, Any]:  # fmt: skip
    return {
        "subgoal_id": sid, "tool": f"tool_{sid}", "agent": None, "params_json": "{}", "resource_class": cls,
        "profile": {"gpu_memory_mb": gpu_mb, "gpus": gpus, "cpu": 1}, "deadline_s": deadline_s,
        "retry": {"max_attempts": attempts, "backoff_s": backoff_s, "backoff_multiplier": 2.0},
        "fallback": None, "depends_on": list(deps),
    }  # fmt: skip


PLANS = {
    "p-ok": [
        subgoal("fetch"),
        subgoal("train", "fetch", cls="gpu", gpu_mb=12_000, gpus=1, attempts=2, backoff_s=2.0),
        subgoal("lint", "fetch", deadline_s=5.0, attempts=2),
        subgoal("report", "train", "lint"),
    ],
    "p-bad": [subgoal("a"), subgoal("b", "a"), subgoal("c")],
}


def inputs() -> list[tuple[str, dict[str, Any]]]:
    """The plan_events log, in order: (schema, record)."""
    n = iter(range(1, 10_000))

    def plan(seconds: float, plan_id: str) -> tuple[str, dict[str, Any]]:
        return PLAN_SUBMITTED, {"envelope": envelope(seconds, plan_id, next(n)), "plan_id": plan_id,
                                "goal": f"goal of {plan_id}", "subgoals": PLANS[plan_id]}  # fmt: skip

    def status(seconds: float, plan_id: str, sid: str, attempt: int, state: str, executor: str,
               error_class: str | None = None) -> tuple[str, dict[str, Any]]:  # fmt: skip
        return SUBGOAL_STATUS, {
            "envelope": envelope(seconds, plan_id, next(n)), "plan_id": plan_id, "subgoal_id": sid,
            "attempt": attempt, "state": state, "executor_id": executor,
            "output_ref": f"ref://{sid}/{attempt}" if state == "SUCCEEDED" else None, "error_class": error_class,
            "error": "boom" if state == "FAILED" else None,
        }  # fmt: skip

    def heartbeat(seconds: float, executor: str, cls: str, gpu_mb: int, gpus: int) -> tuple[str, dict[str, Any]]:
        return EXECUTOR_HEARTBEAT, {
            "executor_id": executor, "resource_class": cls, "free_gpu_memory_mb": gpu_mb, "free_gpus": gpus,
            "free_cpu": 1, "running": [], "valid_for_s": 1e6, "host": "h1", "sent_at": at(seconds),
        }  # fmt: skip

    return [
        heartbeat(0, "cpu-1", "cpu", 0, 0),
        heartbeat(0, "gpu-1", "gpu", 16_000, 1),
        plan(1, "p-ok"),  # fetch released at 1
        plan(2, "p-bad"),  # a and c wait for the CPU slot
        status(2, "p-ok", "fetch", 1, "RUNNING", "cpu-1"),
        status(4, "p-ok", "fetch", 1, "SUCCEEDED", "cpu-1"),  # train and lint released at 4
        status(5, "p-ok", "train", 1, "RUNNING", "gpu-1"),
        status(5, "p-ok", "lint", 1, "RUNNING", "cpu-1"),  # lint's last sign of life: timed out at 10
        status(6, "p-ok", "train", 1, "HEARTBEAT", "gpu-1"),
        status(7, "p-ok", "train", 1, "FAILED", "gpu-1", "OOM"),  # retried at 7 + 2
        heartbeat(9, "gpu-1", "gpu", 14_000, 1),  # the clock reaches 9: train attempt 2 released
        heartbeat(10, "cpu-1", "cpu", 0, 0),  # lint times out at 10, retried at once, attempt 2 released
        status(11, "p-ok", "train", 2, "RUNNING", "gpu-1"),
        status(11, "p-ok", "lint", 2, "RUNNING", "cpu-1"),
        status(12, "p-ok", "lint", 1, "SUCCEEDED", "cpu-1"),  # the timed-out attempt was slow: lint succeeded
        status(13, "p-ok", "lint", 2, "SUCCEEDED", "cpu-1"),  # the superseded retry ends: a released at 13
        status(14, "p-bad", "a", 1, "RUNNING", "cpu-1"),
        status(15, "p-bad", "a", 1, "FAILED", "cpu-1", "ToolError"),  # escalated, b cancelled; c released
        status(16, "p-bad", "c", 1, "RUNNING", "cpu-1"),
        status(18, "p-bad", "c", 1, "SUCCEEDED", "cpu-1"),  # p-bad finished (FAILED)
        status(20, "p-ok", "train", 2, "SUCCEEDED", "gpu-1"),  # report released at 20
        status(21, "p-ok", "report", 1, "RUNNING", "cpu-1"),
        status(23, "p-ok", "report", 1, "SUCCEEDED", "cpu-1"),  # p-ok finished (SUCCEEDED)
    ]


def run() -> tuple[PlanScheduler, list[tuple[str, dict[str, Any]]], list[Decision]]:
    """The scheduler after the whole log, the log, and every decision it made, in order."""
    scheduler = PlanScheduler()
    log = inputs()
    decisions = [d for schema, record in log for d in scheduler.apply(schema, record)]
    return scheduler, log, decisions
