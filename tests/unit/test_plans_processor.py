"""The plans processor's own checks on a submitted plan (the fold itself is tested in test_plans_dag.py): a resource
class must be able to name a work topic, and the processor folds everything else exactly as the scheduler does."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from processors.plans.dag import PlanRefused, PlanScheduler
from processors.plans.processor import fold_input, work_topic_problem
from tests.unit.test_plans_dag import fallback, heartbeat, plan, subgoal
from topics.names import EXECUTOR_HEARTBEAT, PLAN_SUBMITTED

PREFIX = "treadle.work"


@given(st.text(min_size=0, max_size=30))
def test_a_resource_class_is_refused_exactly_when_it_cannot_name_a_topic(cls):
    problem = work_topic_problem(plan("p", [subgoal("a", cls=cls)]), PREFIX)
    assert (problem is None) == bool(re.fullmatch(r"[A-Za-z0-9._-]+", cls, flags=re.ASCII))


def test_the_fallback_class_is_checked_too_and_the_whole_name_must_fit():
    bad_fallback = plan("p", [subgoal("a", fallback=fallback(cls="gpu/a100"))])
    assert "'gpu/a100' cannot name a work topic" in work_topic_problem(bad_fallback, PREFIX)
    assert work_topic_problem(plan("p", [subgoal("a", cls="g" * 236)]), PREFIX) is None  # 249 in all
    assert work_topic_problem(plan("p", [subgoal("a", cls="g" * 237)]), PREFIX) is not None


def test_fold_input_refuses_a_bad_class_and_otherwise_decides_as_the_scheduler():
    with pytest.raises(PlanRefused, match="cannot name a work topic"):
        fold_input(PlanScheduler(PREFIX), PLAN_SUBMITTED, plan("p", [subgoal("a", cls="gpu a100")]))
    inputs = [(EXECUTOR_HEARTBEAT, heartbeat("x", 0.0)), (PLAN_SUBMITTED, plan("p", [subgoal("a"), subgoal("b", "a")]))]
    ours, theirs = PlanScheduler(PREFIX), PlanScheduler(PREFIX)
    assert [fold_input(ours, s, r) for s, r in inputs] == [theirs.apply(s, r) for s, r in inputs]
