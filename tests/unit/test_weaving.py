"""Reward weaving without Kafka: policies, watermarks, windows, lateness, orphans, imputation, order independence."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processors.steps.assembler import StepAssembler, StepState
from processors.steps.expiry import DueStep, index_key
from processors.steps.policy import PolicyBook, PolicyError, RewardPolicy, RewardSpec, parse_policy
from processors.steps.processor import StepProcessor, publishes_all
from processors.steps.watermarks import Watermarks
from tests.factories import dispatch, reward
from topics.names import DISPATCH, LATE_REWARD, REWARD, TRANSITION, WOVEN_REWARD

S = 1_000_000  # microseconds per second
T0 = 1_760_000_000 * S

POLICY = RewardPolicy(
    version="p1",
    specs=(
        RewardSpec(source="judge", window_s=10, grace_s=5, required=True),
        RewardSpec(source="human", window_s=100, required=True, imputation="default", default_value=0.0),
        RewardSpec(source="metric", window_s=50, weight=2.0),
    ),
    orphan_wait_s=30,
)


def at(record: dict, seconds: float) -> dict:
    record["envelope"]["event_time"] = T0 + int(seconds * S)
    return record


def signal(lid: str, source: str, value: float, seconds: float, seq: int, confidence: float = 1.0) -> dict:
    return at(reward("s-1", lid, seq, value, source, confidence), seconds)


def assembler(policy: RewardPolicy = POLICY) -> StepAssembler:
    return StepAssembler(policies=PolicyBook([policy]))


def rows(a: StepAssembler, state: StepState) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {WOVEN_REWARD: [], TRANSITION: [], LATE_REWARD: []}
    for name, record in a.outputs(state):
        out[name].append(record)
    return out


def test_no_woven_reward_until_every_required_source_arrived() -> None:
    a, state = assembler(), StepState("l-1")
    a.fold(state, DISPATCH, at(dispatch("s-1", "l-1", 0, 1), 0))
    a.fold(state, REWARD, signal("l-1", "judge", 1.0, 2, 2))
    out = rows(a, state)
    assert out[WOVEN_REWARD] == [] and out[TRANSITION][0]["reward_status"] == "pending"
    a.fold(state, REWARD, signal("l-1", "human", 0.5, 60, 3))
    [woven] = rows(a, state)[WOVEN_REWARD]
    assert woven["status"] == "complete" and woven["revision"] == 2 and woven["value"] == pytest.approx(0.75)
    assert woven["reward_policy_version"] == "p1"
    contributions = {c["source"]: c["contribution"] for c in woven["components"]}
    assert contributions == {"judge": pytest.approx(0.5), "human": pytest.approx(0.25)}


def test_close_without_a_required_source_imputes_and_a_later_arrival_in_grace_completes() -> None:
    policy = RewardPolicy(version="p2", specs=(POLICY.specs[0], POLICY.specs[1]))
    a, state = assembler(policy), StepState("l-1")
    a.fold(state, DISPATCH, at(dispatch("s-1", "l-1", 0, 1), 0))
    a.fold(state, REWARD, signal("l-1", "judge", 1.0, 2, 2))
    assert a.weave(state).next_window_us == T0 + 100 * S  # the judge is in: only human's window changes the rows
    assert a.pass_windows(state, T0 + 50 * S) is False  # past the judge's window: nothing to record
    assert state.passed == [] and rows(a, state)[WOVEN_REWARD] == []  # still waiting for human
    assert a.pass_windows(state, T0 + 100 * S) is True and a.pass_windows(state, T0 + 100 * S) is False
    assert state.passed == ["human/*"] and a.weave(state).next_window_us is None
    [woven] = rows(a, state)[WOVEN_REWARD]
    assert woven["status"] == "imputed" and woven["value"] == pytest.approx(0.5) and woven["revision"] == 1
    a.fold(state, REWARD, signal("l-1", "human", 0.0, 99, 3))
    [woven] = rows(a, state)[WOVEN_REWARD]
    assert woven["status"] == "complete" and woven["revision"] == 2


def test_close_without_imputation_is_partial() -> None:
    human = RewardSpec(source="human", window_s=100, required=True)
    policy = RewardPolicy(version="p3", specs=(POLICY.specs[0], human))
    a, state = assembler(policy), StepState("l-1")
    a.fold(state, DISPATCH, at(dispatch("s-1", "l-1", 0, 1), 0))
    a.fold(state, REWARD, signal("l-1", "judge", -1.0, 1, 2))
    a.pass_windows(state, T0 + 100 * S)
    [woven] = rows(a, state)[WOVEN_REWARD]
    assert woven["status"] == "partial" and woven["value"] == -1.0


def test_a_reward_after_window_and_grace_is_late_and_changes_nothing() -> None:
    a, state = assembler(), StepState("l-1")
    a.fold(state, DISPATCH, at(dispatch("s-1", "l-1", 0, 1), 0))
    a.fold(state, REWARD, signal("l-1", "human", 1.0, 5, 2))
    a.fold(state, REWARD, signal("l-1", "judge", 1.0, 15, 3))  # deadline 10 + 5: on time, exactly
    before = rows(a, state)
    a.fold(state, REWARD, signal("l-1", "judge", -1.0, 15.5, 4))  # half a second after grace
    after = rows(a, state)
    [late] = after[LATE_REWARD]
    assert late["reason"] == "AFTER_GRACE" and late["lateness_ms"] == 500 and late["revision"] == 1
    assert late["deadline"] == T0 + 15 * S
    assert after[WOVEN_REWARD] == before[WOVEN_REWARD] and after[TRANSITION] == before[TRANSITION]


def test_an_orphan_is_reported_and_resolved_if_its_dispatch_comes_after_all() -> None:
    a, state = assembler(), StepState("l-1")
    a.fold(state, REWARD, signal("l-1", "metric", 0.3, 1, 1))
    [(event_id, r)] = state.rewards.items()
    assert a.orphan_deadline_us(r) == T0 + 31 * S
    orphan = a.orphan(state, event_id)
    assert orphan["reason"] == "ORPHAN" and orphan["lateness_ms"] == 30_000 and state.orphans == [event_id]
    a.fold(state, DISPATCH, at(dispatch("s-1", "l-1", 0, 2), 0))
    resolved = [r for r in rows(a, state)[LATE_REWARD] if r["event_id"] == event_id]
    assert [r["reason"] for r in resolved] == ["ORPHAN_RESOLVED"] and resolved[0]["revision"] == 2


# --- order independence ------------------------------------------------------------------------------------------


@st.composite
def step_events(draw: st.DrawFn) -> list[tuple[str, dict]]:
    events = [(DISPATCH, at(dispatch("s-1", "l-1", 0, 1), 0))]
    seq = 1
    for source in draw(st.lists(st.sampled_from(["judge", "human", "metric", "other"]), max_size=6)):
        seq += 1
        delay = draw(st.floats(min_value=-5, max_value=200, allow_nan=False))
        value = draw(st.floats(min_value=-1, max_value=1, allow_nan=False))
        events.append((REWARD, signal("l-1", source, round(value, 3), round(delay, 3), seq, 0.5)))
    return events + draw(st.lists(st.sampled_from(events), max_size=3))  # duplicates


@settings(max_examples=150, deadline=None)
@given(step_events(), st.randoms(use_true_random=False), st.lists(st.floats(0, 300), max_size=4))
def test_final_rows_depend_on_the_set_of_events_not_on_order_or_watermark_timing(
    events: list[tuple[str, dict]], rnd: random.Random, watermarks: list[float]
) -> None:
    """Any arrival order, with the watermark passing windows at any points in between, ends in the same rows;
    on the way, a Transition whose content changed always has a higher revision (ReplacingMergeTree keeps it)."""

    def final(order: list[tuple[str, dict]], passes: dict[int, float]) -> dict:
        a, state = assembler(), StepState("l-1")
        emitted: list[tuple[int, dict]] = []  # (revision, the rest of the Transition)

        def emit() -> None:
            for row in rows(a, state)[TRANSITION]:
                revision, rest = row["revision"], {k: v for k, v in row.items() if k != "revision"}
                if emitted:
                    last_revision, last_rest = emitted[-1]
                    assert revision >= last_revision
                    assert rest == last_rest or revision > last_revision, "a changed row kept its revision"
                emitted.append((revision, rest))

        for i, (name, record) in enumerate(order):
            a.fold(state, name, record)
            emit()
            if i in passes:
                a.pass_windows(state, T0 + int(passes[i] * S))
                emit()
        a.pass_windows(state, T0 + 1000 * S)  # eventually the watermark passes every window
        emit()
        return rows(a, state)

    shuffled = list(events)
    rnd.shuffle(shuffled)
    passes = {rnd.randrange(len(events)): w for w in watermarks}
    assert final(events, {}) == final(shuffled, passes)


@settings(max_examples=150, deadline=None)
@given(step_events(), st.randoms(use_true_random=False), st.lists(st.floats(0, 300), max_size=4))
def test_rows_left_unpublished_differ_only_in_revision_and_the_last_published_are_final(
    events: list[tuple[str, dict]], rnd: random.Random, watermarks: list[float]
) -> None:
    """The worker publishes a step's Transition and WovenReward only when publishes_all says so: what it skips
    differs from the last published rows only in revision and updated_at, and the last published rows are the
    final rows, in any arrival order (each event its own batch, windows passing in between)."""
    order = list(events)
    rnd.shuffle(order)
    passes = {rnd.randrange(len(order)): w for w in watermarks}
    a, state = assembler(), StepState("l-1")
    published: dict[str, dict] = {}

    def change(folded: set[str], *, reshaped: bool, repeated: bool) -> None:
        weave = a.weave(state) if state.dispatch is not None else None
        now = rows(a, state)
        if publishes_all(weave, folded, reshaped=reshaped, repeated=repeated):
            published.update({name: found[0] for name, found in now.items() if name != LATE_REWARD and found})
            return
        assert now[WOVEN_REWARD] == ([published[WOVEN_REWARD]] if WOVEN_REWARD in published else [])
        skipped, last = now[TRANSITION][0], published[TRANSITION]
        assert skipped["revision"] >= last["revision"]
        assert {**skipped, "revision": 0, "updated_at": 0} == {**last, "revision": 0, "updated_at": 0}

    for i, (name, record) in enumerate(order):
        event_id = record["envelope"]["event_id"]
        if a.fold(state, name, record):
            change({event_id}, reshaped=name != REWARD, repeated=False)
        else:
            change(set(), reshaped=False, repeated=True)
        if i in passes and a.pass_windows(state, T0 + int(passes[i] * S)):
            change(set(), reshaped=True, repeated=False)
    if a.pass_windows(state, T0 + 1000 * S):  # eventually the watermark passes every window
        change(set(), reshaped=True, repeated=False)
    final = rows(a, state)
    assert published[TRANSITION] == final[TRANSITION][0]
    assert published.get(WOVEN_REWARD) == (final[WOVEN_REWARD][0] if final[WOVEN_REWARD] else None)


@settings(max_examples=100, deadline=None)
@given(step_events(), st.randoms(use_true_random=False), st.lists(st.floats(0, 300), min_size=1, max_size=6))
def test_settle_windows_hands_out_the_weave_of_the_state_as_it_stands(
    events: list[tuple[str, dict]], rnd: random.Random, watermarks: list[float]
) -> None:
    """The weave settle_windows made on the way when nothing was due is the state's weave (the worker publishes from
    it without weaving again); when windows passed it hands out none. It changes the state as pass_windows does."""
    order = list(events)
    rnd.shuffle(order)
    a, state = assembler(), StepState("l-1")
    twin, twin_state = assembler(), StepState("l-1")
    for i, (name, record) in enumerate(order):
        a.fold(state, name, record)
        twin.fold(twin_state, name, record)
        watermark = T0 + int(watermarks[i % len(watermarks)] * S)
        changed, weave = a.settle_windows(state, watermark)
        assert changed == twin.pass_windows(twin_state, watermark)
        assert state == twin_state
        if weave is not None:
            assert not changed and weave == a.weave(state)


# --- watermarks -------------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_slowest_topic_holds_the_watermark_until_it_idles_then_processing_time_moves_it() -> None:
    clock = Clock()
    marks = Watermarks(out_of_orderness_s=2, idle_timeout_s=10, clock=clock)
    assert marks.watermark(0) is None
    marks.observe(0, "actions", 100 * S)
    marks.observe(0, "rewards", 50 * S)
    assert marks.advance(0) == 48 * S  # min over topics, minus the out-of-orderness
    clock.now += 5
    marks.observe(0, "actions", 200 * S)
    assert marks.advance(0) == 48 * S  # rewards is still active (seen 5 s ago)
    clock.now += 6  # rewards silent for 11 s: it stops holding back
    assert marks.advance(0) == 198 * S
    clock.now += 20  # every topic idle: processing time minus the idle timeout
    assert marks.advance(0) == int((clock.now - 10) * S)
    assert marks.lag_s(0) == pytest.approx(10)
    assert marks.event_watermark(0) == 198 * S  # events alone carried it this far; expiry goes by this
    marks.observe(0, "rewards", 120 * S)
    clock.now += 11  # all idle again: the newest event time, not the slowest topic, carries the event watermark
    marks.advance(0)
    assert marks.event_watermark(0) == 198 * S


def test_a_topic_that_has_not_delivered_yet_holds_the_watermark_until_it_idles() -> None:
    """After a (re)start, rewards fetched before their dispatches must not move the watermark on their own."""
    clock = Clock()
    marks = Watermarks(out_of_orderness_s=1, idle_timeout_s=10, clock=clock, topics=["actions", "rewards"])
    marks.observe(0, "rewards", 500 * S)
    assert marks.advance(0) is None  # actions has not delivered on partition 0, and is not idle yet
    clock.now += 5
    marks.observe(0, "actions", 100 * S)
    assert marks.advance(0) == 99 * S  # now the slowest topic holds it, as always
    marks.observe(1, "rewards", 700 * S)
    clock.now += 5  # (rewards keeps delivering: no silence, which would be a resume)
    marks.observe(1, "rewards", 700 * S)
    clock.now += 5  # partition 1's actions stayed silent for the idle timeout: it no longer holds anything
    assert marks.advance(1) == 699 * S


@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 10**9), st.floats(0, 30)), max_size=40))
def test_watermarks_never_go_back(observations: list[tuple[str, int, float]]) -> None:
    clock = Clock()
    marks = Watermarks(out_of_orderness_s=1, idle_timeout_s=10, clock=clock)
    last = last_event = None
    for topic, event_us, wait in observations:
        clock.now += wait
        marks.observe(3, topic, event_us)
        current = marks.advance(3)
        assert last is None or current >= last
        event = marks.event_watermark(3)
        assert last_event is None or (event is not None and event >= last_event)
        assert event is None or event <= max(e for _, e, _ in observations)  # never past what events carried
        last, last_event = current, event


# --- policies ----------------------------------------------------------------------------------------------------


def test_a_step_uses_the_policy_effective_at_its_dispatch_event_time() -> None:
    old = RewardPolicy(version="v1", effective_from_us=0)
    new = RewardPolicy(version="v2", effective_from_us=T0 + 60 * S)
    book = PolicyBook([old, new])
    assert book.for_dispatch(T0).version == "v1" and book.for_dispatch(T0 + 60 * S).version == "v2"
    with pytest.raises(PolicyError, match="already exists"):
        book.add(RewardPolicy(version="v2", default_window_s=1))


def test_an_unknown_recorded_policy_version_falls_back_to_the_built_in_one_with_one_warning(caplog) -> None:
    book = PolicyBook([RewardPolicy(version="v2", specs=(RewardSpec(source="judge", required=True),))])
    with caplog.at_level("WARNING", logger="processors.steps.policy"):
        assert book.get("v1").version == "default" and book.get("v1").version == "default"
        assert book.get("v2").version == "v2" and book.get("default").version == "default"
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "'v1'" in warned[0] and "treadle policy push" in warned[0]


def test_policy_files_explain_their_mistakes() -> None:
    policy = parse_policy("version: y1\nspecs:\n  - {source: judge, required: true, window_s: 5}\n", "p.yaml")
    assert policy.spec_for("judge", "any").required and not policy.spec_for("other", "x").required
    with pytest.raises(PolicyError, match=r"p.json: specs.0.window_s"):
        parse_policy('{"specs": [{"source": "judge", "window_s": -1}]}', "p.json")
    with pytest.raises(PolicyError, match="default_value"):
        parse_policy('{"specs": [{"source": "judge", "imputation": "default"}]}', "p.json")
    with pytest.raises(PolicyError, match="more than one spec for judge/\\*"):
        parse_policy('{"specs": [{"source": "judge"}, {"source": "judge"}]}', "p.json")


def test_the_documented_policy_example_is_a_valid_policy() -> None:
    from tests.paths import REPO_ROOT

    page = (REPO_ROOT / "docs" / "reward-weaving.md").read_text()
    text = page.split("## Reward policy", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    policy = parse_policy(text, "docs/reward-weaving.md")
    assert policy.version == "prod-3" and [s.key for s in policy.required] == ["llm_judge/*", "human/*"]
    assert [r.name for r in policy.fusion.rules] == ["compliance-veto", "clamp"]


# --- expiry -----------------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(step_events(), st.sampled_from(["judge", "human", "metric", "unknown"]), st.floats(0, 5000))
def test_after_its_horizon_no_reward_changes_a_steps_rows_so_its_state_may_expire(
    events: list[tuple[str, dict]], source: str, after_s: float
) -> None:
    """A reward whose event time is past the step's horizon, from any source, only adds a late-rewards row."""
    a, state = assembler(), StepState("l-1")
    for name, record in events:
        a.fold(state, name, record)
    a.pass_windows(state, T0 + 1000 * S)
    before = rows(a, state)
    horizon = a.horizon_us(state)
    assert horizon == T0 + 86_400 * S  # the default window (1 day) of sources without a spec is the latest deadline
    late = reward("s-1", "l-1", 99, 0.5, source)
    late["envelope"]["event_time"] = horizon + 1 + int(after_s * S)
    a.fold(state, REWARD, late)
    after = rows(a, state)
    assert after[WOVEN_REWARD] == before[WOVEN_REWARD] and after[TRANSITION] == before[TRANSITION]
    late_ids = {r["event_id"] for r in after[LATE_REWARD]}
    assert late_ids == {r["event_id"] for r in before[LATE_REWARD]} | {late["envelope"]["event_id"]}


def test_a_step_with_no_dispatch_has_its_latest_orphan_deadline_as_horizon() -> None:
    a, state = assembler(), StepState("l-1")
    a.fold(state, REWARD, signal("l-1", "judge", 1.0, 5, 2))
    a.fold(state, REWARD, signal("l-1", "human", 1.0, 9, 3))
    assert a.horizon_us(state) == T0 + (9 + 30) * S


@given(st.lists(st.tuples(st.integers(0, 2**63), st.text(min_size=1, max_size=40)), min_size=2, max_size=20))
def test_expiry_index_keys_sort_by_time_then_step_and_parse_back(entries: list[tuple[int, str]]) -> None:
    keys = [index_key(t, lid) for t, lid in entries]
    assert [(d.expires_us, d.logical_event_id) for d in map(DueStep.parse, keys)] == entries
    by_key = sorted(range(len(entries)), key=lambda i: keys[i])
    assert [entries[i][0] for i in by_key] == sorted(t for t, _ in entries)


def test_the_next_window_is_the_first_of_a_missing_source() -> None:
    """Passing the window of a source already in changes nothing: no timer waits for it."""
    a, state = assembler(), StepState("l-1")
    a.fold(state, DISPATCH, at(dispatch("s-1", "l-1", 0, 1), 0))
    assert a.next_window_us(state) == T0 + 10 * S  # judge (10 s) and human (100 s) both missing: judge's first
    a.fold(state, REWARD, signal("l-1", "judge", 1.0, 2, 2))
    assert a.next_window_us(state) == T0 + 100 * S  # judge is in: human's window is the next that changes rows
    a.fold(state, REWARD, signal("l-1", "human", 1.0, 3, 3))
    assert a.next_window_us(state) is None  # every source in: no window can change the rows
    assert a.pass_windows(state, T0 + 100 * S) is False and state.passed == []
    late_judge = StepState("l-2")
    a.fold(late_judge, DISPATCH, at(dispatch("s-1", "l-2", 0, 1), 0))
    a.fold(late_judge, REWARD, signal("l-2", "judge", 1.0, 16, 2))  # after window 10 + grace 5: not in
    assert a.next_window_us(late_judge) == T0 + 10 * S


def test_catching_up_defers_only_a_dispatched_step_still_waiting_and_remembers_it_until_its_rows_go_out() -> None:
    a = assembler()
    processor = StepProcessor(a)
    waiting = StepState("l-1")
    a.fold(waiting, DISPATCH, at(dispatch("s-1", "l-1", 0, 1), 0))
    a.fold(waiting, REWARD, signal("l-1", "judge", 1.0, 2, 2))  # human still missing
    assert processor._defers(b"l-1", 0, waiting, a.weave(waiting), catching_up=True)
    assert processor._deferred[0] == {b"l-1"}
    assert not processor._defers(b"l-1", 0, waiting, a.weave(waiting), catching_up=False)  # caught up: out now
    assert processor._deferred[0] == set()
    processor._defers(b"l-1", 0, waiting, a.weave(waiting), catching_up=True)
    a.fold(waiting, REWARD, signal("l-1", "human", 0.5, 60, 3))  # final: never deferred, no longer remembered
    assert not processor._defers(b"l-1", 0, waiting, a.weave(waiting), catching_up=True)
    assert processor._deferred[0] == set()
    orphan = StepState("l-2")  # no dispatch: its orphan reports go out while catching up too
    a.fold(orphan, REWARD, signal("l-2", "judge", 1.0, 2, 4))
    a.orphan(orphan, next(iter(orphan.rewards)))
    assert not processor._defers(b"l-2", 0, orphan, a.weave(orphan), catching_up=True)


def test_episode_rewards_without_the_credit_processor_are_reported_once(caplog) -> None:
    from streams.runtime.processor import InputEvent
    from topics.intake import SourceMessage

    def episode_reward(seq: int) -> InputEvent:
        record = reward("s-1", f"l-{seq}", seq, 1.0, "outcome")
        record["envelope"]["attributes"] = {"scope": "episode"}
        return InputEvent(REWARD, record, SourceMessage("rewards", 0, seq, b"s-1", b"", 0))

    processor = StepProcessor(assembler())
    processor.credits_episodes = False  # as setup() finds it with TREADLE_PROCESSORS=steps
    with caplog.at_level("WARNING", logger="processors.steps.processor"):
        processor._episode_reward(episode_reward(1))
        processor._episode_reward(episode_reward(2))
        processor.credits_episodes, processor._warned_episode_reward = True, False
        processor._episode_reward(episode_reward(3))  # credit runs: nothing to say
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "TREADLE_PROCESSORS" in warned[0]
