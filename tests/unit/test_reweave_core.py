"""Re-weaving on the pure core: with the live policy it gives the live worker's final rows, for any arrival order."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processors.steps.assembler import StepAssembler, StepState
from processors.steps.policy import PolicyBook, RewardPolicy, RewardSpec
from processors.steps.reweave import END_OF_TIME_US, policy_book, reweave
from tests.factories import dispatch, result, reward
from topics.names import DISPATCH, LATE_REWARD, REWARD, TOOL_RESULT, TRANSITION, WOVEN_REWARD

S = 1_000_000
T0 = 1_760_000_000 * S
LAG_US = 5 * S

POLICY = RewardPolicy(
    version="live-1",
    orphan_wait_s=30,
    specs=(
        RewardSpec(source="judge", window_s=10, grace_s=5, required=True),
        RewardSpec(source="human", window_s=100, required=True, imputation="default", default_value=0.0),
        RewardSpec(source="metric", window_s=50, weight=2.0),
    ),
)
SOURCES = ["judge", "human", "metric", "other"]


def at(record: dict, seconds: float) -> dict:
    record["envelope"]["event_time"] = T0 + int(seconds * S)
    return record


def live_final_rows(events: list[tuple[str, dict]], policies: PolicyBook) -> dict:
    """What the live worker's tables keep (the highest revision per key) after it folds `events` in this arrival
    order: after each event the watermark moves to the newest event time seen minus the lag and every step settles
    (windows close, orphans are reported), as StepProcessor does after a batch; at the end the idle watermark passes
    every window."""
    assembler = StepAssembler(policies)
    states: dict[str, StepState] = {}
    published: list[tuple[str, dict]] = []
    newest = None

    def settle(watermark: int) -> None:
        for state in states.values():
            if state.dispatch is None:
                for event_id, signal in sorted(state.rewards.items()):
                    if event_id not in state.orphans and assembler.orphan_deadline_us(signal) <= watermark:
                        published.append((LATE_REWARD, assembler.orphan(state, event_id)))
            else:
                assembler.settle_windows(state, watermark)
                published.extend(assembler.outputs(state))

    for schema_name, record in events:
        lid = record["envelope"]["logical_event_id"]
        state = states.setdefault(lid, StepState(lid))
        assembler.fold(state, schema_name, record)
        event_time = record["envelope"]["event_time"]
        newest = event_time if newest is None else max(newest, event_time)
        settle(newest - LAG_US)
    settle(END_OF_TIME_US)
    return final(published)


def final(rows: list[tuple[str, dict]]) -> dict:
    """The rows ReplacingMergeTree keeps: per key, the highest revision."""
    keys = {
        TRANSITION: lambda r: ("t", r["session_id"], r["logical_event_id"]),
        WOVEN_REWARD: lambda r: ("w", r["session_id"], r["logical_event_id"]),
        LATE_REWARD: lambda r: ("l", r["event_id"]),
    }
    kept: dict = {}
    for schema_name, record in rows:
        key = keys[schema_name](record)
        if key not in kept or record["revision"] >= kept[key]["revision"]:
            kept[key] = record
    return kept


@st.composite
def histories(draw: st.DrawFn) -> list[tuple[str, dict]]:
    """Steps with a dispatch (or, one in eight, none), a tool result or not, and rewards from any source at any
    delay (early, in window, in grace, late), some duplicated."""
    events: list[tuple[str, dict]] = []
    seq = 0
    for k in range(draw(st.integers(1, 5))):
        lid = f"step-{k}"
        start = k * 7.0
        if draw(st.integers(0, 7)) > 0:
            events.append((DISPATCH, at(dispatch("s-1", lid, k, seq := seq + 1), start)))
            if draw(st.booleans()):
                events.append((TOOL_RESULT, at(result("s-1", lid, seq := seq + 1), start + 1)))
        for _ in range(draw(st.integers(0, 4))):
            source = draw(st.sampled_from(SOURCES))
            delay = draw(st.sampled_from([-3.0, 2.0, 9.0, 14.0, 16.0, 60.0, 101.0, 400.0]))
            value = draw(st.sampled_from([-1.0, 0.0, 0.5, 1.0]))
            signal = at(reward("s-1", lid, seq := seq + 1, value, source, draw(st.sampled_from([0.5, 1.0]))),
                        start + delay)  # fmt: skip
            events.append((REWARD, signal))
            if draw(st.integers(0, 5)) == 0:
                events.append((REWARD, signal))  # a duplicate
    return events


def comparable(rows: dict) -> dict:
    """Late rows by event id without their revision, and without ORPHAN_RESOLVED rows: whether a reward was reported
    as an orphan before its dispatch came is arrival timing (processors.steps.reweave's docstring)."""
    out = {}
    for key, record in rows.items():
        if key[0] == "l":
            if record["reason"] == "ORPHAN_RESOLVED":
                continue
            record = {k: v for k, v in record.items() if k != "revision"}
        out[key] = record
    return out


@settings(max_examples=150, deadline=None)
@given(histories(), st.randoms(use_true_random=False))
def test_reweave_with_the_live_policy_gives_the_live_final_rows_for_any_arrival_order(events, rng) -> None:
    arrival = list(events)
    rng.shuffle(arrival)
    live = live_final_rows(arrival, PolicyBook([POLICY]))
    again = reweave(events, policy_book(POLICY))
    assert comparable(final(again.rows)) == comparable(live)
    transitions = [r for name, r in again.rows if name == TRANSITION]
    assert all(t["reward_status"] != "pending" for t in transitions), "every window of the past has passed"
    assert len(again.rows) == len(final(again.rows)), "one final row per key, nothing intermediate"


def test_a_changed_policy_changes_exactly_the_steps_it_affects() -> None:
    events = [
        (DISPATCH, at(dispatch("s-1", "a", 0, 1), 0)),
        (REWARD, at(reward("s-1", "a", 2, 1.0, "judge"), 2)),
        (REWARD, at(reward("s-1", "a", 3, 0.0, "human"), 50)),
        (DISPATCH, at(dispatch("s-1", "b", 1, 4), 10)),
        (REWARD, at(reward("s-1", "b", 5, 0.5, "judge"), 12)),
        (REWARD, at(reward("s-1", "b", 6, 0.5, "human"), 60)),
    ]
    # weigh the judge 3x: step b's components agree, so only step a's value moves
    heavier = POLICY.model_copy(
        update={"version": "judge-x3", "specs": (POLICY.specs[0].model_copy(update={"weight": 3.0}), *POLICY.specs[1:])}
    )
    live = {r["logical_event_id"]: r for n, r in reweave(events, policy_book(POLICY)).rows if n == TRANSITION}
    other = {r["logical_event_id"]: r for n, r in reweave(events, policy_book(heavier)).rows if n == TRANSITION}
    assert live["a"]["reward"] == pytest.approx(0.5) and other["a"]["reward"] == pytest.approx(0.75)
    assert other["b"]["reward"] == pytest.approx(live["b"]["reward"])
    assert {k: v for k, v in other["b"].items() if k != "reward_components"} == {
        k: v for k, v in live["b"].items() if k != "reward_components"
    }


def test_reweave_skips_what_the_step_processor_skips_and_reports_orphans() -> None:
    episode = at(reward("s-1", "e", 1, 1.0, "judge"), 0)
    episode["envelope"]["attributes"] = {"scope": "episode"}
    orphan = at(reward("s-1", "nobody-dispatched", 2, 1.0, "judge"), 0)
    done = reweave([(REWARD, episode), (REWARD, orphan), ("treadle.events.LifecycleEvent", {})], policy_book(POLICY))
    assert done.orphans == 1 and done.steps == 0 and done.events == 1
    [(name, row)] = done.rows
    assert name == LATE_REWARD and row["reason"] == "ORPHAN"


def test_a_policy_effective_later_still_applies_to_every_step_re_woven() -> None:
    later = POLICY.model_copy(update={"effective_from_us": T0 + 1000 * S})
    events = [(DISPATCH, at(dispatch("s-1", "a", 0, 1), 0)), (REWARD, at(reward("s-1", "a", 2, 1.0, "judge"), 1))]
    rows = reweave(random.sample(events, 2), policy_book(later)).rows
    assert {r["reward_policy_version"] for n, r in rows if n == WOVEN_REWARD} == {"live-1"}


def test_a_backfilled_reward_source_publishes_what_it_would_live_and_its_signals_are_woven() -> None:
    from sinks.variants import VariantError, checked_variant, variant_rows
    from tests.plugin_example import ToolSuccess
    from treadle.reweave import run_plugin

    events = [
        (DISPATCH, at(dispatch("s-1", "a", 0, 1), 0)),
        (TOOL_RESULT, at(result("s-1", "a", 2, "ERROR"), 1)),
        (REWARD, at(reward("s-1", "a", 3, 1.0, "judge"), 2)),
        (REWARD, at(reward("s-1", "a", 4, 0.5, "human"), 3)),
    ]
    signals = run_plugin(ToolSuccess(), events)
    [signal] = signals
    assert (signal["source"], signal["value"]) == ("tool_success", -1.0)
    assert run_plugin(ToolSuccess(), events) == signals, "the same past gives the same signals (ids included)"
    rows = reweave([*events, *((REWARD, s) for s in signals)], policy_book(POLICY)).rows
    [transition] = [r for n, r in rows if n == TRANSITION]
    assert "tool_success" in [c["source"] for c in transition["reward_components"]]
    tables = variant_rows("bf", [*rows, *((REWARD, s) for s in signals)])
    assert len(tables["transitions"]) == 1 and len(tables["reward_components"]) == 1
    assert {row["variant"] for rows in tables.values() for row in rows} == {"bf"}
    for bad in ("live", "", "a b", "x'"):
        with pytest.raises(VariantError):
            checked_variant(bad)
