"""Self-diagnosis's pure part: one name per action whatever the params' key order, failures counted per event-time
window against a brute-force oracle, the running reward variance against statistics.variance, and stalls in due
order; every detector survives its JSON form (what the processor keeps in its table)."""

from __future__ import annotations

import json
import math
import random
import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from processors.plans.symptoms import (
    FailureWindow,
    RewardVariance,
    Watch,
    action_rule,
    params_hash,
    severity_of_failures,
    stalled,
    subgoal_action,
    work_action,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@given(st.dictionaries(st.text(max_size=6), json_values, max_size=6), st.randoms(use_true_random=False))
def test_params_hash_is_the_same_for_any_key_order_and_spacing(params: dict, rnd: random.Random) -> None:
    items = list(params.items())
    rnd.shuffle(items)
    shuffled = json.dumps(dict(items), indent=rnd.choice([None, 2]))
    assert params_hash(shuffled) == params_hash(json.dumps(params))
    assert len(params_hash(shuffled)) == 16


def test_params_hash_tells_different_params_apart_and_hashes_text_that_is_not_json() -> None:
    assert params_hash('{"q": "a"}') != params_hash('{"q": "b"}')
    assert params_hash("not json") == params_hash("not json") != params_hash("not json ")
    assert action_rule("search", "abc") == "search#abc"


def test_a_window_counts_failures_within_it_and_ignores_repeats_and_stale_ones() -> None:
    window = FailureWindow()
    assert window.add(10, "a", 100) == 1
    assert window.add(50, "b", 100) == 2
    assert window.add(50, "b", 100) is None  # a replay
    assert window.add(120, "c", 100) == 2  # (20, 120]: b and c
    assert window.add(30, "d", 100) == 2  # out of order: (-70, 30] holds a and d
    assert window.add(20, "e", 100) is None  # 120 - 100 = 20: too old to count
    assert window.add(250, "f", 100) == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 30)), max_size=60), st.integers(1, 300))
def test_a_window_counts_like_a_brute_force_oracle(failures: list[tuple[int, int]], window_us: int) -> None:
    window, accepted, newest, times = FailureWindow(), {}, None, {}
    for drawn, n in failures:
        event_id = f"e{n}"
        at = times.setdefault(event_id, drawn)  # a repeated event (a replay) has its event time
        got = window.add(at, event_id, window_us)
        if event_id in accepted or (newest is not None and at <= max(newest, at) - window_us):
            assert got is None
            continue
        newest = at if newest is None else max(newest, at)
        accepted[event_id] = at
        assert got == sum(1 for t in accepted.values() if at - window_us < t <= at)
        window = FailureWindow.from_json(json.loads(json.dumps(window.to_json())))  # through the table


def test_advice_is_given_once_per_burst() -> None:
    window = FailureWindow()
    assert not window.should_advise(2, 10, 3)
    assert window.should_advise(3, 10, 3)
    window.advised_until = 110
    assert not window.should_advise(4, 50, 3)
    assert window.should_advise(3, 110, 3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e3, 1e3, allow_nan=False), st.integers(0, 40)), max_size=60))
def test_the_running_variance_is_the_sample_variance_of_the_rewards_counted_once(
    rewards: list[tuple[float, int]],
) -> None:
    stats, counted = RewardVariance(), {}
    for value, n in rewards:
        assert stats.add(value, f"r{n}") == (f"r{n}" not in counted)
        counted.setdefault(f"r{n}", value)
        stats = RewardVariance.from_json(json.loads(json.dumps(stats.to_json())))
    values = list(counted.values())
    assert stats.n == len(values)
    if len(values) >= 2:
        assert math.isclose(stats.variance, statistics.variance(values), rel_tol=1e-6, abs_tol=1e-6)
        assert math.isclose(stats.mean, statistics.fmean(values), rel_tol=1e-9, abs_tol=1e-9)
    else:
        assert stats.variance == 0.0


def test_the_variance_forgets_the_oldest_ids_past_its_bound() -> None:
    stats = RewardVariance()
    for i in range(RewardVariance.MAX_IDS + 5):
        stats.add(float(i % 2), f"r{i}")
    assert len(stats.seen) == RewardVariance.MAX_IDS and stats.seen[0] == "r5"


@given(st.dictionaries(st.text(min_size=1, max_size=3), st.integers(0, 100), max_size=20), st.integers(0, 100))
def test_stalled_lists_the_due_watches_in_due_order(dues: dict[str, int], now: int) -> None:
    watches = {k: Watch(due, 0, "t", "h", {}) for k, due in dues.items()}
    found = stalled(watches, now)
    assert set(found) == {k for k, due in dues.items() if due <= now}
    assert found == sorted(found, key=lambda k: (dues[k], k))
    for key in found:
        assert Watch.from_json(json.loads(json.dumps(watches[key].to_json()))) == watches[key]


def test_a_subgoal_attempt_runs_the_subgoal_then_its_fallback() -> None:
    spec = {"tool": "gen", "agent": None, "params_json": '{"n": 1}', "retry": {"max_attempts": 2},
            "fallback": {"tool": None, "agent": "helper", "params_json": "{}"}}  # fmt: skip
    main, backup = ("gen", params_hash('{"n":1}')), ("helper", params_hash("{}"))
    assert [subgoal_action(spec, n) for n in (1, 2, 3, 4)] == [main, main, backup, backup]
    assert [subgoal_action(spec, n, fallback_from=2) for n in (1, 2, 3)] == [main, backup, backup]
    assert subgoal_action({**spec, "fallback": None}, 3) == main
    assert work_action({"agent": "a"}) == ("a", params_hash("{}"))


def test_failure_severity_grows_with_the_count() -> None:
    assert [severity_of_failures(n, 3) for n in (2, 3, 5, 6)] == ["low", "medium", "medium", "high"]
