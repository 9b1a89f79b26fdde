"""docs/weaving-reference.md, statement by statement: each test names the statement (W<n>) it checks, on the pure core.

The last tests check the page's worked example against the assembler, and that every statement of the page has a
test here (or, for the resume case, in the pipeline test too), so the page cannot drift from the code.
"""

from __future__ import annotations

import ast
import itertools
import math
import re
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processors.steps.assembler import StepAssembler, StepState
from processors.steps.fusion import Component, FusionPolicy, FusionRule, fuse
from processors.steps.policy import PolicyBook, PolicyError, RewardPolicy, RewardSpec, parse_policy
from processors.steps.processor import StepProcessor, _Before, publishes_all
from processors.steps.recent_values import RecentValues
from processors.steps.watermarks import Watermarks
from tests.factories import dispatch, result, reward
from tests.paths import REPO_ROOT as ROOT
from topics.names import DISPATCH, LATE_REWARD, REWARD, TOOL_RESULT, TRANSITION, WOVEN_REWARD

PAGE = ROOT / "docs" / "weaving-reference.md"
S = 1_000_000
T0 = 1_760_000_000 * S
LID = "step-1"

POLICY = RewardPolicy(
    version="ref-1",
    specs=(
        RewardSpec(source="judge", window_s=10, grace_s=5, required=True),
        RewardSpec(source="human", window_s=100, required=True, imputation="default", default_value=0.0),
        RewardSpec(source="metric", window_s=50, weight=2.0),
    ),
    orphan_wait_s=30,
)


def at(record: dict, seconds: float) -> dict:
    record["envelope"]["event_time"] = T0 + round(seconds * S)
    return record


def signal(source: str, value: float, seconds: float, seq: int, confidence: float = 1.0, lid: str = LID) -> dict:
    return at(reward("s-1", lid, seq, value, source, confidence), seconds)


def step(policy: RewardPolicy = POLICY, *events: tuple[str, dict]) -> tuple[StepAssembler, StepState]:
    """A step dispatched at T0 under `policy`, with `events` folded in."""
    a = StepAssembler(PolicyBook([policy]))
    state = StepState(LID)
    a.fold(state, DISPATCH, at(dispatch("s-1", LID, 0, 1), 0))
    for name, record in events:
        a.fold(state, name, record)
    return a, state


def rows(a: StepAssembler, state: StepState) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {WOVEN_REWARD: [], TRANSITION: [], LATE_REWARD: []}
    for name, record in a.outputs(state):
        out[name].append(record)
    return out


# --- policy and specs ----------------------------------------------------------------------------------------------


def test_W1_a_step_keeps_the_policy_effective_at_its_dispatch() -> None:
    first = RewardPolicy(version="p-a")
    later = [RewardPolicy(version=v, effective_from_us=T0 + 10 * S) for v in ("p-c", "p-b")]
    book = PolicyBook([first, *later])
    assert book.for_dispatch(T0 + 9 * S).version == "p-a"
    assert book.for_dispatch(T0 + 10 * S).version == "p-c"  # same effective time: the last by name
    assert PolicyBook([RewardPolicy(version="p", effective_from_us=T0)]).for_dispatch(T0 - 1).version == "default"
    a = StepAssembler(book)
    state = StepState(LID)
    a.fold(state, DISPATCH, at(dispatch("s-1", LID, 0, 1), 20))
    book.add(RewardPolicy(version="p-z", effective_from_us=T0 + 15 * S))  # newer, known only after the dispatch
    a.fold(state, REWARD, signal("judge", 1.0, 21, 2))
    assert state.reward_policy == "p-c" and rows(a, state)[WOVEN_REWARD][0]["reward_policy_version"] == "p-c"
    state.reward_policy = "gone"  # recorded by a worker that knew it
    [woven] = rows(a, state)[WOVEN_REWARD]
    assert woven["reward_policy_version"] == "default"


def test_W2_a_rewards_spec_is_exact_then_wildcard_then_default() -> None:
    policy = RewardPolicy(
        specs=(RewardSpec(source="judge", name="tone", window_s=1), RewardSpec(source="judge", window_s=2)),
        default_window_s=7,
        default_grace_s=3,
    )
    assert policy.spec_for("judge", "tone").window_s == 1
    assert policy.spec_for("judge", "quality").window_s == 2
    other = policy.spec_for("metric", "x")
    assert (other.window_s, other.grace_s, other.weight, other.required) == (7, 3, 1.0, False)


def test_W3_every_default() -> None:
    spec = RewardSpec(source="x")
    assert (spec.name, spec.window_s, spec.grace_s, spec.weight, spec.required) == ("*", 86_400, 0, 1.0, False)
    assert (spec.imputation, spec.rolling_count) == ("none", 100)
    policy = RewardPolicy()
    assert (policy.version, policy.effective_from_us, policy.default_window_s, policy.default_grace_s) == (
        "default", 0, 86_400, 0,
    )  # fmt: skip
    assert policy.orphan_wait_s == 300
    assert (policy.fusion.name, policy.fusion.rules, policy.fusion.conflict_threshold) == (
        "confidence_weighted_mean", [], None,
    )  # fmt: skip
    assert policy.spec_for("unknown", "r").grace_s == 0  # grace 0 for a source without a spec


def test_W4_policy_push_effective_from() -> None:
    import inspect

    from treadle.cli import effective_policy, policy_push

    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    us = int(now.timestamp()) * S
    unset = RewardPolicy(version="v")
    assert effective_policy(unset, "now", now).effective_from_us == us
    assert effective_policy(unset, "+30s", now).effective_from_us == us + 30 * S
    assert effective_policy(unset, "+2h", now).effective_from_us == us + 7200 * S
    assert effective_policy(unset, "30m", now).effective_from_us == us - 1800 * S
    assert effective_policy(unset, "2026-01-01T13:00", now).effective_from_us == us + 3600 * S  # naive: UTC
    pinned = RewardPolicy(version="v", effective_from_us=5)
    assert effective_policy(pinned, "now", now).effective_from_us == 5  # the file's wins
    assert inspect.signature(policy_push).parameters["effective_from"].default.default == "+10s"
    book = PolicyBook([RewardPolicy(version="v")])
    with pytest.raises(PolicyError, match="already exists"):
        book.add(RewardPolicy(version="v", orphan_wait_s=1))
    cli_doc = (ROOT / "docs" / "cli.md").read_text()
    assert "treadle policy push FILE [--effective-from" in cli_doc and "effective_from_us" in cli_doc


# --- which rewards count -------------------------------------------------------------------------------------------


def test_W5_duplicates_and_episode_rewards_change_nothing() -> None:
    a, state = step()
    judged = signal("judge", 1.0, 2, 2)
    assert a.fold(state, REWARD, judged)
    before = rows(a, state)
    assert not a.fold(state, REWARD, dict(judged, value=-1.0))  # same event_id
    episode = signal("judge", 0.3, 3, 3)
    episode["envelope"]["attributes"] = {"scope": "episode"}
    assert not a.fold(state, REWARD, episode)
    assert rows(a, state) == before


@given(st.integers(-(10**9), 10**9))
def test_W6_in_time_up_to_window_plus_grace_with_no_lower_bound(offset_us: int) -> None:
    a, state = step()
    judged = reward("s-1", LID, 2, 1.0, "judge")
    judged["envelope"]["event_time"] = T0 + 15 * S + offset_us  # deadline: dispatch + 10 s window + 5 s grace
    a.fold(state, REWARD, judged)
    weave = a.weave(state)
    assert (len(weave.on_time), len(weave.late)) == ((1, 0) if offset_us <= 0 else (0, 1))


def test_W7_window_passes_at_dispatch_plus_window() -> None:
    a, state = step()
    assert not a.pass_windows(state, T0 + 10 * S - 1)
    assert a.pass_windows(state, T0 + 10 * S)  # the judge window: 10 s, though its deadline (grace 5 s) is later
    assert state.passed == ["judge/*"] and rows(a, state)[TRANSITION][0]["revision"] == 2
    b, judged = step(POLICY, (REWARD, signal("judge", 1.0, 2, 2)))
    before = rows(b, judged)
    assert not b.pass_windows(judged, T0 + 50 * S)  # the judge is in: its window passing changes nothing
    assert judged.passed == [] and rows(b, judged) == before


def test_W8_a_late_reward_writes_its_row_and_changes_nothing_else() -> None:
    a, state = step(POLICY, (REWARD, signal("judge", 1.0, 2, 2)), (REWARD, signal("human", 0.5, 60, 3)))
    before = rows(a, state)
    a.fold(state, REWARD, signal("judge", -1.0, 15.25, 4))
    after = rows(a, state)
    [late] = after[LATE_REWARD]
    assert (late["reason"], late["deadline"], late["lateness_ms"]) == ("AFTER_GRACE", T0 + 15 * S, 250)
    assert (late["reward_policy_version"], late["revision"]) == ("ref-1", 1)
    assert after[TRANSITION] == before[TRANSITION] and after[WOVEN_REWARD] == before[WOVEN_REWARD]


def test_W9_component_lateness_is_past_the_window_not_the_deadline() -> None:
    a, state = step(POLICY, (REWARD, signal("judge", 1.0, 12.5, 2)), (REWARD, signal("human", 1.0, -3, 3)))
    [woven] = rows(a, state)[WOVEN_REWARD]
    lateness = {c["source"]: c["lateness_ms"] for c in woven["components"]}
    assert lateness == {"judge": 2500, "human": 0}


# --- when a WovenReward exists -------------------------------------------------------------------------------------


def test_W10_while_a_required_source_waits_the_step_is_pending() -> None:
    a, state = step(POLICY, (REWARD, signal("judge", 1.0, 2, 2)), (REWARD, signal("metric", 1.0, 3, 3)))
    weave = a.weave(state)
    assert [s.key for s in weave.missing] == [s.key for s in weave.waiting] == ["human/*"]
    out = rows(a, state)
    assert out[WOVEN_REWARD] == [] and out[TRANSITION][0]["reward_status"] == "pending"


def test_W11_status_complete_imputed_partial_and_no_component() -> None:
    a, state = step(POLICY, (REWARD, signal("judge", 1.0, 2, 2)), (REWARD, signal("human", 0.0, 5, 3)))
    assert rows(a, state)[WOVEN_REWARD][0]["status"] == "complete"
    a, state = step(POLICY, (REWARD, signal("judge", 1.0, 2, 2)))
    a.pass_windows(state, T0 + 100 * S)
    assert rows(a, state)[WOVEN_REWARD][0]["status"] == "imputed"
    no_imputation = RewardPolicy(version="ref-2", specs=(POLICY.specs[0], POLICY.specs[2]))
    a, state = step(no_imputation, (REWARD, signal("metric", 1.0, 2, 2)))
    a.pass_windows(state, T0 + 10 * S)
    assert rows(a, state)[WOVEN_REWARD][0]["status"] == "partial"
    a, state = step(no_imputation)
    a.pass_windows(state, T0 + 10 * S)
    out = rows(a, state)
    assert out[WOVEN_REWARD] == [] and (out[TRANSITION][0]["reward"], out[TRANSITION][0]["reward_status"]) == (
        None, "partial",
    )  # fmt: skip
    a, state = step(RewardPolicy(version="optional"))
    a.pass_windows(state, T0 + 10**6 * S)
    transition = rows(a, state)[TRANSITION][0]
    assert (transition["reward"], transition["reward_status"]) == (None, "pending")  # nothing required, nothing in


def test_W12_imputation_is_fixed_when_the_window_passes_and_a_reward_in_grace_replaces_it() -> None:
    human = RewardSpec(source="human", window_s=100, grace_s=10, required=True, imputation="rolling_mean",
                       rolling_count=2)  # fmt: skip
    policy = RewardPolicy(version="ref-3", specs=(POLICY.specs[0], human))
    recent = RecentValues()
    a, state = step(policy, (REWARD, signal("judge", 1.0, 2, 2)))
    assert a.pass_windows(state, T0 + 100 * S, RecentValues())  # none seen: nothing imputed
    assert state.imputed == {} and rows(a, state)[WOVEN_REWARD][0]["status"] == "partial"
    for value in (0.0, 0.2, 0.6):
        recent.add("human/*", value, 2)
    a, state = step(policy, (REWARD, signal("judge", 1.0, 2, 2)))
    a.pass_windows(state, T0 + 100 * S, recent)
    recent.add("human/*", 1.0, 2)  # seen later: the imputed value stays
    assert state.imputed == {"human/*": pytest.approx(0.4)}
    [woven] = rows(a, state)[WOVEN_REWARD]
    [imputed] = [c for c in woven["components"] if c["imputed"]]
    assert (imputed["event_id"], imputed["confidence"], imputed["event_time"]) == ("imputed:human/*", 1.0, T0 + 100 * S)
    assert woven["status"] == "imputed" and woven["imputed"] == ["human"]
    a.fold(state, REWARD, signal("human", 1.0, 109, 3))  # in grace
    [woven] = rows(a, state)[WOVEN_REWARD]
    assert woven["status"] == "complete" and not any(c["imputed"] for c in woven["components"])
    a, state = step(POLICY, (REWARD, signal("judge", 1.0, 2, 2)))
    a.pass_windows(state, T0 + 100 * S)
    assert state.imputed == {"human/*": 0.0}  # imputation default: default_value


# --- fusion --------------------------------------------------------------------------------------------------------

values = st.floats(-10, 10, allow_nan=False)


@st.composite
def components(draw: st.DrawFn) -> list[Component]:
    n = draw(st.integers(1, 5))
    return [
        Component(
            event_id=f"e{i}",
            source=draw(st.sampled_from(["judge", "human", "metric"])),
            name="r",
            value=draw(values),
            confidence=draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])),
            weight=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
        )
        for i in range(n)
    ]


@settings(max_examples=200, deadline=None)
@given(components())
def test_W13_normalized_weights_and_contributions(cs: list[Component]) -> None:
    fused = fuse(cs)
    assert fused is not None
    raw = {c.event_id: c.weight * c.confidence for c in cs}
    total = sum(raw.values())
    for c in fused.contributions:
        share = raw[c.component.event_id] / total if total > 0 else 1 / len(cs)
        assert c.weight == pytest.approx(share) and c.contribution == pytest.approx(share * c.value)
    assert fused.value == pytest.approx(math.fsum(c.contribution for c in fused.contributions), abs=1e-9)
    a, state = step(POLICY, (REWARD, signal("judge", 1.0, 2, 2, 0.5)), (REWARD, signal("human", 0.0, 3, 3)))
    a.fold(state, REWARD, signal("metric", 0.5, 4, 4, 1.0))
    [woven] = rows(a, state)[WOVEN_REWARD]  # raw 0.5, 1, 2: the rows carry the normalized share
    assert {c["source"]: c["weight"] for c in woven["components"]} == pytest.approx(
        {"judge": 0.5 / 3.5, "human": 1 / 3.5, "metric": 2 / 3.5}
    )


def test_W14_component_rules_match_raw_values_multiply_and_the_first_override_picks_the_active() -> None:
    rules = [
        FusionRule(name="x2", kind="scale", factor=2, match={"value_below": 1}),
        FusionRule(name="x3", kind="scale", factor=3, match={"value_below": 1}),  # tests the raw 0.5, not 1.0
        FusionRule(name="only-human", kind="override", match={"source": "human"}),
        FusionRule(name="only-judge", kind="override", match={"source": "judge"}),
    ]
    cs = [Component("a", "judge", "r", 0.5, 1.0), Component("b", "human", "r", 4.0, 1.0)]
    fused = fuse(cs, FusionPolicy(rules=rules))
    assert fused is not None
    assert [c.value for c in fused.contributions] == [3.0, 4.0]
    assert [c.overridden for c in fused.contributions] == [True, False] and fused.value == 4.0
    assert [c.weight for c in fused.contributions] == [0.0, 1.0]


def test_W15_result_rules_follow_component_rules_and_chain_in_declared_order() -> None:
    cap = FusionRule(name="cap", kind="cap", min=-0.5, max=1)
    veto = FusionRule(name="veto", kind="veto", value=-1, match={"source": "safety"})
    scale = FusionRule(name="x10", kind="scale", factor=10)
    cs = [Component("a", "judge", "r", 0.5, 1.0), Component("b", "safety", "r", 0.5, 1.0)]
    veto_then_cap = fuse(cs, FusionPolicy(rules=[veto, cap]))
    cap_then_veto = fuse(cs, FusionPolicy(rules=[cap, scale, veto]))
    assert veto_then_cap is not None and veto_then_cap.value == -0.5
    assert cap_then_veto is not None and cap_then_veto.value == -1.0
    capped = fuse(cs, FusionPolicy(rules=[cap, scale]))  # declared before the scale, still clamps its result
    assert capped is not None and capped.value == 1.0


def test_W16_rules_fired_lists_a_cap_only_when_it_changed_the_value() -> None:
    clamp = FusionRule(name="clamp", kind="cap", min=-1, max=1)
    zero = FusionRule(name="zero", kind="veto", value=0.0)
    scale = FusionRule(name="x1", kind="scale", factor=1)
    inside = fuse([Component("a", "judge", "r", 0.5, 1.0)], FusionPolicy(rules=[clamp]))
    assert inside is not None and inside.rules_fired == [] and inside.adjustments == []
    outside = fuse([Component("a", "judge", "r", 3.0, 1.0)], FusionPolicy(rules=[clamp, scale]))
    assert outside is not None and outside.rules_fired == ["x1", "clamp"]
    already = fuse([Component("a", "judge", "r", 0.0, 1.0)], FusionPolicy(rules=[zero, clamp]))
    assert already is not None and already.rules_fired == ["zero"]  # a veto is listed when it matches


@settings(max_examples=200, deadline=None)
@given(components(), st.floats(-5, 5), st.floats(0, 5))
def test_W16_a_listed_cap_is_one_that_moved_the_value(cs: list[Component], low: float, width: float) -> None:
    fused = fuse(cs, FusionPolicy(rules=[FusionRule(name="cap", kind="cap", min=low, max=low + width)]))
    plain = fuse(cs)
    assert fused is not None and plain is not None
    assert ("cap" in fused.rules_fired) == (fused.value != plain.value)


def test_W17_conflicts_imputed_and_woven_at() -> None:
    cs = [Component("a", "judge", "r", 1.0, 1.0, event_time=5), Component("b", "human", "r", -1.0, 1.0, event_time=9),
          Component("c", "judge", "r", -1.0, 1.0, event_time=2)]  # fmt: skip
    fused = fuse(cs, FusionPolicy(conflict_threshold=1.5))
    assert fused is not None
    assert [(k.a_event_id, k.b_event_id, k.difference) for k in fused.conflicts] == [("a", "b", 2.0)]
    a, state = step(POLICY, (REWARD, signal("judge", 1.0, 2, 2)), (REWARD, signal("metric", 1.0, 30, 3)))
    a.pass_windows(state, T0 + 100 * S)
    [woven] = rows(a, state)[WOVEN_REWARD]
    assert woven["imputed"] == ["human"] and woven["woven_at"] == T0 + 100 * S  # the imputed human's time


# --- revisions and timestamps --------------------------------------------------------------------------------------


def test_W18_reward_revision_counts_rewards_in_time_and_is_0_without_a_woven_reward() -> None:
    a, state = step(POLICY, (REWARD, signal("judge", 1.0, 2, 2)))
    assert rows(a, state)[TRANSITION][0]["reward_revision"] == 0
    a.fold(state, REWARD, signal("human", 1.0, 5, 3))
    a.fold(state, REWARD, signal("metric", 1.0, 6, 4))
    a.fold(state, REWARD, signal("judge", 1.0, 99, 5))  # late
    out = rows(a, state)
    assert out[WOVEN_REWARD][0]["revision"] == out[TRANSITION][0]["reward_revision"] == 3


def test_W19_transition_revision() -> None:
    a, state = step()
    a.fold(state, DISPATCH, at(dispatch("s-1", LID, 0, 9), 0))  # a second dispatch: a producer bug, counted
    slow, fast = at(result("s-1", LID, 3), 1), at(result("s-1", LID, 4, status="ERROR"), 2)
    a.fold(state, TOOL_RESULT, slow)
    a.fold(state, TOOL_RESULT, fast)
    a.fold(state, REWARD, signal("metric", 1.0, 3, 5))
    [transition] = rows(a, state)[TRANSITION]
    assert transition["revision"] == 1 + 1 + 2 + 1 + 0 and transition["tool_status"] == "ERROR"  # highest seq
    assert state.dispatch is not None and state.dispatch["envelope"]["seq"] == 1  # the lowest seq fills the row
    a.pass_windows(state, T0 + 10 * S)  # the judge window passed while it was missing: +1
    assert rows(a, state)[TRANSITION][0]["revision"] == 6
    a.pass_windows(state, T0 + 100 * S)  # none waits now: the term is the 2 required sources
    assert rows(a, state)[TRANSITION][0]["revision"] == 7
    a.fold(state, REWARD, signal("judge", 1.0, 12, 6))  # in grace: +1 reward, the window term stays 2
    assert rows(a, state)[TRANSITION][0]["revision"] == 8


def test_W20_updated_at_ignores_late_rewards_and_imputed_components() -> None:
    a, state = step(POLICY, (TOOL_RESULT, at(result("s-1", LID, 2), 4)), (REWARD, signal("judge", 1.0, 7, 3)))
    a.fold(state, REWARD, signal("judge", 1.0, 40, 4))  # late
    a.pass_windows(state, T0 + 100 * S)  # human imputed at 100 s
    assert rows(a, state)[TRANSITION][0]["updated_at"] == T0 + 7 * S


def test_W21_a_reward_while_a_source_waits_publishes_no_transition() -> None:
    a, state = step(POLICY, (REWARD, signal("judge", 1.0, 2, 2)))
    weave = a.weave(state)
    assert not publishes_all(weave, {next(iter(state.rewards))}, reshaped=False, repeated=False)
    assert publishes_all(weave, set(), reshaped=True, repeated=False)  # a tool result or a window passing
    a.fold(state, REWARD, signal("human", 1.0, 3, 3))
    human = next(e for e, r in state.rewards.items() if r["source"] == "human")
    assert publishes_all(a.weave(state), {human}, reshaped=False, repeated=False)  # the WovenReward changes


# --- orphans -------------------------------------------------------------------------------------------------------


def test_W22_an_orphan_row_names_the_policy_effective_at_the_rewards_event_time() -> None:
    book = PolicyBook([RewardPolicy(version="old", orphan_wait_s=30),
                       RewardPolicy(version="new", orphan_wait_s=60, effective_from_us=T0 + 10 * S)])  # fmt: skip
    a = StepAssembler(book)
    state = StepState(LID)
    lonely = signal("judge", 1.0, 20, 2)
    a.fold(state, REWARD, lonely)
    assert a.orphan_deadline_us(lonely) == T0 + 80 * S
    row = a.orphan(state, lonely["envelope"]["event_id"])
    assert (row["reason"], row["deadline"], row["lateness_ms"], row["revision"]) == ("ORPHAN", T0 + 80 * S, 60_000, 1)
    assert row["reward_policy_version"] == "new"


def test_W23_a_resolved_orphan_is_judged_against_its_steps_deadline() -> None:
    for reward_at, reason, woven in ((14, "ORPHAN_RESOLVED", True), (16, "AFTER_GRACE", False)):
        a = StepAssembler(PolicyBook([POLICY]))
        state = StepState(LID)
        lonely = signal("judge", 1.0, reward_at, 2)
        a.fold(state, REWARD, lonely)
        a.orphan(state, lonely["envelope"]["event_id"])
        a.fold(state, DISPATCH, at(dispatch("s-1", LID, 0, 1), 0))
        a.fold(state, REWARD, signal("human", 0.0, 3, 3))
        out = rows(a, state)
        [late] = out[LATE_REWARD]
        assert (late["reason"], late["revision"], late["deadline"]) == (reason, 2, T0 + 15 * S)
        assert late["reward_policy_version"] == "ref-1"
        assert late["lateness_ms"] == (0 if woven else 1000)
        assert (out[WOVEN_REWARD][0]["revision"] if out[WOVEN_REWARD] else 0) == (2 if woven else 0)


# --- the watermark -------------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


TOPICS = ("actions", "tool_results", "rewards")


def warmed(clock: Clock, lag_s: float = 1, idle_s: float = 10) -> Watermarks:
    """Watermarks whose partition 0 has heard from every topic (the start hold is over)."""
    marks = Watermarks(lag_s, idle_s, clock=clock, topics=TOPICS)
    for topic in TOPICS:
        marks.observe(0, topic, T0)
    marks.advance(0)
    return marks


def test_W24_per_partition_the_slowest_active_topic_minus_the_lag() -> None:
    clock = Clock()
    marks = warmed(clock, lag_s=2)
    marks.observe(0, "actions", T0 + 50 * S)
    marks.observe(0, "rewards", T0 + 90 * S)
    assert marks.advance(0) == T0 - 2 * S  # tool_results still at T0
    marks.observe(0, "tool_results", T0 + 70 * S)
    assert marks.advance(0) == T0 + 48 * S
    marks.observe(1, "actions", T0 + 500 * S)  # another partition: its own watermark
    assert marks.advance(0) == T0 + 48 * S and marks.watermark(1) is None


def test_W25_an_idle_topic_stops_holding_and_all_idle_follows_processing_time() -> None:
    clock = Clock()
    marks = warmed(clock)
    clock.now += 6
    marks.observe(0, "actions", T0 + 50 * S)
    marks.observe(0, "rewards", T0 + 40 * S)
    clock.now += 5  # tool_results silent for 11 s
    assert marks.advance(0) == T0 + 39 * S
    clock.now += 20  # every topic idle: processing time (1031 s) is far behind these event times, so it stays
    assert marks.advance(0) == T0 + 39 * S
    idle = Watermarks(1, 10, clock=clock, topics=TOPICS)
    for topic in TOPICS:
        idle.observe(0, topic, 5 * S)
    clock.now += 30
    assert idle.advance(0) == int((clock.now - 10) * S)


def test_W26_at_first_sight_a_topic_that_has_not_delivered_holds_the_watermark() -> None:
    clock = Clock()
    marks = Watermarks(1, 10, clock=clock, topics=TOPICS)
    marks.observe(0, "rewards", T0 + 500 * S)
    marks.observe(0, "actions", T0 + 100 * S)
    assert marks.advance(0) is None and not marks.holding(0)  # the start, not a resume
    clock.now += 10
    assert marks.advance(0) == T0 + 99 * S  # tool_results idle now: no longer holds


def test_W27_after_a_silence_every_topic_holds_the_watermark_until_it_delivers() -> None:
    clock = Clock()
    marks = warmed(clock)
    clock.now += 11  # a silence
    marks.observe(0, "rewards", T0 + 20 * S)
    assert marks.advance(0) == T0 - S and marks.holding(0)  # where it was: actions and tool results hold it
    processor = StepProcessor(StepAssembler(PolicyBook([POLICY])))
    processor.watermarks = marks
    _, dispatched = step()
    assert processor._held_back(b"step-1", 0, dispatched, _Before.of(dispatched))  # its rows wait meanwhile
    assert not processor._held_back(b"l-2", 0, StepState("l-2"), _Before.of(StepState("l-2")))  # no dispatch
    clock.now += 1
    marks.observe(0, "actions", T0 + 8 * S)
    marks.observe(0, "tool_results", T0 + 9 * S)
    assert marks.advance(0) == T0 + 7 * S and not marks.holding(0)
    clock.now += 11  # another silence; this time only rewards come
    marks.observe(0, "rewards", T0 + 30 * S)
    assert marks.advance(0) == T0 + 7 * S
    clock.now += 10  # for at most the idle timeout; rewards, which delivered meanwhile, counts as heard at its end
    assert marks.advance(0) == T0 + 29 * S and not marks.holding(0)


class PublishedRows(StepProcessor):
    """A step processor whose steps live in a dict and whose rows are recorded, to test what it publishes when."""

    def __init__(self, steps: dict[bytes, StepState]) -> None:
        super().__init__(StepAssembler(PolicyBook([POLICY])))
        self.steps, self.sent = steps, []

    def _active_partitions(self) -> list[int]:
        return [0]

    def _load(self, key: bytes, partition: int) -> StepState | None:
        return self.steps.get(key)

    async def _publish(self, state, key, ctx, before, weave=None, everything=True) -> None:  # type: ignore[override]
        self.sent.append(state.logical_event_id)


def test_W27_an_offset_commit_during_the_hold_publishes_the_held_steps_that_wait_for_nothing() -> None:
    """A committed input must never leave a final row unpublished (a crash would lose it); pending ones stay held."""
    import asyncio

    clock = Clock()
    _, waiting = step()
    _, final = step(POLICY, (REWARD, signal("judge", 1.0, 2, 2)), (REWARD, signal("human", 1.0, 3, 3)))
    final.logical_event_id = "step-2"
    processor = PublishedRows({b"step-1": waiting, b"step-2": final})
    processor.watermarks = warmed(clock)
    clock.now += 11
    processor.watermarks.observe(0, "rewards", T0 + 5 * S)  # a resume: held
    for key, state in ((b"step-1", waiting), (b"step-2", final)):
        assert processor._held_back(key, 0, state, _Before.of(state))
    asyncio.run(processor._publish_resumed(None, final_only=True))  # type: ignore[arg-type]  # before a commit
    assert processor.sent == ["step-2"] and set(processor._resuming[0]) == {b"step-1"}
    asyncio.run(processor._publish_resumed(None, 0))  # type: ignore[arg-type]  # the hold ends
    assert processor.sent == ["step-2", "step-1"] and processor._resuming[0] == {}


# The resume case, deterministic: a burst after a silence, fetched one topic at a time in every order.

RESUME_POLICY = RewardPolicy(
    version="resume",
    specs=(RewardSpec(source="judge", window_s=3, grace_s=30, required=True),),
    orphan_wait_s=2,
)


class BatchLoop:
    """The step processor's batch loop on the pure core: fold a batch, move the watermark, settle, publish what
    changed, holding back a dispatched step's rows while a resume holds the watermark (StepProcessor._held_back)."""

    def __init__(self, clock: Clock) -> None:
        self.assembler = StepAssembler(PolicyBook([RESUME_POLICY]))
        self.marks = Watermarks(1, 10, clock=clock, topics=TOPICS)
        self.states: dict[str, StepState] = {}
        self.published: dict[str, list[tuple]] = defaultdict(list)

    def batch(self, topic: str, events: list[tuple[str, dict]]) -> None:
        for name, record in events:
            lid = record["envelope"]["logical_event_id"]
            self.assembler.fold(self.states.setdefault(lid, StepState(lid)), name, record)
        if events:
            self.marks.observe(0, topic, max(r["envelope"]["event_time"] for _, r in events))
        watermark = self.marks.advance(0)
        holding = self.marks.holding(0)
        for lid, state in sorted(self.states.items()):
            if watermark is not None and state.dispatch is None:
                for event_id, r in sorted(state.rewards.items()):
                    if event_id not in state.orphans and self.assembler.orphan_deadline_us(r) <= watermark:
                        self.assembler.orphan(state, event_id)
            elif watermark is not None:
                self.assembler.pass_windows(state, watermark)
            if holding and state.dispatch is not None:
                continue  # held back until the resume ends
            snapshot = self.snapshot(state)
            if snapshot and (not self.published[lid] or self.published[lid][-1] != snapshot):
                self.published[lid].append(snapshot)

    def snapshot(self, state: StepState) -> tuple:
        records = self.assembler.outputs(state)
        if state.dispatch is None:
            records = [(LATE_REWARD, self.assembler.orphan(state, e)) for e in sorted(state.orphans)]
        return tuple(
            (name, r.get("revision"), r.get("reward_status") or r.get("status") or r.get("reason"), r.get("value"))
            for name, r in records
        )


@st.composite
def bursts(draw: st.DrawFn) -> dict[str, list[tuple[str, dict]]]:
    """Events of a few steps, by topic, with event times ahead of the watermark before the silence."""
    by_topic: dict[str, list[tuple[str, dict]]] = {t: [] for t in TOPICS}
    seq = 0
    for k in range(draw(st.integers(1, 4))):
        lid = f"l-{k}"
        start = draw(st.floats(1, 20))
        if draw(st.booleans()):
            by_topic["actions"].append((DISPATCH, at(dispatch("s-1", lid, k, seq := seq + 1), start)))
        if draw(st.booleans()):
            by_topic["tool_results"].append((TOOL_RESULT, at(result("s-1", lid, seq := seq + 1), start + 0.5)))
        for delay in draw(st.lists(st.floats(-1, 40), max_size=2)):
            by_topic["rewards"].append((REWARD, signal("judge", 1.0, start + delay, seq := seq + 1, lid=lid)))
    return by_topic


@settings(max_examples=60, deadline=None)
@given(bursts())
def test_W27_the_same_burst_in_any_topic_order_gives_each_step_the_same_rows(burst) -> None:
    outcomes = []
    for order in itertools.permutations(TOPICS):
        clock = Clock()
        loop = BatchLoop(clock)
        for topic in TOPICS:  # before the silence: every topic delivered (the start hold is over)
            loop.batch(topic, [(REWARD, signal("judge", 0.0, -50, 0, lid=f"warm-{topic}"))])
        clock.now += 11  # a silence
        for topic in order:
            loop.batch(topic, burst[topic])
            clock.now += 0.5
        for _ in range(30):  # window ticks: a hold that a topic with nothing to say kept up ends by timeout
            clock.now += 0.5
            loop.batch("rewards", [])
        outcomes.append((order, dict(loop.published), loop.marks.watermark(0)))
    first_order, first, watermark = outcomes[0]
    for order, published, last in outcomes[1:]:
        differ = {lid: (first.get(lid), published.get(lid)) for lid in set(first) | set(published)
                  if first.get(lid) != published.get(lid)}  # fmt: skip
        assert (differ, last) == ({}, watermark), f"{first_order} against {order}"


@given(st.lists(st.tuples(st.sampled_from(TOPICS), st.integers(0, 10**9), st.sampled_from([0.0, 1.0, 5.0, 11.0]))))
def test_W28_the_watermark_never_goes_back(observations: list[tuple[str, int, float]]) -> None:
    clock = Clock()
    marks = Watermarks(1, 10, clock=clock, topics=TOPICS)
    last = None
    for topic, event_us, wait in observations:
        clock.now += wait
        marks.observe(0, topic, event_us)
        current = marks.advance(0)
        assert last is None or (current is not None and current >= last)
        last = current


def test_W29_a_step_closes_at_its_first_waiting_window_whatever_moved_the_watermark() -> None:
    """The timer queue is keyed by next_window_us; settling there closes the step. End to end: the weaving pipeline
    test of a window that another step's batch moves the watermark past."""
    a, state = step(POLICY, (REWARD, signal("metric", 1.0, 2, 2)))
    assert a.next_window_us(state) == T0 + 10 * S  # the judge's window, before the human's
    changed, _ = a.settle_windows(state, T0 + 10 * S)
    assert changed and a.next_window_us(state) == T0 + 100 * S
    a.settle_windows(state, T0 + 100 * S)
    assert a.next_window_us(state) is None and rows(a, state)[TRANSITION][0]["reward_status"] == "imputed"


def test_W30_horizon_and_the_event_watermark_that_expires_steps() -> None:
    policy = RewardPolicy(
        version="ref-4", specs=POLICY.specs, default_window_s=200, default_grace_s=7, orphan_wait_s=30
    )
    a, state = step(policy)
    assert a.horizon_us(state) == T0 + 207 * S  # the default window + grace is the latest deadline here
    lonely = StepState("l-2")
    a.fold(lonely, REWARD, signal("judge", 1.0, 5, 2, lid="l-2"))
    a.fold(lonely, REWARD, signal("judge", 1.0, 9, 3, lid="l-2"))
    assert a.horizon_us(lonely) == T0 + 39 * S  # no dispatch: the latest orphan deadline (30 s wait)
    clock = Clock()
    marks = Watermarks(1, 10, clock=clock, topics=TOPICS)
    for topic in TOPICS:
        marks.observe(0, topic, 5 * S)
    clock.now += 1000
    assert marks.advance(0) == int((clock.now - 10) * S)  # every topic idle: processing time
    assert marks.event_watermark(0) == marks.expiry_watermark(0) == 4 * S  # expiry stays with the events
    ahead = warmed(clock)
    ahead.observe(0, "actions", T0 + 50 * S)
    ahead.observe(0, "tool_results", T0 + 50 * S)
    ahead.observe(0, "rewards", T0 + 90 * S)
    assert ahead.advance(0) == T0 + 49 * S
    clock.now += 11  # all idle, processing time far behind: the events carry the event watermark to the newest
    assert ahead.advance(0) == T0 + 49 * S and ahead.event_watermark(0) == T0 + 89 * S
    assert ahead.expiry_watermark(0) == T0 + 49 * S  # but expiry waits for the watermark (a resume may hold it)


# --- the worked example and the page itself ------------------------------------------------------------------------


def example_policy() -> RewardPolicy:
    text = PAGE.read_text()
    block = re.search(r"<!-- example-policy -->\n```yaml\n(.*?)```", text, re.S)
    assert block, "the example policy block is missing"
    return parse_policy(block.group(1), str(PAGE))


def example_rows() -> list[list[str]]:
    text = PAGE.read_text()
    table = text.split("<!-- example-rows -->\n", 1)[1].split("\n\n", 1)[0]
    lines = [line for line in table.splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_the_worked_example_gives_the_pages_numbers() -> None:
    a = StepAssembler(PolicyBook([example_policy()]))
    state = StepState(LID)
    steps = [
        lambda: a.fold(state, DISPATCH, at(dispatch("s-1", LID, 0, 1), 0)),
        lambda: a.fold(state, TOOL_RESULT, at(result("s-1", LID, 2), 1)),
        lambda: a.fold(state, REWARD, signal("judge", 0.8, 12, 3, 0.9)),
        lambda: a.fold(state, REWARD, signal("metric", 0.5, 30, 4, 1.0)),
        lambda: a.fold(state, REWARD, signal("judge", -1.0, 16, 5, 1.0)),
        lambda: a.pass_windows(state, T0 + 100 * S),
        lambda: a.fold(state, REWARD, signal("human", 1.0, 103, 6, 1.0)),
    ]
    table = example_rows()
    assert len(table) == len(steps)
    for change, line in zip(steps, table, strict=True):
        change()
        out = rows(a, state)
        [transition] = out[TRANSITION]
        woven = out[WOVEN_REWARD][0] if out[WOVEN_REWARD] else None
        reward_text = "NULL" if transition["reward"] is None else f"{transition['reward']:.6f}".rstrip("0").rstrip(".")
        late = ", ".join(f"{r['reason']} {r['lateness_ms']} ms" for r in out[LATE_REWARD]) or "-"
        fired = ", ".join(woven["rules_fired"]) if woven and woven["rules_fired"] else "-"
        got = [str(transition["revision"]), transition["reward_status"], reward_text,
               str(transition["reward_revision"]), fired, late]  # fmt: skip
        assert got == line[2:], line[0]
    assert transition["updated_at"] == T0 + 103 * S
    weights = {c["source"]: round(c["weight"], 6) for c in woven["components"]}
    assert weights == {"judge": 0.230769, "metric": 0.512821, "human": 0.25641}
    judge = next(c for c in woven["components"] if c["source"] == "judge")
    assert judge["lateness_ms"] == 2000


def statement_ids() -> list[str]:
    return re.findall(r"^\*\*(W\d+)\.\*\*", PAGE.read_text(), re.M)


def named_ids() -> set[str]:
    """Statement ids named by the test functions (name or docstring) of this file and the resume pipeline test."""
    found: set[str] = set()
    for path in (Path(__file__), ROOT / "tests" / "integration" / "test_watermark_resume.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                text = f"{node.name} {ast.get_docstring(node) or ''}"
                found |= {f"W{n}" for n in re.findall(r"(?<![A-Za-z0-9])W(\d+)(?![0-9])", text)}
    return found


def test_every_statement_of_the_page_has_a_test_and_every_test_a_statement() -> None:
    ids = statement_ids()
    assert ids == [f"W{n}" for n in range(1, len(ids) + 1)], "statements are numbered W1, W2, ... in order"
    tested = named_ids()
    assert set(ids) - tested == set(), "statements without a test"
    assert tested - set(ids) == set(), "tests naming a statement the page does not have"
    pipeline = ast.parse((ROOT / "tests" / "integration" / "test_watermark_resume.py").read_text())
    names = [n.name for n in ast.walk(pipeline) if isinstance(n, ast.FunctionDef)]
    assert any(n.startswith("test_W27") for n in names), "the resume case has a pipeline test"


def test_the_page_is_linked_from_the_readme_and_reward_weaving() -> None:
    assert "docs/weaving-reference.md" in (ROOT / "README.md").read_text()
    assert "weaving-reference.md" in (ROOT / "docs" / "reward-weaving.md").read_text()
