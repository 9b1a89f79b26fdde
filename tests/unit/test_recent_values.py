"""Rolling-mean imputation: the values a worker keeps per reward source, and the step's own spec's count."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from processors.steps.assembler import StepAssembler, StepState
from processors.steps.policy import PolicyBook, RewardPolicy, RewardSpec
from processors.steps.processor import StepProcessor
from processors.steps.recent_values import RecentValues
from tests.factories import dispatch
from tests.unit.test_weaving import T0, S, at, signal
from topics.names import DISPATCH, REWARD


@given(st.lists(st.floats(-1e6, 1e6), max_size=50), st.integers(1, 20), st.integers(1, 30))
def test_the_mean_is_of_the_last_count_values_it_keeps(values: list[float], keep: int, count: int) -> None:
    recent = RecentValues()
    for value in values:
        recent.add("human/*", value, keep)
    last = values[-min(keep, count) :] if values else []
    expected = sum(last) / len(last) if last else None
    assert recent.mean("human/*", count) == (pytest.approx(expected) if expected is not None else None)
    assert recent.mean("judge/*", count) is None  # another source's values are its own


def test_a_larger_count_asked_later_keeps_more_from_then_on() -> None:
    recent = RecentValues()
    for value in (1.0, 2.0, 3.0, 4.0, 5.0):
        recent.add("human/*", value, 2)  # keeps 4, 5
    recent.add("human/*", 6.0, 4)  # grows: 4, 5, 6
    recent.add("human/*", 7.0, 2)  # never shrinks: 4, 5, 6, 7
    assert recent.mean("human/*", 4) == pytest.approx(5.5)
    assert recent.mean("human/*", 2) == pytest.approx(6.5)


def _human(version: str, count: int, effective_from_s: float) -> RewardPolicy:
    human = RewardSpec(source="human", window_s=100, required=True, imputation="rolling_mean", rolling_count=count)
    return RewardPolicy(version=version, specs=(human,), effective_from_us=T0 + int(effective_from_s * S))


def test_a_step_imputes_the_mean_of_its_own_policy_versions_count() -> None:
    """Two versions with different rolling counts: each step's missing source gets the mean of as many of the
    source's last values as its own version says (a worker used to keep the first version's count for good)."""
    a = StepAssembler(PolicyBook([_human("v1", 2, 0), _human("v2", 4, 1000)]))
    recent = RecentValues()
    for value in (0.0, 0.0, 1.0, 1.0):
        recent.add("human/*", value, 4)
    old, new = StepState("l-1"), StepState("l-2")
    a.fold(old, DISPATCH, at(dispatch("s-1", "l-1", 0, 1), 10))  # under v1
    a.fold(new, DISPATCH, at(dispatch("s-1", "l-2", 1, 2), 2000))  # under v2
    assert (old.reward_policy, new.reward_policy) == ("v1", "v2")
    assert a.pass_windows(old, T0 + 5000 * S, recent) and a.pass_windows(new, T0 + 5000 * S, recent)
    assert old.imputed == {"human/*": pytest.approx(1.0)}  # the last 2
    assert new.imputed == {"human/*": pytest.approx(0.5)}  # the last 4


def test_with_no_values_yet_a_rolling_mean_imputes_nothing_and_the_step_is_partial() -> None:
    a = StepAssembler(PolicyBook([_human("v1", 2, 0)]))
    state = StepState("l-1")
    a.fold(state, DISPATCH, at(dispatch("s-1", "l-1", 0, 1), 10))
    a.fold(state, REWARD, signal("l-1", "judge", 1.0, 11, 2))  # a source the policy does not require
    assert a.pass_windows(state, T0 + 5000 * S, RecentValues()) and state.imputed == {}
    [transition] = [r for name, r in a.outputs(state) if name.endswith("Transition")]
    assert transition["reward_status"] == "partial"


def test_the_worker_remembers_the_values_of_sources_that_impute_a_rolling_mean_only() -> None:
    worker = StepProcessor(StepAssembler(PolicyBook([_human("v1", 2, 0)])))
    for value in (0.25, 0.5, 1.0):
        worker._remember(signal("l-1", "human", value, 1, 1))
    worker._remember(signal("l-1", "judge", 0.75, 1, 2))
    assert worker._recent.mean("human/*", 2) == pytest.approx(0.75)
    assert worker._recent.mean("judge/*", 2) is None
