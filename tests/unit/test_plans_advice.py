"""The plans scheduler acting on self-diagnosis (PlanScheduler.advise): a SchedulerAdvice on the plan log makes a
subgoal whose tool and params are flagged skip its remaining retries and go to its fallback at its next failure,
only while the advice holds, only before the fallback, and the same log gives the same decisions."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from processors.plans.dag import PlanScheduler
from processors.plans.symptoms import params_hash
from tests.unit.test_plans_dag import CODEC, at, encodable, fallback, heartbeat, kinds, plan, status, subgoal
from topics.names import EXECUTOR_HEARTBEAT, PLAN_EVENTS_KEY, PLAN_SUBMITTED, SCHEDULER_ADVICE, SUBGOAL_STATUS
from topics.validation import InputValidator


def advice(tool: str, params: str = "{}", t: float = 0.0, valid_for_s: float = 100.0, n: int = 0) -> dict[str, Any]:
    return {
        "advice_id": f"plan_diagnosis:skip_retries:{tool}:{n}", "action": "SKIP_RETRIES", "tool": tool,
        "params_hash": params_hash(params), "failures": 3, "window_s": valid_for_s, "reason": "3 failures",
        "evaluator": "plan_diagnosis", "source_event_id": f"e{n}", "advised_at": at(t),
        "valid_until": at(t + valid_for_s),
    }  # fmt: skip


def started(spec: dict[str, Any]) -> PlanScheduler:
    scheduler = PlanScheduler()
    scheduler.apply(EXECUTOR_HEARTBEAT, heartbeat("x", 0))
    assert kinds(scheduler.apply(PLAN_SUBMITTED, plan("p", [spec]))) == [("released", "a")]
    return scheduler


def test_advice_reroutes_a_flagged_subgoal_to_its_fallback_at_its_next_failure() -> None:
    scheduler = started(subgoal("a", attempts=3, fallback=fallback()))
    assert scheduler.apply(SCHEDULER_ADVICE, advice("tool_a", t=1)) == []  # decides nothing by itself
    out = encodable(scheduler.apply(SUBGOAL_STATUS, status("p", "a", 1, "FAILED", 2, "ToolError")))
    assert kinds(out) == [("rerouted", "a"), ("released", "a")]
    assert out[0].record["failed_attempt"] == 1 and out[1].record["tool"] == "backup" and out[1].record["fallback"]


def test_without_advice_the_same_failure_is_retried() -> None:
    scheduler = started(subgoal("a", attempts=3, fallback=fallback()))
    out = scheduler.apply(SUBGOAL_STATUS, status("p", "a", 1, "FAILED", 2, "ToolError"))
    assert kinds(out) == [("retried", "a"), ("released", "a")]


def test_advice_that_expired_other_params_or_no_fallback_changes_nothing() -> None:
    for spec, flagged in [
        (subgoal("a", attempts=3, fallback=fallback()), advice("tool_a", t=0, valid_for_s=1)),  # expired at 2
        (subgoal("a", attempts=3, fallback=fallback()), advice("tool_a", params='{"x": 1}', t=1)),
        (subgoal("a", attempts=3, fallback=fallback()), advice("other", t=1)),
        (subgoal("a", attempts=3), advice("tool_a", t=1)),  # nowhere to go: retries as usual
    ]:
        scheduler = started(spec)
        scheduler.apply(SCHEDULER_ADVICE, flagged)
        out = scheduler.apply(SUBGOAL_STATUS, status("p", "a", 1, "FAILED", 2, "ToolError"))
        assert kinds(out) == [("retried", "a"), ("released", "a")], flagged


def test_advice_matches_canonical_params_and_a_flagged_fallback_keeps_its_own_retries() -> None:
    spec = subgoal("a", attempts=2, params='{"b": 1, "a": 2}', fallback={**fallback(), "tool": "tool_a"})
    scheduler = started(spec)
    scheduler.apply(SCHEDULER_ADVICE, advice("tool_a", params='{"a":2,"b":1}', t=1))
    assert kinds(scheduler.apply(SUBGOAL_STATUS, status("p", "a", 1, "FAILED", 2))) == [
        ("rerouted", "a"), ("released", "a"),
    ]  # fmt: skip
    scheduler.apply(SCHEDULER_ADVICE, advice("tool_a", t=3, n=1))  # the fallback (tool_a, {}) is flagged too
    out = scheduler.apply(SUBGOAL_STATUS, status("p", "a", 2, "FAILED", 4))
    assert kinds(out) == [("retried", "a"), ("released", "a")]  # advice never skips a fallback's retries


def test_a_repeated_advice_changes_nothing_and_a_later_one_extends_it() -> None:
    scheduler = started(subgoal("a", attempts=3, fallback=fallback()))
    for _ in range(2):
        assert scheduler.apply(SCHEDULER_ADVICE, advice("tool_a", t=1, valid_for_s=1)) == []
    assert scheduler.apply(SCHEDULER_ADVICE, advice("tool_a", t=0.5, valid_for_s=10, n=1)) == []  # older, longer
    out = scheduler.apply(SUBGOAL_STATUS, status("p", "a", 1, "FAILED", 5))
    assert kinds(out)[0] == ("rerouted", "a")


def test_advice_is_a_valid_plan_event_that_round_trips_and_needs_the_plans_key() -> None:
    record = advice("tool_a", t=1)
    assert CODEC.decode(CODEC.encode(SCHEDULER_ADVICE, record), expect=SCHEDULER_ADVICE)[1] == record
    validator, key = InputValidator(), PLAN_EVENTS_KEY.encode()
    assert validator.problem(SCHEDULER_ADVICE, record, key) is None
    assert "is not 'plans'" in validator.problem(SCHEDULER_ADVICE, record, b"s1")
    assert "must not be empty" in validator.problem(SCHEDULER_ADVICE, {**record, "tool": ""}, key)
    assert "before advised_at" in validator.problem(SCHEDULER_ADVICE, {**record, "valid_until": 0}, key)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["FAILED", "SUCCEEDED", "ADVICE", "HEARTBEAT"]), st.integers(0, 3), st.booleans()),
        max_size=25,
    )
)
def test_the_same_log_with_advice_gives_the_same_decisions_twice_and_with_every_input_repeated(
    steps: list[tuple[str, int, bool]],
) -> None:
    specs = [subgoal(s, attempts=3, fallback=fallback()) for s in "abcd"]
    log: list[tuple[str, dict[str, Any]]] = [
        (EXECUTOR_HEARTBEAT, heartbeat("x", 0)), (PLAN_SUBMITTED, plan("p", specs)),
    ]  # fmt: skip
    attempts = dict.fromkeys("abcd", 1)
    for t, (what, which, bump) in enumerate(steps, start=1):
        sid = "abcd"[which]
        if what == "ADVICE":
            log.append((SCHEDULER_ADVICE, advice(f"tool_{sid}", t=t, valid_for_s=5, n=t)))
        else:
            log.append((SUBGOAL_STATUS, status("p", sid, attempts[sid], what, t)))
            attempts[sid] += int(bump and what == "FAILED")

    def run(inputs: list[tuple[str, dict[str, Any]]]) -> list[Any]:
        scheduler = PlanScheduler()
        return [d for schema, record in inputs for d in scheduler.apply(schema, record)]

    first = run(log)
    assert run(log) == first
    assert run([item for item in log for _ in range(2)]) == first
