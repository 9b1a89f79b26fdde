"""SourceWatch: a required reward source that sent nothing for longer than its window while steps arrived."""

from __future__ import annotations

from processors.steps.policy import RewardPolicy, RewardSpec
from processors.steps.source_watch import SourceWatch

POLICY = RewardPolicy(
    version="p1",
    specs=(
        RewardSpec(source="judge", window_s=10, required=True),
        RewardSpec(source="human", window_s=100, required=True),
        RewardSpec(source="optional", window_s=1),
    ),
)


def test_silent_only_after_steps_arrived_and_the_window_passed() -> None:
    watch = SourceWatch()
    assert watch.check(POLICY, 1_000.0) == ([], []), "no steps yet: nothing is waiting"
    watch.saw_dispatch(1_000.0)
    watch.saw_dispatch(1_005.0)  # the first dispatch starts the clock
    assert watch.check(POLICY, 1_009.0) == ([], [])
    silent, recovered = watch.check(POLICY, 1_011.0)
    assert [(s.source, s.silent_s, s.window_s, s.ever_seen) for s in silent] == [("judge", 11.0, 10, False)]
    assert recovered == []
    assert watch.check(POLICY, 1_012.0) == ([], []), "warned once per silence"
    watch.saw_signal("judge", 1_013.0)
    assert watch.check(POLICY, 1_014.0) == ([], ["judge"])
    silent, _ = watch.check(POLICY, 1_030.0)
    assert [(s.source, s.silent_s, s.ever_seen) for s in silent] == [("judge", 17.0, True)]


def test_a_source_no_longer_required_is_no_longer_silent() -> None:
    watch = SourceWatch()
    watch.saw_dispatch(0.0)
    assert [s.source for s in watch.check(POLICY, 200.0)[0]] == ["judge", "human"]
    assert watch.check(RewardPolicy(version="p2"), 201.0) == ([], ["human", "judge"])
