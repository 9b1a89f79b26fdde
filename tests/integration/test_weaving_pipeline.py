"""Reward weaving end to end (real broker, worker, chDB) against an oracle of the documented semantics.

The oracle below is written from docs/reward-weaving.md, not from the worker's code: for each step, the
rewards in time (event_time <= dispatch + window + grace of their source), the late ones, the required
sources missing, the imputed values, the fused value (weight x confidence weighted mean), the status and
the revisions; rewards of steps never dispatched are orphans. It is compared with transitions_latest,
woven_rewards_latest and late_rewards_latest once the worker has closed every step.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka.admin import AIOKafkaAdminClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sinks.sql_client import run_sql
from tests.factories import RawProducer, dispatch, result, reward, scrape, total, wait_for
from topics.catalog import TopicCatalog
from topics.ids import uuid7
from topics.settings import Settings

S = 1_000_000
DISPATCH, REWARD = "treadle.events.ActionDispatched", "treadle.events.RewardSignal"
RESULT = "treadle.events.ToolResult"

POLICY = {
    "version": "weave-test-1",
    "default_window_s": 1000,
    "orphan_wait_s": 30,
    "specs": [
        {"source": "judge", "window_s": 10, "grace_s": 5, "required": True},
        {"source": "human", "window_s": 100, "required": True, "imputation": "default", "default_value": 0.0},
        {"source": "metric", "window_s": 50, "weight": 2.0},
    ],
}
SPECS = {s["source"]: s for s in POLICY["specs"]}
DELAYS = [-2.0, 1.0, 8.0, 14.0, 15.0, 16.0, 40.0, 60.0, 99.0, 101.0, 250.0, 1500.0]


@dataclass
class Step:
    session: str
    index: int
    lid: str
    dispatched_us: int | None  # None: never dispatched, its rewards are orphans
    rewards: list[dict] = field(default_factory=list)


def window(source: str) -> tuple[float, float, float]:
    spec = SPECS.get(source, {})
    return spec.get("window_s", POLICY["default_window_s"]), spec.get("grace_s", 0.0), spec.get("weight", 1.0)


def oracle(steps: list[Step]) -> tuple[dict, dict]:
    """(expected per (session, step): transition + woven fields, expected late rows by event_id)."""
    expected, late = {}, {}
    for step in steps:
        distinct = {r["envelope"]["event_id"]: r for r in step.rewards}
        if step.dispatched_us is None:
            for event_id in distinct:
                late[event_id] = ("ORPHAN", POLICY["orphan_wait_s"] * 1000)
            continue
        on_time = []
        for event_id, r in distinct.items():
            win, grace, weight = window(r["source"])
            lateness = r["envelope"]["event_time"] - (step.dispatched_us + int((win + grace) * S))
            if lateness > 0:
                late[event_id] = ("AFTER_GRACE", lateness // 1000)
            else:
                on_time.append((r, weight))
        present = {r["source"] for r, _ in on_time}
        required = [s for s in POLICY["specs"] if s.get("required")]
        missing = [s for s in required if s["source"] not in present]
        parts = [(r["value"], w * r["confidence"]) for r, w in on_time]
        parts += [(s["default_value"], s.get("weight", 1.0)) for s in missing if s.get("imputation") == "default"]
        if parts:
            total = sum(w for _, w in parts)
            value = sum(v * w for v, w in parts) / total if total > 0 else sum(v for v, _ in parts) / len(parts)
        else:
            value = None
        if not missing:
            status = "complete"
        elif any(s.get("imputation") == "default" for s in missing):
            status = "imputed"
        else:
            status = "partial"
        expected[(step.session, step.index)] = {
            "revision": 1 + len(on_time) + len(required),  # dispatch, rewards in time, every required window passed
            "reward": value,
            "reward_status": status,
            "reward_revision": len(on_time) if value is not None else 0,
            "woven_agrees": True,
        }
    return expected, late


@st.composite
def workloads(draw: st.DrawFn) -> tuple[list[Step], list[tuple[str, dict]]]:
    base = int(time.time() * S) - 3 * 86_400 * S  # event times days ago: idle watermarks pass them all
    steps, events = [], []
    for s in range(draw(st.integers(2, 3))):
        session = f"w{s}-{uuid7()[-10:]}"
        seq = 0
        for k in range(draw(st.integers(1, 4))):
            lid = uuid7()
            dispatched = draw(st.integers(0, 9)) > 0  # about one step in ten is never dispatched
            at = base + (s * 1000 + k * 20) * S
            step = Step(session, k, lid, at if dispatched else None)
            if dispatched:
                record = dispatch(session, lid, k, seq := seq + 1)
                record["envelope"]["event_time"] = at
                events.append((DISPATCH, record))
            for source in draw(st.lists(st.sampled_from(["judge", "human", "metric", "other"]), max_size=4)):
                value = draw(st.sampled_from([-1.0, -0.5, 0.0, 0.25, 1.0]))
                record = reward(session, lid, seq := seq + 1, value, source, draw(st.sampled_from([0.5, 1.0])))
                record["envelope"]["event_time"] = at + int(draw(st.sampled_from(DELAYS)) * S)
                step.rewards.append(record)
                events.append((REWARD, record))
                if draw(st.integers(0, 5)) == 0:
                    events.append((REWARD, record))  # a duplicate
            steps.append(step)
    order = draw(st.permutations(events))
    return steps, list(order)


def weaving_settings(deployment: Settings, tmp: Path, policy_doc: dict = POLICY) -> Settings:
    policy = tmp / "policy.json"
    policy.write_text(json.dumps(policy_doc))
    return deployment.model_copy(
        update={"reward_policy": policy, "idle_timeout_s": 2.0, "watermark_lag_s": 1.0, "window_tick_s": 0.5}
    )


async def produce(settings: Settings, events: list[tuple[str, dict]]) -> None:
    async with RawProducer(settings) as producer:
        for name, record in events:
            await producer.send(name, record)
        await producer.flush()


def actual(settings: Settings) -> tuple[dict, dict]:
    """Per step: the transition's fields and its latest woven reward's; and the late rewards' verdicts."""
    _, rows = run_sql(
        settings,
        "SELECT t.session_id, t.step, t.revision, t.reward, t.reward_status, t.reward_revision, "
        "w.value, w.status, w.revision FROM transitions_latest AS t LEFT JOIN woven_rewards_latest AS w "
        "ON w.logical_event_id = t.logical_event_id",
    )
    steps = {}
    for r in rows:
        steps[(r[0], r[1])] = {"revision": r[2], "reward": r[3], "reward_status": r[4], "reward_revision": r[5]}
        # the woven reward table must say what the transition carries (value, status, revision)
        woven = (r[6], r[7], r[8]) if r[7] else (None, None, 0)  # no woven row: the join gives defaults
        carried = (r[3], r[4] if r[3] is not None else None, r[5])
        steps[(r[0], r[1])]["woven_agrees"] = woven == carried
    _, rows = run_sql(settings, "SELECT event_id, reason, lateness_ms FROM late_rewards_latest")
    late = {r[0]: (r[1], r[2]) for r in rows if r[1] != "ORPHAN_RESOLVED"}  # resolved orphans were woven
    return steps, late


def same_step(want: dict | None, got: dict | None) -> bool:
    """The oracle's step and the table's agree; the fused reward to 1e-9 (the worker and the oracle add the weighted
    values in different orders, so 0.3 can come back as 0.30000000000000004)."""
    if want is None or got is None:
        return want is got
    if want["reward"] is None or got["reward"] is None:
        if want["reward"] != got["reward"]:
            return False
    elif abs(want["reward"] - got["reward"]) > 1e-9:
        return False
    return {k: v for k, v in got.items() if k != "reward"} == {k: v for k, v in want.items() if k != "reward"}


def matches(settings: Settings, steps: list[Step]):
    want_steps, want_late = oracle(steps)

    def check() -> bool:
        got_steps, got_late = actual(settings)
        if got_late != want_late or set(got_steps) != set(want_steps):
            return False
        return all(same_step(want, got_steps[key]) for key, want in want_steps.items())

    def explain() -> str:
        got_steps, got_late = actual(settings)
        wrong = {k: (want_steps.get(k), got_steps.get(k)) for k in set(want_steps) | set(got_steps)
                 if not same_step(want_steps.get(k), got_steps.get(k))}  # fmt: skip
        late_diff = {k: (want_late.get(k), got_late.get(k)) for k in set(want_late) | set(got_late)
                     if want_late.get(k) != got_late.get(k)}  # fmt: skip
        return f"steps (want, got): {wrong}\nlate (want, got): {late_diff}"

    return check, explain


@settings(max_examples=2, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(workload=workloads())
def test_woven_rewards_and_late_rewards_match_the_oracle(
    workload: tuple[list[Step], list[tuple[str, dict]]], deployment: Settings, worker_factory, tmp_path_factory
) -> None:
    steps, events = workload
    settings_ = weaving_settings(deployment, tmp_path_factory.mktemp("policy"))
    settings_ = settings_.model_copy(update={"topic_prefix": f"{deployment.topic_prefix}{uuid7()[-6:]}"})
    settings_ = settings_.model_copy(update={"app_id": settings_.topic_prefix, "home": settings_.home / "h"})
    from streams.runtime.worker import prepare_cluster

    asyncio.run(prepare_cluster(settings_))
    worker = worker_factory(settings_).start()
    worker.wait_ready()
    asyncio.run(produce(settings_, events))
    check, explain = matches(settings_, steps)
    wait_for(check, 120, "woven and late rewards as the oracle says", explain=explain)
    assert_late_rewards_counted_once(settings_, events)
    worker.stop()


def assert_late_rewards_counted_once(settings: Settings, events: list[tuple[str, dict]]) -> None:
    """treadle_late_rewards_total by source: one per late-rewards row, whatever revisions the row went through
    (an ORPHAN_RESOLVED row was counted once, when it was reported as an orphan)."""
    source_of = {r["envelope"]["event_id"]: r["source"] for name, r in events if name == REWARD}
    _, rows = run_sql(settings, "SELECT event_id FROM late_rewards_latest")
    want = Counter(source_of[event_id] for (event_id,) in rows)
    samples = scrape(settings)
    got = {dict(labels)["source"]: v for (n, labels), v in samples.items() if n == "treadle_late_rewards_total"}
    assert got == want


def test_kill_minus_nine_mid_window_ends_in_the_oracle_rows(deployment: Settings, worker_factory, tmp_path) -> None:
    settings_ = weaving_settings(deployment, tmp_path)
    steps, events = fixed_workload(random.Random(7))
    first, second = events[: len(events) // 2], events[len(events) // 2 :]
    worker = worker_factory(settings_).start()
    worker.wait_ready()
    asyncio.run(produce(settings_, first))
    wait_for(lambda: actual(settings_)[0], 60, "some transitions before the crash")
    worker.kill()
    asyncio.run(produce(settings_, second))
    restarted = worker_factory(settings_).start()
    restarted.wait_ready()
    check, explain = matches(settings_, steps)
    wait_for(check, 120, "the oracle's rows after the restart", explain=explain)


def test_a_step_folded_before_an_offset_commit_survives_a_kill_minus_nine_after_it(
    deployment: Settings, worker_factory, tmp_path
) -> None:
    """Changed steps are written out before Faust commits the offsets of their inputs (streams/runtime/write_behind.py):
    once committed, the dispatch and the first reward are never read again, so after a kill -9 the step can only
    come from the table's changelog. The human reward sent after the restart must join them."""
    settings_ = weaving_settings(deployment, tmp_path)
    session, lid = f"wb-{uuid7()[-10:]}", uuid7()
    at = int(time.time() * S) - 86_400 * S
    step = Step(session, 0, lid, at)
    record = dispatch(session, lid, 0, 1)
    record["envelope"]["event_time"] = at
    judged, human = reward(session, lid, 2, 1.0, "judge", 1.0), reward(session, lid, 3, 0.0, "human", 1.0)
    judged["envelope"]["event_time"], human["envelope"]["event_time"] = at + 2 * S, at + 60 * S
    step.rewards += [judged, human]
    worker = worker_factory(settings_).start()
    worker.wait_ready()
    asyncio.run(produce(settings_, [(DISPATCH, record), (REWARD, judged)]))
    wait_for(lambda: asyncio.run(committed_inputs(settings_)) >= 2, 60, "the worker to commit both input offsets")
    worker.kill()
    restarted = worker_factory(settings_).start()
    restarted.wait_ready()
    asyncio.run(produce(settings_, [(REWARD, human)]))
    check, explain = matches(settings_, [step])
    wait_for(check, 60, "the step with all three events after the restart", explain=explain)


async def committed_inputs(settings: Settings) -> int:
    """Input records the worker's consumer group has committed, over every input partition."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(settings.app_id)
    finally:
        await admin.close()
    inputs = {spec.name for spec in TopicCatalog(settings).inputs}
    return sum(meta.offset for tp, meta in offsets.items() if tp.topic in inputs and meta.offset > 0)


def fixed_workload(rng: random.Random) -> tuple[list[Step], list[tuple[str, dict]]]:
    """A deterministic workload for the crash test: every kind of reward, in a shuffled order."""
    base = int(time.time() * S) - 3 * 86_400 * S
    steps, events = [], []
    for s in range(4):
        session = f"k{s}-{uuid7()[-10:]}"
        seq = 0
        for k in range(5):
            lid = uuid7()
            at = base + (s * 1000 + k * 20) * S
            dispatched = (s, k) != (1, 2)
            step = Step(session, k, lid, at if dispatched else None)
            if dispatched:
                record = dispatch(session, lid, k, seq := seq + 1)
                record["envelope"]["event_time"] = at
                events.append((DISPATCH, record))
            for source in rng.sample(["judge", "human", "metric", "other"], rng.randint(0 if dispatched else 1, 4)):
                record = reward(session, lid, seq := seq + 1, rng.choice([-1.0, 0.5, 1.0]), source, 1.0)
                record["envelope"]["event_time"] = at + int(rng.choice(DELAYS) * S)
                step.rewards.append(record)
                events.append((REWARD, record))
            steps.append(step)
    rng.shuffle(events)
    return steps, events


def test_with_no_new_input_an_open_step_closes_within_idle_timeout_plus_window(
    deployment: Settings, worker_factory, tmp_path
) -> None:
    """Event times are now; the required human source never answers; nothing else arrives."""
    short = {**POLICY, "specs": [{**SPECS["judge"], "window_s": 2}, {**SPECS["human"], "window_s": 6}]}
    settings_ = weaving_settings(deployment, tmp_path, short)
    worker = worker_factory(settings_).start()
    worker.wait_ready()
    session, lid = f"idle-{uuid7()[-10:]}", uuid7()
    now = int(time.time() * S)
    record = dispatch(session, lid, 0, 1)
    record["envelope"]["event_time"] = now
    judged = reward(session, lid, 2, 1.0, "judge", 1.0)
    judged["envelope"]["event_time"] = now + S
    asyncio.run(produce(settings_, [(DISPATCH, record), (REWARD, judged)]))
    sent = time.monotonic()

    def closed() -> dict | None:
        _, rows = run_sql(settings_, f"SELECT reward_status, reward FROM transitions_latest WHERE step = 0 "
                                     f"AND session_id = '{session}'")  # fmt: skip
        return {"status": rows[0][0], "reward": rows[0][1]} if rows and rows[0][0] != "pending" else None

    row = wait_for(closed, 60, "the step to close with no new input", interval=0.2)
    took = time.monotonic() - sent
    # The human window (6 s) ends in event time; with no input the watermark follows processing time minus the
    # idle timeout (2 s). Slack on top: a window tick (0.5 s), a sink flush (0.2 s) and a busy 2-core machine.
    assert row == {"status": "imputed", "reward": 0.5}
    assert 6 - 1 <= took <= 6 + settings_.idle_timeout_s + 4, took


def test_a_step_expires_after_its_horizon_plus_retention_and_a_reward_after_that_is_reported(
    deployment: Settings, worker_factory, tmp_path
) -> None:
    """Step A's horizon is its dispatch + 2 s (the default window, the latest deadline); retention 3 s. Step B's
    dispatch, 20 s later in event time, moves the watermark past A's expiry, so A's state is deleted while B's stays:
    B still weaves a reward sent after that, and a reward for A is reported as an orphan, not dropped."""
    policy = {
        "version": "expiry-test-1",
        "default_window_s": 2,
        "orphan_wait_s": 1,
        "specs": [{"source": "judge", "window_s": 1, "grace_s": 1, "required": True}],
    }
    settings_ = weaving_settings(deployment, tmp_path, policy).model_copy(update={"step_retention_s": 3.0})
    worker = worker_factory(settings_).start()
    worker.wait_ready()
    session, a, b = f"expiry-{uuid7()[-10:]}", uuid7(), uuid7()
    now = int(time.time() * S)

    def at(record: dict, seconds: float) -> dict:
        record["envelope"]["event_time"] = now + int(seconds * S)
        return record

    events = [
        (DISPATCH, at(dispatch(session, a, 0, 1), 0)),
        (REWARD, at(reward(session, a, 2, 1.0, "judge", 1.0), 0.5)),
        (DISPATCH, at(dispatch(session, b, 1, 3), 20)),
    ]
    asyncio.run(produce(settings_, events))
    wait_for(lambda: total(scrape(settings_), "treadle_expired_steps_total") >= 1, 60, "step A to expire")
    assert total(scrape(settings_), "treadle_expired_steps_total") == 1  # B is not past its horizon + retention
    late_for_a = at(reward(session, a, 4, -1.0, "judge", 1.0), 10)
    asyncio.run(produce(settings_, [(REWARD, late_for_a), (REWARD, at(reward(session, b, 5, 0.25, "judge"), 20.5))]))

    def rows() -> dict | None:
        _, steps = run_sql(settings_, f"SELECT step, reward_status, reward FROM transitions_latest "
                                      f"WHERE session_id = '{session}' ORDER BY step")  # fmt: skip
        _, late = run_sql(settings_, f"SELECT event_id, reason FROM late_rewards_latest WHERE session_id = '{session}'")
        got = {"steps": [tuple(r) for r in steps], "late": [tuple(r) for r in late]}
        return got if len(got["steps"]) == 2 and got["steps"][1][1] != "pending" and got["late"] else None

    got = wait_for(rows, 60, "B's reward woven and A's late reward reported")
    assert got["steps"] == [(0, "complete", 1.0), (1, "complete", 0.25)]
    assert got["late"] == [(late_for_a["envelope"]["event_id"], "ORPHAN")]
    assert_late_rewards_counted_once(settings_, [*events, (REWARD, late_for_a)])


async def published_transitions(settings: Settings) -> list[dict]:
    """Every Transition on the transitions topic, in no particular order (not the latest rows: every revision sent)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from topics.codec import AvroCodec

    topic = TopicCatalog(settings)["transitions"].name
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, auto_offset_reset="earliest")
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in range(settings.partitions)]
        consumer.assign(partitions)
        ends = await consumer.end_offsets(partitions)
        records: list[dict] = []
        codec = AvroCodec()
        while [tp for tp, end in ends.items() if await consumer.position(tp) < end]:
            for messages in (await consumer.getmany(timeout_ms=500)).values():
                records += [codec.decode(m.value)[1] for m in messages]
        return records
    finally:
        await consumer.stop()


def test_a_catching_up_worker_defers_pending_rows_and_publishes_those_still_waiting_once_caught_up(
    deployment: Settings, worker_factory, tmp_path
) -> None:
    """A backlog in Kafka before the worker starts: 120 old steps, one a second, whose judge and human rewards follow
    their dispatch by 8 and 20 s of event time (so they are read in later batches); then fresh steps still waiting
    for their human reward (window 100 s). While catching up (>= 5 records of the partition left), a step does not
    publish a pending row: the first 60 old steps (each has dozens of its partition's records behind its last
    reward) must publish none, and every old step ends complete. Once caught up, each fresh step's pending row must
    come, long before its window passes. An orphan reward in the backlog (no dispatch; the watermark passes its
    orphan wait while catching up) is still reported."""
    settings_ = weaving_settings(deployment, tmp_path).model_copy(
        update={"catch_up_backlog": 5, "process_batch_size": 20}
    )
    base = int(time.time() * S) - 3 * 86_400 * S
    sessions = [f"cu{s}-{uuid7()[-10:]}" for s in range(4)]
    old, fresh, timed = [], [], []
    for k in range(120):
        session, lid = sessions[k % 4], uuid7()
        at = base + k * S
        record = dispatch(session, lid, k, 3 * k + 1)
        record["envelope"]["event_time"] = at
        judged = reward(session, lid, 3 * k + 2, 1.0, "judge", 1.0)
        human = reward(session, lid, 3 * k + 3, 0.0, "human", 1.0)
        judged["envelope"]["event_time"], human["envelope"]["event_time"] = at + 8 * S, at + 20 * S
        timed += [(at, DISPATCH, record), (at + 8 * S, REWARD, judged), (at + 20 * S, REWARD, human)]
        old.append(lid)
    orphan = reward(sessions[0], uuid7(), 999, 1.0, "judge", 1.0)
    orphan["envelope"]["event_time"] = base
    timed.append((base, REWARD, orphan))
    now = int(time.time() * S)
    for s, session in enumerate(sessions):
        lid = uuid7()
        record = dispatch(session, lid, 1000, 1000 + s)
        record["envelope"]["event_time"] = now
        timed.append((now, DISPATCH, record))
        fresh.append(lid)
    asyncio.run(produce(settings_, [(name, record) for _, name, record in sorted(timed, key=lambda t: t[0])]))
    worker = worker_factory(settings_).start()
    worker.wait_ready()

    def caught_up() -> list[dict] | None:
        published = asyncio.run(published_transitions(settings_))
        final = {t["logical_event_id"] for t in published if t["reward_status"] == "complete"}
        waiting = {t["logical_event_id"] for t in published if t["reward_status"] == "pending"} & set(fresh)
        return published if final >= set(old) and waiting == set(fresh) else None

    published = wait_for(caught_up, 90, "every old step complete and every fresh step's pending row", interval=0.5)
    pending = {t["logical_event_id"] for t in published if t["reward_status"] == "pending"}
    assert sorted(pending & set(old[:60])) == [], "pending rows published while catching up"
    assert time.time() * S < now + 100 * S  # the fresh steps' human window has not passed: they still wait
    orphan_id = orphan["envelope"]["event_id"]
    reported = wait_for(
        lambda: run_sql(settings_, f"SELECT reason FROM late_rewards_latest WHERE event_id = '{orphan_id}'")[1],
        30,
        "the orphan reward in late_rewards",
    )
    assert [tuple(row) for row in reported] == [("ORPHAN",)]


def test_a_window_the_input_moves_the_watermark_past_closes_with_that_batch_not_at_the_next_tick(
    deployment: Settings, worker_factory, tmp_path
) -> None:
    """Step A (a day ago) never gets its required judge reward. Step B of the same session, 20 s later in event time,
    moves the partition's watermark past A's window when its dispatch, tool result and reward are folded. A is not
    in that batch, and the window tick is an hour away (so is the idle timeout): A must still close, with that batch."""
    policy = {**POLICY, "specs": [{"source": "judge", "window_s": 2, "grace_s": 1, "required": True}]}
    settings_ = weaving_settings(deployment, tmp_path, policy).model_copy(
        update={"window_tick_s": 3600.0, "idle_timeout_s": 3600.0, "catch_up_backlog": 0}
    )
    worker = worker_factory(settings_).start()
    worker.wait_ready()
    session, a, b = f"batchclose-{uuid7()[-10:]}", uuid7(), uuid7()
    base = int(time.time() * S) - 86_400 * S

    def at(record: dict, seconds: float) -> dict:
        record["envelope"]["event_time"] = base + int(seconds * S)
        return record

    def status(step: int) -> str | None:
        _, rows = run_sql(settings_, f"SELECT reward_status FROM transitions_latest WHERE session_id = '{session}' "
                                     f"AND step = {step}")  # fmt: skip
        return rows[0][0] if rows else None

    asyncio.run(
        produce(settings_, [(DISPATCH, at(dispatch(session, a, 0, 1), 0)), (RESULT, at(result(session, a, 2), 0.1))])
    )
    assert wait_for(lambda: status(0), 60, "step A's pending row") == "pending"
    later = [
        (DISPATCH, at(dispatch(session, b, 1, 3), 20)),
        (RESULT, at(result(session, b, 4), 20.1)),
        (REWARD, at(reward(session, b, 5, 1.0, "judge", 1.0), 20.2)),
    ]
    asyncio.run(produce(settings_, later))
    assert wait_for(lambda: status(1) if status(1) == "complete" else None, 60, "step B complete") == "complete"
    assert wait_for(lambda: status(0) if status(0) != "pending" else None, 30, "step A closed") == "partial"


def test_a_duplicate_republishes_a_step_only_when_this_worker_process_has_not_published_it(
    deployment: Settings, worker_factory, tmp_path
) -> None:
    """Step A is complete. A duplicate of its judge reward sent to the worker that published A's rows publishes no
    new Transition: a row it had failed to produce would have stopped it. After a restart the worker reads A from its
    table and cannot know whether A's rows reached Kafka: the same duplicate republishes them. Each duplicate is
    followed by the dispatch of a new step of the same session (same partition, read after it) to know it was read."""
    settings_ = weaving_settings(deployment, tmp_path)
    session, a = f"dup-{uuid7()[-10:]}", uuid7()
    base = int(time.time() * S) - 86_400 * S

    def at(record: dict, seconds: float) -> dict:
        record["envelope"]["event_time"] = base + int(seconds * S)
        return record

    judged = at(reward(session, a, 2, 1.0, "judge", 1.0), 1)
    human = at(reward(session, a, 3, 0.5, "human", 1.0), 2)

    def statuses(lid: str) -> list[str]:
        """reward_status of every Transition of the step on the topic."""
        published = asyncio.run(published_transitions(settings_))
        return [t["reward_status"] for t in published if t["logical_event_id"] == lid]

    def duplicate_then_marker(step: int) -> None:
        marker = uuid7()
        asyncio.run(
            produce(settings_, [(REWARD, judged), (DISPATCH, at(dispatch(session, marker, step, 9 + step), 3))])
        )
        wait_for(lambda: statuses(marker), 60, f"step {step}'s pending row")

    worker = worker_factory(settings_).start()
    worker.wait_ready()
    asyncio.run(produce(settings_, [(DISPATCH, at(dispatch(session, a, 0, 1), 0)), (REWARD, judged), (REWARD, human)]))
    published = wait_for(lambda: (found := statuses(a)) and "complete" in found and found, 60, "step A complete")
    duplicate_then_marker(1)
    assert statuses(a) == published, "the worker that published A republished it for a duplicate"
    worker.stop()
    worker = worker_factory(settings_).start()
    worker.wait_ready()
    duplicate_then_marker(2)
    again = statuses(a)[len(published) :]  # more than one if the restart replayed inputs it had not committed
    assert again and set(again) == {"complete"}, "a restarted worker did not republish A for a duplicate"
