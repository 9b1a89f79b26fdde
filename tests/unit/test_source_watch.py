"""SourceWatch: a required reward source that sent nothing for longer than its window while steps wait for it."""

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


def test_silent_only_while_a_step_waits_longer_than_the_window() -> None:
    watch = SourceWatch()
    assert watch.check(POLICY, 1_000.0) == ([], []), "no steps yet: nothing waits"
    watch.saw(1_000.0, set(), dispatched=True)
    watch.saw(1_005.0, set(), dispatched=True)  # the first step starts the clock
    assert watch.check(POLICY, 1_009.0) == ([], [])
    silent, recovered = watch.check(POLICY, 1_011.0)
    assert [(s.source, s.silent_s, s.window_s, s.ever_seen) for s in silent] == [("judge", 11.0, 10, False)]
    assert recovered == []
    assert watch.check(POLICY, 1_012.0) == ([], []), "warned once per silence"
    watch.saw(1_013.0, {"judge"}, dispatched=False)
    assert watch.check(POLICY, 1_014.0) == ([], ["judge"])
    assert watch.check(POLICY, 1_100.0)[0] == [], "no step since its last signal: nothing waits for it"
    watch.saw(1_101.0, set(), dispatched=True)
    silent, _ = watch.check(POLICY, 1_112.0)
    assert [(s.source, s.silent_s, s.ever_seen) for s in silent] == [("judge", 11.0, True), ("human", 112.0, False)]


def test_a_source_no_longer_required_is_no_longer_silent() -> None:
    watch = SourceWatch()
    watch.saw(0.0, set(), dispatched=True)
    assert [s.source for s in watch.check(POLICY, 200.0)[0]] == ["judge", "human"]
    assert watch.check(RewardPolicy(version="p2"), 201.0) == ([], ["human", "judge"])
