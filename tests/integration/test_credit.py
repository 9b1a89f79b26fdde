"""Credit assignment: the rules' properties, the episode fold in any arrival order, and the real pipeline.

The oracle here is written from the documented semantics (processors/credit/rules.py's docstring), not from its code:
an episode of T steps is credited once its EPISODE_ENDED(steps=T) and T dispatches are in; step t (in step order)
gets R (last step only) for terminal, R/T for uniform and gamma**(T-1-t) * R for discounted.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import pytest
from hypothesis import given
from hypothesis import strategies as st

from processors.credit.processor import CreditProcessor
from processors.credit.rules import (
    CreditRule,
    EpisodeCredit,
    EpisodeState,
    RuleChoice,
    credit_event_id,
    discounted,
    episode_key,
    episode_of,
    terminal,
    uniform,
)
from sinks.sql_client import run_sql
from streams.runtime.plugins import ProcessorRegistry
from tests.factories import BASE_TIME, RawProducer, wait_for
from topics.ids import uuid7
from topics.settings import Settings
from treadle import AgentStream

DISPATCH = "treadle.events.ActionDispatched"
LIFECYCLE = "treadle.events.LifecycleEvent"
REWARD = "treadle.events.RewardSignal"

REWARDS = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)
STEPS = st.integers(min_value=1, max_value=200)
GAMMAS = st.floats(min_value=0.0, max_value=1.0)


def oracle_shares(rule: str, total: float, steps: int, gamma: float) -> list[float]:
    if rule == "terminal":
        return [total if t == steps - 1 else 0.0 for t in range(steps)]
    if rule == "uniform":
        return [total / steps for _ in range(steps)]
    return [total * gamma ** (steps - 1 - t) for t in range(steps)]


def oracle_describe(rule: str, gamma: float) -> str:
    return f"discounted(gamma={gamma})" if rule == "discounted" else rule


# -- the rules ----------------------------------------------------------------------------------------


@given(REWARDS, STEPS)
def test_uniform_and_terminal_shares_sum_to_the_reward(total: float, steps: int) -> None:
    for shares in (uniform(total, steps), terminal(total, steps)):
        assert len(shares) == steps
        assert math.isclose(math.fsum(shares), total, rel_tol=1e-9, abs_tol=1e-9)
    assert terminal(total, steps)[:-1] == [0.0] * (steps - 1)


@given(REWARDS, STEPS, GAMMAS)
def test_discounted_is_the_discounted_terminal_reward(total: float, steps: int, gamma: float) -> None:
    shares = discounted(total, steps, gamma)
    assert shares == [total * gamma ** (steps - 1 - t) for t in range(steps)]
    assert shares[-1] == total
    if gamma == 1.0:
        assert math.isclose(math.fsum(shares), total * steps, rel_tol=1e-9, abs_tol=1e-9)


@given(REWARDS, GAMMAS)
def test_a_single_step_gets_the_whole_reward_under_every_rule(total: float, gamma: float) -> None:
    for rule in CreditRule:
        assert RuleChoice(rule, gamma).shares(total, 1) == [total]


@given(REWARDS, STEPS, GAMMAS, st.sampled_from(list(CreditRule)))
def test_shares_are_deterministic(total: float, steps: int, gamma: float, rule: CreditRule) -> None:
    choice = RuleChoice(rule, gamma)
    assert choice.shares(total, steps) == choice.shares(total, steps) == oracle_shares(rule, total, steps, gamma)


def test_rule_attributes_override_the_deployment_and_bad_ones_are_refused() -> None:
    default = RuleChoice(CreditRule.DISCOUNTED, 0.9)
    assert default.overridden({}) == default
    assert default.overridden({"credit_rule": "uniform"}) == RuleChoice(CreditRule.UNIFORM, 0.9)
    assert default.overridden({"gamma": "0.5"}) == RuleChoice(CreditRule.DISCOUNTED, 0.5)
    with pytest.raises(ValueError, match="unknown credit_rule 'median'"):
        default.overridden({"credit_rule": "median"})
    with pytest.raises(ValueError, match="not a number"):
        default.overridden({"gamma": "high"})
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        default.overridden({"gamma": "1.5"})
    assert credit_event_id("r", "l") == credit_event_id("r", "l") != credit_event_id("r", "m")


def test_settings_choose_the_rule_and_refuse_a_bad_gamma(tmp_path) -> None:
    assert (Settings().credit_rule, Settings().credit_gamma) == ("discounted", 0.99)
    chosen = Settings.from_env({"TREADLE_CREDIT_RULE": "uniform", "TREADLE_CREDIT_GAMMA": "0.5"})
    assert (chosen.credit_rule, chosen.credit_gamma) == ("uniform", 0.5)
    with pytest.raises(ValueError):
        Settings.from_env({"TREADLE_CREDIT_GAMMA": "2"})
    with pytest.raises(ValueError):
        Settings.from_env({"TREADLE_CREDIT_RULE": "median"})


def test_credit_is_a_registered_reward_source() -> None:
    registry = ProcessorRegistry.discover()
    assert registry.load("credit") is CreditProcessor
    (info,) = [i for i in registry.describe()[0] if i.name == "credit"]
    assert info.kind == "reward_source" and set(info.inputs) == {DISPATCH, LIFECYCLE, REWARD}


# -- records ------------------------------------------------------------------------------------------


def env(session: str, episode: str, lid: str, seq: int, attrs: dict[str, str] | None = None) -> dict[str, Any]:
    event_id = uuid7()
    return {
        "event_id": event_id,
        "session_id": session,
        "agent_id": f"agent-{session}",
        "episode_id": episode,
        "logical_event_id": lid or event_id,
        "seq": seq,
        "event_time": BASE_TIME + seq * 1000,
        "policy_version": "pv-1",
        "trace_id": f"trace-{lid}",
        "attributes": attrs or {},
    }


def dispatch_rec(session: str, episode: str, step: int, seq: int) -> dict[str, Any]:
    lid = uuid7()
    return {
        "envelope": env(session, episode, lid, seq),
        "step": step,
        "tool": "search",
        "params_json": "{}",
        "deadline": None,
    }


def end_rec(
    session: str, episode: str, seq: int, steps: int | None, reward: float | None, attrs: dict | None = None
) -> dict[str, Any]:
    return {
        "envelope": env(session, episode, "", seq, attrs),
        "kind": "EPISODE_ENDED",
        "done": True,
        "truncated": False,
        "reason": None,
        "reward": reward,
        "steps": steps,
    }


def reward_rec(
    session: str, lid: str, seq: int, value: float, name: str = "quality", attrs: dict | None = None, episode: str = ""
) -> dict[str, Any]:
    return {
        "envelope": env(session, episode or lid, lid, seq, attrs),
        "source": "judge",
        "name": name,
        "value": value,
        "confidence": 1.0,
        "annotator": "HUMAN",
        "evidence": None,
    }


def episode_reward_rec(session: str, episode: str, seq: int, value: float, name: str, **attrs: str) -> dict[str, Any]:
    return reward_rec(session, episode, seq, value, name, {"scope": "episode", **attrs}, episode)


@dataclass
class Episode:
    """One episode's input events and what the oracle says its steps must be credited."""

    session: str
    episode: str
    steps: int  # T, as the end event says
    dispatches: list[dict] = field(default_factory=list)
    end: dict | None = None
    rewards: list[dict] = field(default_factory=list)  # scope=episode signals

    @property
    def events(self) -> list[tuple[str, dict]]:
        out = [(DISPATCH, d) for d in self.dispatches] + [(REWARD, r) for r in self.rewards]
        return out + ([(LIFECYCLE, self.end)] if self.end is not None else [])

    def expected(self, default: RuleChoice) -> dict[tuple[str, str], tuple[float, str, str, str]]:
        """(episode reward event_id, step lid) -> (share, rule, name, evidence)."""
        if self.end is None or len(self.dispatches) < self.steps:
            return {}
        lids = [d["envelope"]["logical_event_id"] for d in sorted(self.dispatches, key=lambda d: d["step"])]
        episode_rewards = [(r["envelope"], r["value"], r["name"]) for r in self.rewards]
        if self.end["reward"] is not None:
            episode_rewards.append((self.end["envelope"], self.end["reward"], "return"))
        out = {}
        for envelope, value, name in episode_rewards:
            rule = envelope["attributes"].get("credit_rule", str(default.rule))
            gamma = float(envelope["attributes"].get("gamma", default.gamma))
            evidence = f"{oracle_describe(rule, gamma)} of {envelope['event_id']} over {self.steps} steps"
            for lid, share in zip(lids, oracle_shares(rule, value, self.steps, gamma), strict=True):
                out[(envelope["event_id"], lid)] = (share, rule, name, evidence)
        return out


def fold_all(events: list[tuple[str, dict]], default: RuleChoice) -> dict[str, dict]:
    """Run the fold as the processor does (state through bytes, as in the table); every emission by event_id."""
    credit = EpisodeCredit(default)
    table: dict[bytes, bytes] = {}
    emitted: dict[str, dict] = {}
    for schema, record in events:
        episode = episode_of(schema, record)
        if episode is None:
            continue
        key = episode_key(*episode)
        state = EpisodeState.from_bytes(table[key]) if key in table else EpisodeState(*episode)
        folded = credit.fold(state, schema, record)
        if folded.changed:
            table[key] = state.to_bytes()
        for reward_key in folded.emit:
            for signal in credit.records(state, reward_key):
                first = emitted.setdefault(signal["envelope"]["event_id"], signal)
                assert first == signal, "a re-emission differs from the first emission"
    return emitted


def as_credit(emitted: dict[str, dict]) -> dict[tuple[str, str], tuple[float, str, str, str]]:
    out = {}
    for event_id, signal in emitted.items():
        e = signal["envelope"]
        key = (e["attributes"]["credit_of"], e["logical_event_id"])
        assert event_id == credit_event_id(*key)
        assert (signal["source"], signal["confidence"], signal["annotator"]) == ("credit", 1.0, "CODE")
        out[key] = (signal["value"], e["attributes"]["credit_rule"], signal["name"], signal["evidence"])
    return out


@st.composite
def workloads(draw: st.DrawFn) -> list[Episode]:
    session = "s-" + uuid7()[-6:]
    seq, step = 0, 0
    episodes = []
    for e in range(draw(st.integers(1, 3))):
        steps = draw(st.integers(0, 5))
        sent = draw(st.sampled_from([steps, steps, max(steps - 1, 0)]))  # some episodes stay incomplete
        ep = Episode(session, f"{session}-ep{e}", steps)
        for _ in range(sent):
            ep.dispatches.append(dispatch_rec(session, ep.episode, step, seq := seq + 1))
            step += 1
        reward = draw(st.none() | st.floats(-10, 10, allow_nan=False))
        attrs = draw(st.sampled_from([{}, {"credit_rule": "uniform"}, {"credit_rule": "terminal"}, {"gamma": "0.5"}]))
        ep.end = end_rec(session, ep.episode, seq := seq + 1, steps, reward, attrs)
        for name in draw(st.lists(st.sampled_from(["human", "metric"]), max_size=2, unique=True)):
            value = draw(st.floats(-10, 10, allow_nan=False))
            ep.rewards.append(
                episode_reward_rec(session, ep.episode, seq := seq + 1, value, name, credit_rule="uniform")
            )
        episodes.append(ep)
    return episodes


@hypothesis.settings(max_examples=150, deadline=None)
@given(workloads(), st.randoms(use_true_random=False))
def test_any_arrival_order_with_duplicates_credits_exactly_the_oracle(episodes: list[Episode], rng: random.Random):
    default = RuleChoice(CreditRule.DISCOUNTED, 0.9)
    events = [e for ep in episodes for e in ep.events]
    noise = [(REWARD, reward_rec(episodes[0].session, "some-step", 999, 1.0))]  # a step-level reward: not credit's
    shuffled = events + [rng.choice(events) for _ in range(len(events) // 2)] + noise
    rng.shuffle(shuffled)
    expected = {k: v for ep in episodes for k, v in ep.expected(default).items()}
    in_order = fold_all(events, default)
    any_order = fold_all(shuffled, default)
    assert as_credit(any_order) == expected
    assert any_order == in_order  # same ids, same records


def test_an_episode_waits_for_all_its_steps_even_when_its_end_comes_first() -> None:
    ep = Episode("s", "s-ep", 3)
    ep.dispatches = [dispatch_rec("s", "s-ep", step, seq) for step, seq in ((5, 1), (6, 2), (7, 3))]
    ep.end = end_rec("s", "s-ep", 4, 3, 2.0)
    credit, state = EpisodeCredit(RuleChoice(CreditRule.UNIFORM)), EpisodeState("s", "s-ep")
    assert credit.fold(state, LIFECYCLE, ep.end).emit == []
    assert credit.fold(state, DISPATCH, ep.dispatches[2]).emit == []
    assert credit.fold(state, DISPATCH, ep.dispatches[0]).emit == []
    folded = credit.fold(state, DISPATCH, ep.dispatches[1])
    assert folded.changed and folded.emit == [ep.end["envelope"]["event_id"]]
    signals = credit.records(state, ep.end["envelope"]["event_id"])
    assert [s["value"] for s in signals] == [2.0 / 3] * 3
    for signal, dispatch in zip(signals, ep.dispatches, strict=True):  # in step order, envelope from the dispatch
        d, s = dispatch["envelope"], signal["envelope"]
        for name in ("session_id", "agent_id", "episode_id", "logical_event_id", "policy_version", "trace_id"):
            assert s[name] == d[name]
        assert s["event_time"] == ep.end["envelope"]["event_time"]
        assert s["attributes"] == {"credit_rule": "uniform", "credit_of": ep.end["envelope"]["event_id"]}
        assert (signal["name"], signal["evidence"]) == (
            "return",
            f"uniform of {ep.end['envelope']['event_id']} over 3 steps",
        )
    # Later: an extra dispatch is ignored, a late episode reward is spread over the same frozen steps.
    extra = dispatch_rec("s", "s-ep", 8, 5)
    assert credit.fold(state, DISPATCH, extra) == credit.fold(state, DISPATCH, extra)
    assert credit.fold(state, DISPATCH, extra).emit == [] and len(state.dispatches) == 3
    late = episode_reward_rec("s", "s-ep", 6, 1.0, "human", credit_rule="terminal")
    folded = credit.fold(state, REWARD, late)
    assert folded.changed and folded.emit == [late["envelope"]["event_id"]]
    assert [s["value"] for s in credit.records(state, late["envelope"]["event_id"])] == [0.0, 0.0, 1.0]
    # A duplicate re-emits everything, identically (its first emission may have been lost in a crash).
    assert set(credit.fold(state, REWARD, late).emit) == {late["envelope"]["event_id"], ep.end["envelope"]["event_id"]}


def test_ends_without_steps_wait_and_bad_rules_change_nothing() -> None:
    credit, state = EpisodeCredit(), EpisodeState("s", "s-ep")
    credit.fold(state, DISPATCH, dispatch_rec("s", "s-ep", 0, 1))
    assert credit.fold(state, LIFECYCLE, end_rec("s", "s-ep", 2, None, 1.0)).emit == []
    assert state.credited is None
    before = state.to_bytes()
    with pytest.raises(ValueError, match="unknown credit_rule"):
        credit.fold(state, REWARD, episode_reward_rec("s", "s-ep", 3, 1.0, "x", credit_rule="median"))
    with pytest.raises(ValueError, match="finite"):
        credit.fold(state, LIFECYCLE, end_rec("s", "s-ep", 4, 1, math.inf))
    assert state.to_bytes() == before
    started = end_rec("s", "s-ep", 5, None, None) | {"kind": "EPISODE_STARTED"}
    assert episode_of(LIFECYCLE, started) is None
    assert episode_of(REWARD, reward_rec("s", "lid", 6, 1.0)) is None


# -- end to end -----------------------------------------------------------------------------------------


async def produce(settings: Settings, events: list[tuple[str, dict]]) -> None:
    async with RawProducer(settings) as producer:
        for name, record in events:
            await producer.send(name, record)
        await producer.flush()


def raw_workload() -> list[Episode]:
    """Two sessions, steps numbered per session; one episode stays incomplete (3 steps announced, 2 sent)."""
    episodes = []
    for session, specs in (
        ("cs-a-" + uuid7()[-6:], [(4, 1.0, {}, []), (3, None, {}, [("outcome", 0.6, {"credit_rule": "uniform"})])]),
        (
            "cs-b-" + uuid7()[-6:],
            [
                (5, -2.0, {"credit_rule": "terminal"}, [("human", 0.8, {"credit_rule": "discounted", "gamma": "0.5"})]),
                (3, 1.0, {}, []),
            ],
        ),
    ):
        seq, step = 0, 0
        for e, (steps, reward, attrs, scoped) in enumerate(specs):
            ep = Episode(session, f"{session}-ep{e}", steps)
            sent = steps if e == 0 or session.startswith("cs-a") else steps - 1
            for _ in range(sent):
                ep.dispatches.append(dispatch_rec(session, ep.episode, step, seq := seq + 1))
                step += 1
            ep.end = end_rec(session, ep.episode, seq := seq + 1, steps, reward, attrs)
            for name, value, more in scoped:
                ep.rewards.append(episode_reward_rec(session, ep.episode, seq := seq + 1, value, name, **more))
            episodes.append(ep)
    return episodes


async def sdk_episodes(settings: Settings) -> list[Episode]:
    """Two episodes from the SDK: EPISODE_ENDED carries the reward and the episode's own step count."""
    episodes = []
    async with AgentStream(settings, agent_id="sdk-agent", episode_id="sdk-ep0") as stream:
        for e, (steps, reward, attrs) in enumerate(((3, 1.0, {}), (2, -1.0, {"credit_rule": "uniform"}))):
            if e:
                await stream.lifecycle("EPISODE_STARTED", episode_id=f"sdk-ep{e}")
            ep = Episode(stream.session_id, stream.episode_id, steps)
            for i in range(steps):
                ref = await stream.dispatch("search", {"q": f"{e}-{i}"})
                ep.dispatches.append({"envelope": {"logical_event_id": ref.logical_event_id}, "step": ref.step})
            end_id = await stream.lifecycle("EPISODE_ENDED", done=True, reward=reward, attributes=attrs)
            ep.end = {"envelope": {"event_id": end_id, "attributes": attrs}, "reward": reward}
            episodes.append(ep)
    return episodes


def credited_rows(settings: Settings, sessions: list[str]) -> dict[str, dict]:
    """Per step (logical_event_id): its transition and its credit components, joined to their rule and evidence."""
    where = ", ".join(f"'{s}'" for s in sessions)
    _, transitions = run_sql(
        settings,
        "SELECT logical_event_id, revision, reward, reward_components.event_id, reward_components.source "
        f"FROM transitions_latest WHERE session_id IN ({where})",
    )
    _, signals = run_sql(
        settings,
        "SELECT r.event_id, r.value, r.name, r.evidence, e.attributes['credit_rule'], e.attributes['credit_of'] "
        "FROM reward_components_latest AS r INNER JOIN raw_events_latest AS e ON r.event_id = e.event_id "
        f"WHERE r.source = 'credit' AND r.session_id IN ({where})",
    )
    by_id = {row[0]: row[1:] for row in signals}
    rows = {}
    for lid, revision, reward, ids, sources in transitions:
        credit = {}
        for event_id, source in zip(ids, sources, strict=True):
            if source == "credit" and event_id in by_id:
                value, name, evidence, rule, credit_of = by_id[event_id]
                credit[(credit_of, lid)] = (value, rule, name, evidence)
        rows[lid] = {"revision": revision, "reward": reward, "credit": credit, "components": len(ids)}
    return rows


def test_episode_rewards_land_on_their_steps_end_to_end(deployment: Settings, worker_factory) -> None:
    settings = deployment.model_copy(update={"processors": ("steps", "credit"), "credit_gamma": 0.9})
    default = RuleChoice(CreditRule.DISCOUNTED, 0.9)
    rng = random.Random(7)
    episodes = raw_workload()
    judge = reward_rec(episodes[0].session, episodes[0].dispatches[1]["envelope"]["logical_event_id"], 50, 0.5)
    events = [e for ep in episodes for e in ep.events] + [(REWARD, judge)]
    # Ends, episode rewards and some dispatches first (across topics, shuffled); the other dispatches later.
    early = [e for e in events if e[0] != DISPATCH or rng.random() < 0.4]
    late = [e for e in events if not any(e is x for x in early)]
    rng.shuffle(early)
    rng.shuffle(late)
    asyncio.run(produce(settings, early))
    worker = worker_factory(settings).start()
    worker.wait_ready()
    episodes += asyncio.run(sdk_episodes(settings))
    asyncio.run(produce(settings, late))

    expected = {k: v for ep in episodes for k, v in ep.expected(default).items()}
    judged = judge["envelope"]["logical_event_id"]
    want = {}
    for ep in episodes:
        for d in ep.dispatches:
            lid = d["envelope"]["logical_event_id"]
            credit = {k: v for k, v in expected.items() if k[1] == lid}
            want[lid] = {"credit": credit, "components": len(credit) + (lid == judged)}
    assert sum(len(w["credit"]) for w in want.values()) == 4 + 3 + 5 * 2 + 3 + 2
    sessions = sorted({ep.session for ep in episodes})

    def settled() -> dict | None:
        rows = credited_rows(settings, sessions)
        got = {lid: {"credit": r["credit"], "components": r["components"]} for lid, r in rows.items()}
        return rows if got == want else None

    def diff() -> str:
        rows = credited_rows(settings, sessions)
        wrong = [
            f"{lid}: got {rows.get(lid)}, want {w}"
            for lid, w in want.items()
            if rows.get(lid, {}).get("credit") != w["credit"]
        ]
        return f"{len(wrong)} steps wrong:\n" + "\n".join(wrong[:10]) + f"\n{worker.log_tail(30)}"

    rows = wait_for(settled, 150, "credit on every step of the complete episodes", explain=diff)
    for lid, row in rows.items():  # the transition's reward is the mean of its components (all confidence 1)
        values = [v[0] for v in row["credit"].values()] + ([0.5] if lid == judged else [])
        assert (row["reward"] is None) == (not values)
        if values:
            assert math.isclose(row["reward"], sum(values) / len(values), rel_tol=1e-12, abs_tol=1e-12)
        assert row["revision"] == 1 + len(values)

    # Everything again, then one fresh complete episode per session (in every topic) to know the replay was read.
    asyncio.run(produce(settings, events))
    sentinels = []
    for session in sessions:
        ep = Episode(session, f"{session}-sentinel", 1)
        ep.dispatches.append(dispatch_rec(session, ep.episode, 100, 100))
        ep.end = end_rec(session, ep.episode, 101, 1, 3.0)
        ep.rewards.append(episode_reward_rec(session, ep.episode, 102, 4.0, "human"))
        sentinels.append(ep)
    asyncio.run(produce(settings, [e for ep in sentinels for e in ep.events]))
    sentinel_lids = {ep.dispatches[0]["envelope"]["logical_event_id"] for ep in sentinels}

    def sentinels_done() -> dict | None:
        now = credited_rows(settings, sessions)
        return now if all(len(now.get(lid, {}).get("credit", {})) == 2 for lid in sentinel_lids) else None

    after = wait_for(sentinels_done, 120, "the sentinel episodes' credit")
    assert {lid: r for lid, r in after.items() if lid not in sentinel_lids} == rows
    _, counts = run_sql(
        settings,
        "SELECT count() AS n, uniqExact(event_id) AS ids FROM reward_components FINAL WHERE source = 'credit'",
    )
    assert counts == [[len(expected) + 2 * len(sentinels), len(expected) + 2 * len(sentinels)]]
    _, dupes = run_sql(
        settings, "SELECT session_id, step, count() AS n FROM transitions FINAL GROUP BY session_id, step HAVING n > 1"
    )
    assert dupes == []
