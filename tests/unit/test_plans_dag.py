"""The plans scheduler's DAG fold (processors.plans.dag): release rule, admission control, retries, timeouts, fallback,
escalation and refusals, then hypothesis properties against a simulated set of executors (no broker)."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from processors.plans.dag import MICROS, Decision, NodeState, PlanRefused, PlanScheduler, Resources, attempt_key
from topics.codec import AvroCodec
from topics.names import (
    EXECUTOR_HEARTBEAT,
    PLAN_FINISHED,
    PLAN_SUBMITTED,
    RELEASE_DELIVERED,
    SUBGOAL_ESCALATED,
    SUBGOAL_RELEASED,
    SUBGOAL_REROUTED,
    SUBGOAL_RETRIED,
    SUBGOAL_STATUS,
    SUBGOAL_TIMED_OUT,
)

CODEC = AvroCodec()
T0 = 1_800_000_000 * MICROS
SESSION = "s1"


def at(seconds: float) -> int:
    return T0 + round(seconds * MICROS)


def envelope(event_time: int, logical: str, session: str = SESSION) -> dict[str, Any]:
    return {
        "event_id": f"0190b6c2-0000-7000-8000-{abs(hash((logical, event_time))) % 10**12:012d}",
        "session_id": session, "agent_id": "planner", "episode_id": "e1", "logical_event_id": logical, "seq": 1,
        "event_time": event_time, "policy_version": "", "trace_id": "", "attributes": {},
    }  # fmt: skip


def subgoal(sid: str, *deps: str, gpu_mb: int = 0, gpus: int = 0, cpu: int = 1, cls: str = "cpu",
            deadline_s: float = 10.0, attempts: int = 1, backoff_s: float = 0.0, fallback: dict | None = None,
            params: str = "{}") -> dict[str, Any]:  # fmt: skip
    return {
        "subgoal_id": sid, "tool": f"tool_{sid}", "agent": None, "params_json": params, "resource_class": cls,
        "profile": {"gpu_memory_mb": gpu_mb, "gpus": gpus, "cpu": cpu}, "deadline_s": deadline_s,
        "retry": {"max_attempts": attempts, "backoff_s": backoff_s, "backoff_multiplier": 2.0},
        "fallback": fallback, "depends_on": list(deps),
    }  # fmt: skip


def fallback(tool: str = "backup", cls: str = "cpu", cpu: int = 1, gpu_mb: int = 0) -> dict[str, Any]:
    return {"tool": tool, "agent": None, "params_json": "{}", "resource_class": cls,
            "profile": {"gpu_memory_mb": gpu_mb, "gpus": 0, "cpu": cpu}}  # fmt: skip


def plan(plan_id: str, subgoals: list[dict[str, Any]], t: float = 0.0, session: str = SESSION) -> dict[str, Any]:
    return {"envelope": envelope(at(t), plan_id, session), "plan_id": plan_id, "goal": "", "subgoals": subgoals}


def status(plan_id: str, sid: str, attempt: int, state: str, t: float, error_class: str | None = None,
           session: str = SESSION) -> dict[str, Any]:  # fmt: skip
    return {
        "envelope": envelope(at(t), plan_id, session), "plan_id": plan_id, "subgoal_id": sid, "attempt": attempt,
        "state": state, "executor_id": "x", "output_ref": "ref" if state == "SUCCEEDED" else None,
        "error_class": error_class, "error": None,
    }  # fmt: skip


def heartbeat(executor: str, t: float, cls: str = "cpu", gpu_mb: int = 0, gpus: int = 0, cpu: int = 4,
              running: tuple[str, ...] = (), valid_for_s: float = 1e6) -> dict[str, Any]:  # fmt: skip
    return {
        "executor_id": executor, "resource_class": cls, "free_gpu_memory_mb": gpu_mb, "free_gpus": gpus,
        "free_cpu": cpu, "running": list(running), "valid_for_s": valid_for_s, "host": "h", "sent_at": at(t),
    }  # fmt: skip


def marker(plan_id: str, sid: str, attempt: int, t: float, session: str = SESSION) -> dict[str, Any]:
    """The ReleaseDelivered the plans processor appends once it sent a release."""
    return {"decision_id": f"{session}/{plan_id}/{sid}/{attempt}/released", "session_id": session,
            "plan_id": plan_id, "subgoal_id": sid, "attempt": attempt, "sent_at": at(t)}  # fmt: skip


def kinds(decisions: list[Decision]) -> list[tuple[str, str]]:
    short = {SUBGOAL_RELEASED: "released", SUBGOAL_RETRIED: "retried", SUBGOAL_REROUTED: "rerouted",
             SUBGOAL_TIMED_OUT: "timed_out", SUBGOAL_ESCALATED: "escalated", PLAN_FINISHED: "finished"}  # fmt: skip
    return [(short[d.schema], d.record.get("subgoal_id", "")) for d in decisions]


def encodable(decisions: list[Decision]) -> list[Decision]:
    """Every decision is a valid record of its schema (round trip through the Avro codec)."""
    for d in decisions:
        assert (
            CODEC.decode(CODEC.encode(d.schema, d.record), expect=d.schema)[1]["decision_id"] == d.record["decision_id"]
        )
    return decisions


# -- the release rule -----------------------------------------------------------------------------------------------


def test_subgoals_are_released_when_their_dependencies_succeed() -> None:
    s = PlanScheduler()
    assert s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 0, cpu=8)) == []
    out = encodable(s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a"), subgoal("b", "a"), subgoal("c", "a", "b")])))
    assert kinds(out) == [("released", "a")]
    released = out[0].record
    assert (released["attempt"], released["work_topic"], released["executor_id"]) == (1, "treadle.work.cpu", "cpu-1")
    assert released["decision_id"] == "s1/p/a/1/released" and out[0].key == SESSION
    assert kinds(s.apply(SUBGOAL_STATUS, status("p", "a", 1, "SUCCEEDED", 1))) == [("released", "b")]
    assert s.apply(SUBGOAL_STATUS, status("p", "a", 1, "SUCCEEDED", 1)) == []  # a duplicate changes nothing
    assert kinds(s.apply(SUBGOAL_STATUS, status("p", "b", 1, "SUCCEEDED", 2))) == [("released", "c")]
    out = encodable(s.apply(SUBGOAL_STATUS, status("p", "c", 1, "SUCCEEDED", 3)))
    assert kinds(out) == [("finished", "")]
    assert out[0].record["outcome"] == "SUCCEEDED" and out[0].record["succeeded"] == ["a", "b", "c"]
    assert out[0].record["attempts"] == 3 and out[0].record["finished_at"] == at(3)


def test_nothing_is_released_without_a_live_executor_of_its_class() -> None:
    s = PlanScheduler()
    assert s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a", cls="gpu", gpu_mb=10)])) == []
    assert s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 1)) == []  # another class
    assert kinds(s.apply(EXECUTOR_HEARTBEAT, heartbeat("gpu-1", 2, cls="gpu", gpu_mb=10, valid_for_s=5))) == [
        ("released", "a")
    ]
    s2 = PlanScheduler()
    s2.apply(EXECUTOR_HEARTBEAT, heartbeat("gpu-1", 0, cls="gpu", gpu_mb=10, valid_for_s=5))
    assert s2.tick(at(5)) == []  # the advertisement expired: the executor counts as gone
    assert s2.apply(PLAN_SUBMITTED, plan("p", [subgoal("a", cls="gpu", gpu_mb=10)], t=5)) == []


def test_admission_never_oversubscribes_gpu_memory_and_counts_what_is_held() -> None:
    s = PlanScheduler()
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("gpu-1", 0, cls="gpu", gpu_mb=80_000, gpus=2, cpu=8))
    big = [subgoal(n, cls="gpu", gpu_mb=50_000, gpus=1) for n in ("a", "b")] + [subgoal("c", cls="gpu", gpu_mb=30_000)]
    out = s.apply(PLAN_SUBMITTED, plan("p", big))
    assert kinds(out) == [("released", "a"), ("released", "c")]  # b would not fit beside a; c does (backfill)
    assert s.available("gpu") == {"gpu-1": Resources(0, 1, 6)}
    # the executor now lists a and c as running and advertises what is left: nothing is counted twice
    running = (attempt_key(SESSION, "p", "a", 1), attempt_key(SESSION, "p", "c", 1))
    assert s.apply(EXECUTOR_HEARTBEAT, heartbeat("gpu-1", 1, "gpu", gpu_mb=0, gpus=1, cpu=6, running=running)) == []
    assert s.available("gpu") == {"gpu-1": Resources(0, 1, 6)}
    assert s.apply(SUBGOAL_STATUS, status("p", "a", 1, "SUCCEEDED", 2)) == []  # a's memory is not advertised yet
    assert kinds(s.apply(EXECUTOR_HEARTBEAT, heartbeat("gpu-1", 3, "gpu", gpu_mb=50_000, gpus=2, cpu=7,
                                                       running=running[1:])))  == [("released", "b")]  # fmt: skip


def test_a_late_older_advertisement_changes_nothing() -> None:
    s = PlanScheduler()
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("gpu-1", 5, cls="gpu", gpu_mb=10))
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("gpu-1", 4, cls="gpu", gpu_mb=99))
    assert s.available("gpu") == {"gpu-1": Resources(10, 0, 4)}


def test_best_fit_picks_the_executor_left_with_least() -> None:
    s = PlanScheduler()
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("big", 0, cls="gpu", gpu_mb=80_000, gpus=1))
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("small", 0, cls="gpu", gpu_mb=24_000, gpus=1))
    out = s.apply(
        PLAN_SUBMITTED, plan("p", [subgoal("a", cls="gpu", gpu_mb=20_000), subgoal("b", cls="gpu", gpu_mb=60_000)])
    )
    assert [d.record["executor_id"] for d in out] == ["small", "big"]


# -- retries, timeouts, fallback, escalation ----------------------------------------------------------------------


def test_failures_retry_after_an_event_time_backoff_then_escalate_and_cancel_dependents() -> None:
    s = PlanScheduler()
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 0))
    s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a", attempts=3, backoff_s=2), subgoal("b", "a"), subgoal("c", "b"),
                                        subgoal("d", deadline_s=60)]))  # fmt: skip
    out = encodable(s.apply(SUBGOAL_STATUS, status("p", "a", 1, "FAILED", 1, "OOM")))
    assert kinds(out) == [("retried", "a")]
    assert (out[0].record["next_attempt"], out[0].record["retry_at"], out[0].record["error_class"]) == (2, at(3), "OOM")
    assert s.tick(at(2.9)) == []
    assert kinds(s.tick(at(3))) == [("released", "a")]
    assert kinds(s.apply(SUBGOAL_STATUS, status("p", "a", 2, "FAILED", 4, "OOM"))) == [("retried", "a")]
    assert s.tick(at(7.9)) == []  # the second backoff is twice the first: 4 s
    assert kinds(s.tick(at(8))) == [("released", "a")]
    assert s.apply(SUBGOAL_STATUS, status("p", "a", 1, "SUCCEEDED", 8)) == []  # a stale attempt's report: ignored
    out = encodable(s.apply(SUBGOAL_STATUS, status("p", "a", 3, "FAILED", 9, "OOM")))
    assert kinds(out) == [("escalated", "a")]
    assert out[0].record["cancelled"] == ["b", "c"] and out[0].record["attempts"] == 3
    out = encodable(s.apply(SUBGOAL_STATUS, status("p", "d", 1, "SUCCEEDED", 10)))
    assert kinds(out) == [("finished", "")]
    assert (out[0].record["outcome"], out[0].record["escalated"], out[0].record["cancelled"]) == (
        "FAILED",
        ["a"],
        ["b", "c"],
    )
    assert s.subgoal_states(SESSION, "p") == {"a": NodeState.ESCALATED, "b": NodeState.CANCELLED,
                                              "c": NodeState.CANCELLED, "d": NodeState.SUCCEEDED}  # fmt: skip


def test_a_spent_subgoal_is_rerouted_to_its_fallback_on_the_fallbacks_class() -> None:
    s = PlanScheduler()
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("gpu-1", 0, cls="gpu", gpu_mb=40_000, gpus=1))
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 0))
    s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a", cls="gpu", gpu_mb=40_000, fallback=fallback("cpu_solver"))]))
    out = encodable(s.apply(SUBGOAL_STATUS, status("p", "a", 1, "FAILED", 1, "CUDAError")))
    assert kinds(out) == [("rerouted", "a"), ("released", "a")]
    assert (out[0].record["tool"], out[0].record["next_attempt"]) == ("cpu_solver", 2)
    released = out[1].record
    assert (released["attempt"], released["tool"], released["resource_class"], released["fallback"]) == (
        2, "cpu_solver", "cpu", True)  # fmt: skip
    assert released["profile"] == {"gpu_memory_mb": 0, "gpus": 0, "cpu": 1}
    out = s.apply(SUBGOAL_STATUS, status("p", "a", 2, "FAILED", 2, "ToolError"))
    assert kinds(out) == [("escalated", "a"), ("finished", "")]


def test_an_attempt_without_a_sign_of_life_past_its_deadline_is_timed_out_and_retried() -> None:
    s = PlanScheduler()
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 0))
    s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a", deadline_s=10, attempts=2)]))
    assert s.apply(SUBGOAL_STATUS, status("p", "a", 1, "RUNNING", 5)) == []
    assert s.tick(at(14.9)) == []  # the running report pushed the deadline to 15
    assert s.apply(SUBGOAL_STATUS, status("p", "a", 1, "HEARTBEAT", 14.9)) == []
    out = encodable(s.tick(at(24.9)))
    assert kinds(out) == [("timed_out", "a"), ("retried", "a"), ("released", "a")]
    assert (out[0].record["last_seen_at"], out[0].record["attempt"]) == (at(14.9), 1)
    assert out[1].record["error_class"] == "timeout" and out[2].record["attempt"] == 2
    assert s.apply(SUBGOAL_STATUS, status("p", "a", 2, "RUNNING", 25)) == []
    assert s.apply(SUBGOAL_STATUS, status("p", "a", 1, "HEARTBEAT", 25)) == []  # the stalled attempt woke up: too late
    assert kinds(s.apply(SUBGOAL_STATUS, status("p", "a", 2, "SUCCEEDED", 26))) == [("finished", "")]


def test_with_delivery_markers_a_deadline_runs_from_the_marker_not_the_release() -> None:
    """A worker catching up on a backlog releases at the backlog's old event time; heartbeats written during its
    outage (later in the log) must not time the attempt out before the release went out (its marker)."""
    s = PlanScheduler(delivery_markers=True)
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 0))
    out = s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a", deadline_s=4, attempts=2)]))
    assert kinds(out) == [("released", "a")] and out[0].record["released_at"] == at(0)
    for t in range(1, 21):  # the backlog: the executor heartbeated all along, the release had not gone out
        assert s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", t)) == []
    assert s.apply(RELEASE_DELIVERED, marker("p", "a", 1, 20)) == []  # sent at 20: the deadline is 24
    assert s.apply(RELEASE_DELIVERED, marker("p", "a", 1, 20)) == []  # a repeat changes nothing
    assert s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 23.9)) == []
    out = encodable(s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 24)))
    assert kinds(out) == [("timed_out", "a"), ("retried", "a"), ("released", "a")]
    assert out[0].record["last_seen_at"] == at(20)
    assert s.apply(RELEASE_DELIVERED, marker("p", "a", 1, 25)) == []  # not the current attempt: nothing
    assert s.apply(SUBGOAL_STATUS, status("p", "a", 2, "RUNNING", 25)) == []  # a sign of life arms it too
    assert s.tick(at(28.9)) == []
    assert s.apply(RELEASE_DELIVERED, marker("p", "a", 2, 26)) == []  # a later marker pushes the deadline to 30
    assert s.tick(at(29.9)) == []
    assert kinds(s.tick(at(30))) == [("timed_out", "a"), ("escalated", "a"), ("finished", "")]


def test_without_delivery_markers_the_same_backlog_times_the_attempt_out() -> None:
    s = PlanScheduler()
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 0))
    s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a", deadline_s=4, attempts=2)]))
    out = s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 4))
    assert kinds(out) == [("timed_out", "a"), ("retried", "a"), ("released", "a")]
    assert s.apply(RELEASE_DELIVERED, marker("p", "a", 1, 5)) == []  # the marker of a replaced attempt: nothing


def test_inputs_are_on_event_time_not_arrival_order_for_timers() -> None:
    """An input older than the clock does not move it back; timers fire when an input's event time passes them."""
    s = PlanScheduler()
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 0))
    s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a", deadline_s=10, attempts=1), subgoal("b", deadline_s=60)]))
    out = s.apply(SUBGOAL_STATUS, status("p", "b", 1, "SUCCEEDED", 30))  # its event time passes a's deadline
    assert kinds(out) == [("timed_out", "a"), ("escalated", "a"), ("finished", "")]
    assert s.now == at(30) and s.tick(at(1)) == [] and s.now == at(30)


# -- refusals -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("subgoals", "reason"),
    [
        ([subgoal("a", "b"), subgoal("b", "c"), subgoal("c", "a")], "dependency cycle: a -> b -> c -> a"),
        ([subgoal("a", "a")], "dependency cycle: a -> a"),
        ([subgoal("a"), subgoal("b", "zz")], "subgoal 'b' depends on unknown subgoal 'zz'"),
        ([subgoal("a"), subgoal("a")], "subgoal id 'a' appears twice"),
        ([], "the plan has no subgoals"),
        ([subgoal("a", attempts=0)], "subgoal 'a': retry.max_attempts must be at least 1"),
        ([subgoal("a", deadline_s=0)], "subgoal 'a': deadline_s must be a positive number, got 0.0"),
        ([subgoal("a", gpu_mb=-1)], "subgoal 'a': profile has a negative amount"),
        ([subgoal("a", params="[1]")], "subgoal 'a': params_json is not a JSON object"),
        ([subgoal("a", fallback={**fallback(), "params_json": "{"})], "subgoal 'a': fallback params_json is not JSON"),
    ],
)
def test_plans_that_cannot_run_are_refused_with_the_reason(subgoals: list[dict[str, Any]], reason: str) -> None:
    s = PlanScheduler()
    with pytest.raises(PlanRefused) as refused:
        s.apply(PLAN_SUBMITTED, plan("p", subgoals))
    assert refused.value.reason.startswith(reason) and refused.value.plan_id == "p"
    assert s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 0)) == []  # nothing of it was kept


def test_a_resubmitted_plan_is_a_redelivery_and_a_different_one_under_its_id_is_refused() -> None:
    s = PlanScheduler()
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 0))
    assert kinds(s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a")]))) == [("released", "a")]
    assert s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a")], t=1)) == []
    with pytest.raises(PlanRefused, match="a different plan was already submitted"):
        s.apply(PLAN_SUBMITTED, plan("p", [subgoal("b")]))
    assert kinds(s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a")], session="s2"))) == [("released", "a")]


def test_the_records_the_fold_takes_are_valid_avro() -> None:
    CODEC.decode(CODEC.encode(PLAN_SUBMITTED, plan("p", [subgoal("a", fallback=fallback())])), expect=PLAN_SUBMITTED)
    CODEC.decode(CODEC.encode(SUBGOAL_STATUS, status("p", "a", 1, "FAILED", 1, "OOM")), expect=SUBGOAL_STATUS)
    CODEC.decode(CODEC.encode(EXECUTOR_HEARTBEAT, heartbeat("x", 0, running=("s/p/a/1",))), expect=EXECUTOR_HEARTBEAT)


def test_a_timed_out_attempt_holds_its_capacity_until_its_executor_says_it_dropped_it() -> None:
    s = PlanScheduler()
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("gpu-1", 0, cls="gpu", gpu_mb=10_000))
    s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a", cls="gpu", gpu_mb=10_000, deadline_s=5, attempts=2)]))
    assert kinds(s.tick(at(5))) == [("timed_out", "a"), ("retried", "a")]  # not released again: a may still run
    stalled = attempt_key(SESSION, "p", "a", 1)
    assert s.apply(EXECUTOR_HEARTBEAT, heartbeat("gpu-1", 4, cls="gpu", gpu_mb=10_000)) == []  # sent before the timeout
    assert s.apply(EXECUTOR_HEARTBEAT, heartbeat("gpu-1", 6, cls="gpu", gpu_mb=0, running=(stalled,))) == []
    out = s.apply(EXECUTOR_HEARTBEAT, heartbeat("gpu-1", 7, cls="gpu", gpu_mb=10_000))  # it let go of attempt 1
    assert kinds(out) == [("released", "a")] and out[0].record["attempt"] == 2


# -- late successes, forgetting, aging ------------------------------------------------------------------------------


def test_a_late_success_of_a_timed_out_attempt_counts_and_supersedes_the_retry() -> None:
    s = PlanScheduler()
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 0, cpu=2))
    s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a", deadline_s=5, attempts=3), subgoal("b", "a", cpu=2)]))
    assert kinds(s.tick(at(5))) == [("timed_out", "a"), ("retried", "a"), ("released", "a")]
    assert s.available("cpu") == {"cpu-1": Resources(0, 0, 0)}  # attempt 1 may still run; attempt 2 is out
    # attempt 1 was slow, not dead: its success counts, and b is released once the room is there
    assert s.apply(SUBGOAL_STATUS, status("p", "a", 1, "SUCCEEDED", 6)) == []
    assert s.subgoal_states(SESSION, "p")["a"] is NodeState.SUCCEEDED
    assert s.available("cpu") == {"cpu-1": Resources(0, 0, 1)}  # attempt 2 (superseded) holds until its deadline
    assert s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 9, cpu=2)) == []  # before attempt 2's deadline (10)
    assert kinds(s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 10, cpu=2))) == [("released", "b")]
    assert s.apply(SUBGOAL_STATUS, status("p", "a", 2, "SUCCEEDED", 11)) == []  # the superseded attempt: nothing
    assert s.apply(SUBGOAL_STATUS, status("p", "a", 1, "SUCCEEDED", 11)) == []  # a repeat: nothing
    assert kinds(s.apply(SUBGOAL_STATUS, status("p", "b", 1, "SUCCEEDED", 12))) == [("finished", "")]


def test_a_late_success_does_not_undo_an_escalation_nor_a_reported_failure() -> None:
    s = PlanScheduler()
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 0))
    s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a", deadline_s=5), subgoal("b", "a"), subgoal("c", deadline_s=60)]))
    assert kinds(s.tick(at(5))) == [("timed_out", "a"), ("escalated", "a")]
    assert s.apply(SUBGOAL_STATUS, status("p", "a", 1, "SUCCEEDED", 6)) == []
    assert s.subgoal_states(SESSION, "p") == {"a": NodeState.ESCALATED, "b": NodeState.CANCELLED,
                                              "c": NodeState.RELEASED}  # fmt: skip


def test_finished_plans_are_forgotten_after_the_retention_and_redeliveries_change_nothing_meanwhile() -> None:
    s = PlanScheduler(finished_retention_s=100, finished_limit=2)
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 0))
    s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a")]))
    assert kinds(s.apply(SUBGOAL_STATUS, status("p", "a", 1, "SUCCEEDED", 1))) == [("finished", "")]
    assert s.footprint()["plans"] == 0 and s.footprint()["finished_remembered"] == 1
    assert s.plan_finished(SESSION, "p") and s.subgoal_states(SESSION, "p") == {"a": NodeState.SUCCEEDED}
    assert s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a")], t=50)) == []  # a redelivery
    with pytest.raises(PlanRefused, match="a different plan was already submitted"):
        s.apply(PLAN_SUBMITTED, plan("p", [subgoal("b")], t=50))
    assert s.tick(at(100.9)) == [] and s.footprint()["finished_remembered"] == 1
    assert s.tick(at(101)) == [] and s.footprint()["finished_remembered"] == 0  # forgotten: retention passed
    with pytest.raises(KeyError):
        s.subgoal_states(SESSION, "p")
    for name in ("q1", "q2", "q3"):  # and never more than finished_limit, the oldest forgotten first
        s.apply(PLAN_SUBMITTED, plan(name, [subgoal("a")], t=102))
        s.apply(SUBGOAL_STATUS, status(name, "a", 1, "SUCCEEDED", 103))
    assert s.footprint()["finished_remembered"] == 2 and s.plan_finished(SESSION, "q3")
    with pytest.raises(KeyError):
        s.plan_finished(SESSION, "q1")


def test_an_executor_gone_for_good_is_forgotten_with_its_zombie_holds() -> None:
    s = PlanScheduler(executor_forget_s=100)
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("gpu-1", 0, cls="gpu", gpu_mb=10, valid_for_s=10))
    s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a", cls="gpu", gpu_mb=10, deadline_s=5, attempts=2)]))
    assert kinds(s.tick(at(5))) == [("timed_out", "a"), ("retried", "a")]  # the zombie holds gpu-1's room
    assert s.tick(at(109.9)) == [] and s.footprint()["holds"] == 1
    assert s.tick(at(110)) == [] and s.footprint()["executors"] == 0 and s.footprint()["holds"] == 0
    late = heartbeat("gpu-1", 0, cls="gpu", gpu_mb=10, valid_for_s=10)
    assert s.apply(EXECUTOR_HEARTBEAT, late) == [] and s.footprint()["executors"] == 0  # expired on arrival
    out = s.apply(EXECUTOR_HEARTBEAT, heartbeat("gpu-1", 111, cls="gpu", gpu_mb=10))  # back: a new executor
    assert kinds(out) == [("released", "a")] and out[0].record["attempt"] == 2


def test_timers_pushed_back_by_heartbeats_do_not_pile_up() -> None:
    s = PlanScheduler()
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 0))
    s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a", deadline_s=10)]))
    for k in range(1, 6000):  # each sign of life pushes the deadline back: a timer each
        assert s.apply(SUBGOAL_STATUS, status("p", "a", 1, "HEARTBEAT", k / 100)) == []
    assert s.footprint()["timers"] < 4100  # the stale ones were dropped
    assert s.tick(at(59.99 + 9.99)) == []
    assert kinds(s.tick(at(59.99 + 10))) == [("timed_out", "a"), ("escalated", "a"), ("finished", "")]


def small_stream(s: PlanScheduler, steps: int, run_steps: int = 2) -> dict[str, int]:
    """Plan "first" running, then one 1-CPU subgoal submitted per second, each running `run_steps` seconds on cpu-1
    (2 CPUs): cpu-1 never has both CPUs free unless the scheduler keeps one. When each plan was released."""
    released, running = {}, {"first": 1}

    def note(decisions: list[Decision], t: int) -> None:
        for d in decisions:
            if d.schema == SUBGOAL_RELEASED:
                released[d.record["plan_id"]] = t
                running[d.record["plan_id"]] = t + run_steps

    for t in range(1, steps):
        note(s.apply(PLAN_SUBMITTED, plan(f"small{t}", [subgoal("a", deadline_s=1000)], t=t)), t)
        for key in [k for k, until in running.items() if until <= t]:
            del running[key]
            note(s.apply(SUBGOAL_STATUS, status(key, "a", 1, "SUCCEEDED", t)), t)
        busy = tuple(attempt_key(SESSION, k, "a", 1) for k in sorted(running))
        used = sum(2 if k == "big" else 1 for k in running)
        note(s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", t, cpu=2 - used, running=busy)), t)
    return released


def test_aging_keeps_backfill_from_starving_a_large_profile() -> None:
    for aging_s, released_by in ((float("inf"), None), (10.0, 13)):
        s = PlanScheduler(aging_s=aging_s)
        s.apply(EXECUTOR_HEARTBEAT, heartbeat("cpu-1", 0, cpu=2))
        s.apply(PLAN_SUBMITTED, plan("first", [subgoal("a", deadline_s=1000)]))
        s.apply(PLAN_SUBMITTED, plan("big", [subgoal("a", cpu=2, deadline_s=1000)]))  # does not fit beside "first"
        released = small_stream(s, 60)
        if released_by is None:
            assert "big" not in released  # without aging: a stream of small ones passes it forever
        else:
            assert 10 <= released["big"] <= released_by  # waited 10 s: cpu-1 is kept for it, then it fits
            assert max(released.values()) >= 55  # and the stream goes on after it


def test_a_profile_no_executor_could_hold_waits_and_is_reported() -> None:
    s = PlanScheduler()
    s.apply(EXECUTOR_HEARTBEAT, heartbeat("gpu-1", 0, cls="gpu", gpu_mb=40_000, gpus=1))
    s.apply(PLAN_SUBMITTED, plan("p", [subgoal("a", cls="gpu", gpu_mb=80_000), subgoal("b", cls="gpu", gpu_mb=10)]))
    assert s.unplaceable() == [(SESSION, "p", "a", "gpu")]  # b was released; a is not refused: one may join later
    assert kinds(s.apply(EXECUTOR_HEARTBEAT, heartbeat("gpu-2", 1, cls="gpu", gpu_mb=80_000, gpus=1))) == [
        ("released", "a")
    ]
    assert s.unplaceable() == []


# -- properties: random DAGs, random executors and random status streams, against a small oracle ---------------------

CLASSES = ("cpu", "gpu")
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def fitting_profile(draw: st.DrawFn, capacity: Resources) -> Resources:
    return Resources(draw(st.integers(0, capacity.gpu_memory_mb)), draw(st.integers(0, capacity.gpus)),
                     draw(st.integers(0, capacity.cpu)))  # fmt: skip


def profile_record(p: Resources) -> dict[str, int]:
    return p.record()


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[dict[str, tuple[str, Resources]], list[dict[str, Any]]]:
    """Executors (id -> class, capacity) and plans whose every profile fits some executor of its class."""
    executors: dict[str, tuple[str, Resources]] = {}
    for cls in CLASSES:
        for i in range(draw(st.integers(1, 2))):
            gpu = cls == "gpu"
            capacity = Resources(draw(st.sampled_from([0, 16, 40, 80])) * 1000 if gpu else 0,
                                 draw(st.integers(0, 2)) if gpu else 0, draw(st.integers(1, 4)))  # fmt: skip
            executors[f"{cls}-{i}"] = (cls, capacity)
    by_class = {cls: [cap for c, cap in executors.values() if c == cls] for cls in CLASSES}
    plans = []
    for p in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, 7))
        specs = []
        for i in range(n):
            cls = draw(st.sampled_from(CLASSES))
            profile = draw(fitting_profile(draw(st.sampled_from(by_class[cls]))))
            fb = None
            if draw(st.booleans()):
                fb_cls = draw(st.sampled_from(CLASSES))
                fb_profile = draw(fitting_profile(draw(st.sampled_from(by_class[fb_cls]))))
                fb = {"tool": "backup", "agent": None, "params_json": "{}", "resource_class": fb_cls,
                      "profile": profile_record(fb_profile)}  # fmt: skip
            deps = sorted(draw(st.sets(st.integers(0, i - 1), max_size=3))) if i else []
            deadline_s = draw(st.sampled_from([2.0, 5.0, 30.0]))
            spec = subgoal(f"n{i}", *(f"n{d}" for d in deps), cls=cls, deadline_s=deadline_s,
                           attempts=draw(st.integers(1, 3)), backoff_s=draw(st.sampled_from([0.0, 0.5, 2.0])),
                           fallback=fb)  # fmt: skip
            spec["profile"] = profile_record(profile)
            specs.append(spec)
        plans.append({"plan_id": f"p{p}", "subgoals": draw(st.permutations(specs))})
    return executors, plans


class Simulation:
    """Honest executors around a PlanScheduler, and the oracle that checks every decision as it comes."""

    def __init__(
        self, executors: dict[str, tuple[str, Resources]], plans: list[dict[str, Any]], aging_s: float = 60.0,
        markers: bool = False,
    ) -> None:  # fmt: skip
        self.scheduler = PlanScheduler(aging_s=aging_s, delivery_markers=markers)
        self.aging_s = aging_s
        self.markers = markers
        self.undelivered: list[tuple[str, str, int]] = []  # released, marker not written yet (markers only)
        self.signs: dict[tuple[str, str, int], int] = {}  # an attempt's latest marker or RUNNING/HEARTBEAT
        self.released_at: dict[tuple[str, str, int], int] = {}
        self.deadline_us: dict[tuple[str, str, int], int] = {}
        self.executors = executors
        self.specs = {(p["plan_id"], s["subgoal_id"]): s for p in plans for s in p["subgoals"]}
        self.clock = 0.0
        self.log: list[tuple[str, Any]] = []
        self.decisions: list[Decision] = []
        self.released: set[tuple[str, str, int]] = set()
        self.current: dict[tuple[str, str], int] = {}  # latest attempt released
        self.live: set[tuple[str, str, int]] = set()  # attempts released and not ended, the oracle's view
        self.timed_out: set[tuple[str, str, int]] = set()
        self.queued: dict[tuple[str, str, int], tuple[str, Resources]] = {}  # released, not yet picked up
        self.start_by: dict[tuple[str, str, int], int] = {}  # released_at + deadline: the SDK drops it unstarted after
        self.picked: dict[str, dict[tuple[str, str, int], Resources]] = {e: {} for e in executors}
        self.succeeded: set[tuple[str, str]] = set()
        self.escalated: set[tuple[str, str]] = set()
        self.cancelled: set[tuple[str, str]] = set()
        self.finished: dict[str, dict[str, Any]] = {}

    def feed(self, schema: str | None, record: Any) -> list[Decision]:
        self.log.append((schema, record))
        out = self.scheduler.tick(record) if schema is None else self.scheduler.apply(schema, record)
        for decision in encodable(out):
            self.check(decision)
        self.decisions += out
        return out

    def check(self, d: Decision) -> None:
        r = d.record
        node = (r["plan_id"], r.get("subgoal_id", ""))
        if d.schema == SUBGOAL_RELEASED:
            key = (*node, r["attempt"])
            assert key not in self.released, "released twice for the same attempt"
            assert r["attempt"] == self.current.get(node, 0) + 1
            assert not any(k[:2] == node for k in self.live), "a second attempt while one is live"
            for dep in self.specs[node]["depends_on"]:
                assert (node[0], dep) in self.succeeded, f"{node} released before its dependency {dep} succeeded"
            self.released.add(key)
            self.current[node] = r["attempt"]
            self.live.add(key)
            self.queued[key] = (r["executor_id"], Resources.of(r["profile"]))
            self.released_at[key], self.deadline_us[key] = r["released_at"], round(r["deadline_s"] * MICROS)
            if self.markers:  # the work's send time is not known until its marker: the SDK waits for it
                self.start_by[key] = 2**62
                self.undelivered.append(key)
            else:
                self.start_by[key] = r["released_at"] + self.deadline_us[key]
                self.signs[key] = r["released_at"]
            assert self.executors[r["executor_id"]][0] == r["resource_class"]
            self.check_capacity()
        elif d.schema == SUBGOAL_TIMED_OUT:
            key = (*node, r["attempt"])
            assert key in self.live
            # never before deadline_s past its latest sign of life (with markers: its delivery, not its release)
            assert key in self.signs, "timed out before its release was delivered or it showed a sign of life"
            assert r["decided_at"] >= self.signs[key] + self.deadline_us[key]
            self.live.discard(key)
            self.timed_out.add(key)
            self.queued.pop(key, None)  # the SDK drops work past its deadline before starting it
        elif d.schema == SUBGOAL_ESCALATED:
            assert not any(k[:2] == node for k in self.live)
            self.escalated.add(node)
            self.cancelled |= {(node[0], c) for c in r["cancelled"]}
        elif d.schema == PLAN_FINISHED:
            assert r["plan_id"] not in self.finished, "a plan finished twice"
            self.finished[r["plan_id"]] = r

    def check_capacity(self) -> None:
        """What each executor physically holds (picked up, or queued for it) never exceeds its capacity."""
        for executor, (_, capacity) in self.executors.items():
            held = sum(self.picked[executor].values(), Resources())
            held = sum((p for e, p in self.queued.values() if e == executor), held)
            assert capacity.covers(held), f"{executor} over capacity: {held} > {capacity}"

    def heartbeat(self, executor: str, valid_for_s: float) -> None:
        cls, capacity = self.executors[executor]
        used = sum(self.picked[executor].values(), Resources())
        free = capacity - used
        running = tuple(attempt_key(SESSION, *k) for k in sorted(self.picked[executor]))
        self.feed(EXECUTOR_HEARTBEAT, heartbeat(executor, self.clock, cls, free.gpu_memory_mb, free.gpus, free.cpu,
                                                running, valid_for_s))  # fmt: skip

    def pick_up(self, key: tuple[str, str, int], running: bool) -> None:
        executor, profile = self.queued.pop(key)
        self.picked[executor][key] = profile
        if running:
            self.report(key, "RUNNING")

    def deliver(self, key: tuple[str, str, int]) -> None:
        """The processor's ReleaseDelivered for a release it sent (the clock now: sent while catching up, or late)."""
        self.undelivered.remove(key)
        sent_at = at(self.clock)
        if key in self.live:
            self.signs[key] = max(self.signs.get(key, 0), sent_at, self.released_at[key])
        self.start_by[key] = max(self.released_at[key], sent_at) + self.deadline_us[key]
        self.feed(RELEASE_DELIVERED, marker(key[0], key[1], key[2], self.clock))

    def report(self, key: tuple[str, str, int], state: str, error_class: str | None = None) -> None:
        if state in ("RUNNING", "HEARTBEAT") and key in self.live:
            self.signs[key] = max(self.signs.get(key, self.released_at[key]), at(self.clock))
        if state in ("SUCCEEDED", "FAILED"):
            for held in self.picked.values():
                held.pop(key, None)
            node = key[:2]
            if key in self.live:
                self.live.discard(key)
                if state == "SUCCEEDED":
                    self.succeeded.add(node)
            elif state == "SUCCEEDED" and key in self.timed_out and node not in self.succeeded | self.escalated:
                self.succeeded.add(node)  # a late success of a timed-out attempt: the work is done
                event("late success")
                self.live -= {k for k in self.live if k[:2] == node}  # an attempt still out is superseded
        self.feed(SUBGOAL_STATUS, status(key[0], key[1], key[2], state, self.clock, error_class))

    def advance(self, seconds: float) -> None:
        self.clock += seconds
        for key in [k for k in self.queued if self.start_by[k] <= at(self.clock)]:
            del self.queued[key]  # the SDK drops work whose deadline passed before it starts
        self.feed(None, at(self.clock))


@PROPERTY
@given(scenarios(), st.data())
def test_random_dags_and_status_streams_keep_the_release_rule(scenario, data: st.DataObject) -> None:
    executors, plans = scenario
    aging_s = data.draw(st.sampled_from([60.0, 2.0, 0.0]), label="aging_s")  # 0: every pass goes by age
    markers = data.draw(st.booleans(), label="delivery_markers")
    sim = Simulation(executors, plans, aging_s, markers)
    for executor in sorted(executors):
        sim.heartbeat(executor, 1e6)
    for p in plans:
        sim.feed(PLAN_SUBMITTED, plan(p["plan_id"], p["subgoals"], t=sim.clock))
    # a random stretch: stalls, failures, late and repeated reports, expiring advertisements
    for _ in range(data.draw(st.integers(0, 60), label="steps")):
        actions = ["tick", "heartbeat", "pick_up", "report", "repeat", "deliver"]
        action = data.draw(st.sampled_from(actions), label="action")
        if action == "deliver" and sim.undelivered:  # markers land late: the work went out after a catch-up
            sim.deliver(data.draw(st.sampled_from(sim.undelivered), label="marker"))
        elif action == "tick":
            sim.advance(data.draw(st.sampled_from([0.0, 0.5, 1.0, 3.0]), label="seconds"))
        elif action == "heartbeat":
            sim.heartbeat(data.draw(st.sampled_from(sorted(executors))), data.draw(st.sampled_from([2.0, 1e6])))
        elif action == "pick_up" and sim.queued:
            sim.pick_up(data.draw(st.sampled_from(sorted(sim.queued))), data.draw(st.booleans(), label="running"))
        elif action == "report":
            picked = sorted(k for held in sim.picked.values() for k in held)
            if picked:
                key = data.draw(st.sampled_from(picked), label="attempt")
                state = data.draw(st.sampled_from(["HEARTBEAT", "SUCCEEDED", "FAILED"]), label="state")
                sim.report(key, state, "ToolError" if state == "FAILED" else None)
        elif action == "repeat" and sim.log:
            schema, record = data.draw(st.sampled_from(sim.log), label="repeat")
            assert sim.feed(schema, record) == [], "a repeated input decided something"
    # then the executors answer: they let go of what they hold, heartbeat, and every attempt succeeds
    for _ in range(400):
        if len(sim.finished) == len(plans):
            break
        for key in list(sim.undelivered):
            sim.deliver(key)
        for executor in sorted(executors):
            for key in sorted(sim.picked[executor]):
                sim.report(key, "SUCCEEDED")
            sim.heartbeat(executor, 1e6)
        for key in sorted(sim.queued):
            sim.pick_up(key, running=True)
            sim.report(key, "SUCCEEDED")
        sim.advance(1.0)
    assert len(sim.finished) == len(plans), "a plan never finished once the executors answered"
    for p in plans:
        states = sim.scheduler.subgoal_states(SESSION, p["plan_id"])
        assert set(states.values()) <= {NodeState.SUCCEEDED, NodeState.ESCALATED, NodeState.CANCELLED}
        for sid, state in states.items():
            node = (p["plan_id"], sid)
            assert (state is NodeState.SUCCEEDED) == (node in sim.succeeded)
            assert (state is NodeState.ESCALATED) == (node in sim.escalated)
            assert (state is NodeState.CANCELLED) == (node in sim.cancelled)
        finished = sim.finished[p["plan_id"]]
        assert finished["outcome"] == (
            "SUCCEEDED" if all(s is NodeState.SUCCEEDED for s in states.values()) else "FAILED"
        )
        for sid in finished["cancelled"]:  # only downstream of an escalated subgoal
            assert ancestors(sim.specs, p["plan_id"], sid) & {n for pl, n in sim.escalated if pl == p["plan_id"]}
    for kind in sorted({kind for kind, _ in kinds(sim.decisions)}):
        event(kind)
    # deterministic: the same log decides the same, and so does the log with every input twice
    assert replay(sim.log, twice=False, aging_s=aging_s, markers=markers) == sim.decisions
    assert replay(sim.log, twice=True, aging_s=aging_s, markers=markers) == sim.decisions
    # bounded memory: finished plans leave only their redelivery check, and that goes after the retention, as do
    # executors whose advertisement expired long ago (with their holds), stale ready entries and timers
    footprint = sim.scheduler.footprint()
    assert (footprint["plans"], footprint["finished_remembered"], footprint["ready"]) == (0, len(plans), 0)
    sim.advance(1e6 + 3600 + 600)  # past every advertisement, the retention and executor_forget_s
    assert set(sim.scheduler.footprint().values()) == {0}, sim.scheduler.footprint()


def ancestors(specs: dict[tuple[str, str], dict[str, Any]], plan_id: str, sid: str) -> set[str]:
    seen, stack = set(), list(specs[(plan_id, sid)]["depends_on"])
    while stack:
        dep = stack.pop()
        if dep not in seen:
            seen.add(dep)
            stack.extend(specs[(plan_id, dep)]["depends_on"])
    return seen


def replay(
    log: list[tuple[str | None, Any]], twice: bool, aging_s: float = 60.0, markers: bool = False
) -> list[Decision]:
    scheduler, decisions = PlanScheduler(aging_s=aging_s, delivery_markers=markers), []
    for schema, record in log:
        for _ in range(2 if twice else 1):
            decisions += scheduler.tick(record) if schema is None else scheduler.apply(schema, record)
    return decisions


@st.composite
def graphs(draw: st.DrawFn) -> dict[str, list[str]]:
    n = draw(st.integers(1, 8))
    return {f"n{i}": sorted({f"n{d}" for d in draw(st.sets(st.integers(0, n - 1), max_size=3))}) for i in range(n)}


def has_cycle(graph: dict[str, list[str]]) -> bool:
    """The oracle: a graph is acyclic iff repeatedly removing nodes with no remaining dependencies empties it."""
    left = {k: set(v) for k, v in graph.items()}
    while True:
        free = [k for k, deps in left.items() if not deps & left.keys()]
        if not free:
            return bool(left)
        for k in free:
            del left[k]


@PROPERTY
@given(graphs())
def test_a_plan_is_refused_exactly_when_its_dependencies_have_a_cycle(graph: dict[str, list[str]]) -> None:
    subgoals = [subgoal(sid, *deps) for sid, deps in graph.items()]
    s = PlanScheduler()
    if has_cycle(graph):
        with pytest.raises(PlanRefused, match="dependency cycle: ") as refused:
            s.apply(PLAN_SUBMITTED, plan("p", subgoals))
        cycle = refused.value.reason.removeprefix("dependency cycle: ").split(" -> ")
        assert cycle[0] == cycle[-1] and all(b in graph[a] for a, b in pairwise(cycle))
    else:
        s.apply(PLAN_SUBMITTED, plan("p", subgoals))
        assert set(s.subgoal_states(SESSION, "p")) == set(graph)


@PROPERTY
@given(graphs(), st.text(min_size=1, max_size=3))
def test_a_plan_naming_an_unknown_dependency_is_refused(graph: dict[str, list[str]], unknown: str) -> None:
    if unknown in graph:
        return
    subgoals = [subgoal(sid, *deps) for sid, deps in graph.items()]
    subgoals[-1]["depends_on"].append(unknown)
    with pytest.raises(PlanRefused, match="depends on unknown subgoal"):
        PlanScheduler().apply(PLAN_SUBMITTED, plan("p", subgoals))


@PROPERTY
@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=3),
    st.sampled_from([3.0, 5.0, 10.0]),
    st.lists(st.integers(0, 3), min_size=1, max_size=8),
    st.lists(st.integers(1, 3), min_size=1, max_size=8),
)
def test_with_aging_no_stream_of_small_subgoals_starves_a_large_one(
    capacities: list[int], aging_s: float, arrivals: list[int], runs: list[int]
) -> None:
    """Executors busy with a stream of 1-CPU subgoals (arrivals per second and run lengths cycled from the lists):
    a subgoal needing the largest executor whole is released at most a run and a heartbeat after it waited aging_s."""
    s = PlanScheduler(aging_s=aging_s)
    executors = {f"cpu-{i}": cap for i, cap in enumerate(capacities)}
    running: dict[str, tuple[str, int, int]] = {}  # plan -> (executor, cpu, until)
    released: dict[str, int] = {}
    for eid, cap in executors.items():
        s.apply(EXECUTOR_HEARTBEAT, heartbeat(eid, 0, cpu=cap))
    count = 0

    def note(decisions: list[Decision], t: int) -> None:
        nonlocal count
        for d in decisions:
            if d.schema != SUBGOAL_RELEASED:
                assert d.schema == PLAN_FINISHED
                continue
            r = d.record
            released[r["plan_id"]] = t
            running[r["plan_id"]] = (r["executor_id"], r["profile"]["cpu"], t + runs[count % len(runs)])
            count += 1

    for k in range(max(capacities)):  # the executors are busy when the large one is submitted
        note(s.apply(PLAN_SUBMITTED, plan(f"early{k}", [subgoal("a", deadline_s=1e4)])), 0)
    note(s.apply(PLAN_SUBMITTED, plan("big", [subgoal("a", cpu=max(capacities), deadline_s=1e4)])), 0)
    horizon = int(aging_s) + max(runs) + 2
    for t in range(1, horizon + 1):
        for k in range(arrivals[t % len(arrivals)]):
            note(s.apply(PLAN_SUBMITTED, plan(f"small{t}.{k}", [subgoal("a", deadline_s=1e4)], t=t)), t)
        for key in sorted(k for k, (_, _, until) in running.items() if until <= t):
            del running[key]
            note(s.apply(SUBGOAL_STATUS, status(key, "a", 1, "SUCCEEDED", t)), t)
        for eid, cap in executors.items():
            mine = sorted(k for k, (e, _, _) in running.items() if e == eid)
            used = sum(running[k][1] for k in mine)
            assert used <= cap
            busy = tuple(attempt_key(SESSION, k, "a", 1) for k in mine)
            note(s.apply(EXECUTOR_HEARTBEAT, heartbeat(eid, t, cpu=cap - used, running=busy)), t)
    assert "big" in released, f"starved past {horizon} s"
