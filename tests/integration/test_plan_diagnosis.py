"""Self-diagnosis on the real broker, worker and chDB: plan_diagnosis's metric rows in evaluation_metrics_latest, its
SchedulerAdvice on plan_events, and the plans scheduler's fold over that log rerouting the flagged subgoal early.

Failures of one tool and params (FAILED subgoal statuses, and tool results in error) give a repeated_failure row and an
advice; rewards of one action give a reward_variance row; a running subgoal that goes quiet past its deadline and a
step without a tool result past the step timeout give stall rows.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiokafka import AIOKafkaConsumer

from processors.plans.dag import PlanScheduler
from processors.plans.symptoms import action_rule, params_hash
from sinks.sql_client import run_sql
from tests.factories import RawProducer, dispatch, result, reward, wait_for
from tests.integration.test_pipeline import DISPATCH, RESULT
from topics.catalog import TopicCatalog, topic_expectation
from topics.codec import AvroCodec
from topics.ids import uuid7
from topics.names import (
    EXECUTOR_HEARTBEAT,
    PLAN_EVENTS_KEY,
    PLAN_SUBMITTED,
    REWARD,
    SCHEDULER_ADVICE,
    SUBGOAL_REROUTED,
    SUBGOAL_RETRIED,
    SUBGOAL_STATUS,
)
from topics.settings import Settings

MICROS = 1_000_000
CODEC = AvroCodec()


def plan_envelope(session: str, logical: str, t: int) -> dict[str, Any]:
    return {
        "event_id": uuid7(), "session_id": session, "agent_id": "planner", "episode_id": f"{session}-ep0",
        "logical_event_id": logical, "seq": 1, "event_time": t, "policy_version": "", "trace_id": "", "attributes": {},
    }  # fmt: skip


def subgoal(sid: str, tool: str, params: str, deadline_s: float, attempts: int, fallback: str | None) -> dict:
    profile = {"gpu_memory_mb": 0, "gpus": 0, "cpu": 1}
    return {
        "subgoal_id": sid, "tool": tool, "agent": None, "params_json": params, "resource_class": "cpu",
        "profile": profile, "deadline_s": deadline_s,
        "retry": {"max_attempts": attempts, "backoff_s": 0.0, "backoff_multiplier": 1.0},
        "fallback": None if fallback is None else {
            "tool": fallback, "agent": None, "params_json": "{}", "resource_class": "cpu", "profile": profile,
        },
        "depends_on": [],
    }  # fmt: skip


def status(session: str, sid: str, attempt: int, state: str, t: int) -> dict[str, Any]:
    return {
        "envelope": plan_envelope(session, f"p/{sid}/{attempt}", t), "plan_id": "p", "subgoal_id": sid,
        "attempt": attempt, "state": state, "executor_id": "x", "output_ref": None,
        "error_class": "ToolError" if state == "FAILED" else None, "error": None,
    }  # fmt: skip


def heartbeat(t: int) -> dict[str, Any]:
    return {
        "executor_id": "x", "resource_class": "cpu", "free_gpu_memory_mb": 0, "free_gpus": 0, "free_cpu": 4,
        "running": [], "valid_for_s": 3600.0, "host": "h", "sent_at": t,
    }  # fmt: skip


async def send_plan_events(settings: Settings, records: list[tuple[str, dict[str, Any]]]) -> None:
    async with RawProducer(settings) as producer:
        topic = TopicCatalog(settings)["plan_events"].name
        for schema, record in records:
            await producer.producer.send(topic, CODEC.encode(schema, record), key=PLAN_EVENTS_KEY.encode())
        await producer.flush()


async def send_steps(settings: Settings, events: list[tuple[str, dict]]) -> None:
    async with RawProducer(settings) as producer:
        for schema, record in events:
            await producer.send(schema, record)
        await producer.flush()


async def plan_log(settings: Settings) -> list[tuple[str, dict[str, Any]]]:
    """Every record on plan_events, in log order (one key, so one partition)."""
    spec = TopicCatalog(settings)["plan_events"]
    consumer = AIOKafkaConsumer(spec.name, bootstrap_servers=settings.kafka_bootstrap_servers,
                                auto_offset_reset="earliest", enable_auto_commit=False)  # fmt: skip
    await consumer.start()
    try:
        records: list[tuple[str, dict[str, Any]]] = []
        batch = await consumer.getmany(timeout_ms=2000)
        while batch:
            for messages in batch.values():
                for message in messages:
                    schema, record = CODEC.decode(message.value, expect=topic_expectation(spec))[:2]
                    records.append((schema, record))
            batch = await consumer.getmany(timeout_ms=1000)
        return records
    finally:
        await consumer.stop()


def metric_rows(settings: Settings, sessions: tuple[str, ...]) -> list[dict[str, Any]]:
    listed = ", ".join(f"'{s}'" for s in sessions)
    columns, rows = run_sql(
        settings,
        "SELECT metric, rule, value, severity, session_id, source_event_id, evidence FROM evaluation_metrics_latest "
        f"WHERE evaluator = 'plan_diagnosis' AND session_id IN ({listed}) ORDER BY metric, rule, value",
    )
    return [dict(zip(columns, row, strict=True)) for row in rows]


def test_plan_diagnosis_flags_failures_variance_and_stalls_and_advises_the_scheduler(
    deployment: Settings, worker_factory
) -> None:
    settings = deployment.model_copy(
        update={
            "processors": ("steps", "plan_diagnosis"),
            "diagnosis_failure_threshold": 3,
            "diagnosis_variance_min_samples": 3,
            "diagnosis_step_timeout_s": 5.0,
        }
    )
    worker = worker_factory(settings).start()
    worker.wait_ready()
    t0 = time.time_ns() // 1000
    plans, steps = f"plans-{uuid7()[-12:]}", f"steps-{uuid7()[-12:]}"

    # Plans: subgoal a fails three times (attempt 4 of 6 would be a retry), b runs and goes quiet.
    flaky = subgoal("a", "flaky", '{"x": 1, "y": [2]}', 30.0, 6, "backup")
    quiet = subgoal("b", "slow", "{}", 10.0, 1, None)
    submitted = {"envelope": plan_envelope(plans, "p", t0), "plan_id": "p", "goal": "g", "subgoals": [flaky, quiet]}
    first = [(EXECUTOR_HEARTBEAT, heartbeat(t0)), (PLAN_SUBMITTED, submitted)]
    first += [(SUBGOAL_STATUS, status(plans, "b", 1, "RUNNING", t0 + 1 * MICROS))]
    first += [(SUBGOAL_STATUS, status(plans, "a", n, "FAILED", t0 + (1 + n) * MICROS)) for n in (1, 2, 3)]
    asyncio.run(send_plan_events(settings, first))

    # Steps: one action rewarded three times, another failing three times, one never answered.
    lids = [uuid7() for _ in range(8)]
    events: list[tuple[str, dict]] = []
    for i, value in enumerate((0.0, 1.0, 0.5)):
        events += [(DISPATCH, dispatch(steps, lids[i], i, 10 * i + 1, tool="search", params='{"q": "same"}'))]
        events += [(RESULT, result(steps, lids[i], 10 * i + 2)), (REWARD, reward(steps, lids[i], 10 * i + 3, value))]
    for i in (3, 4, 5):
        events += [(DISPATCH, dispatch(steps, lids[i], i, 10 * i + 1, tool="db", params='{"id": 7}'))]
        events += [(RESULT, result(steps, lids[i], 10 * i + 2, status="ERROR"))]
    hang = dispatch(steps, lids[6], 6, 61, tool="hang", params="{}")
    asyncio.run(send_steps(settings, [*events, (DISPATCH, hang)]))

    def advice_for(tool: str) -> list[dict[str, Any]]:
        return [r for s, r in asyncio.run(plan_log(settings)) if s == SCHEDULER_ADVICE and r["tool"] == tool]

    wait_for(lambda: advice_for("flaky"), 120, "plan_diagnosis's advice on plan_events", explain=worker.log_tail)
    # Every step above has its tool result (the db advice follows the last one) before the step clock moves on: a
    # dispatch 10 s after the hanging one, past the 5 s step timeout.
    wait_for(lambda: advice_for("db"), 120, "the advice for the failing db calls", explain=worker.log_tail)
    later = dispatch(steps, lids[7], 7, 62)
    later["envelope"]["event_time"] = hang["envelope"]["event_time"] + 10 * MICROS
    asyncio.run(send_steps(settings, [(DISPATCH, later), (RESULT, result(steps, lids[7], 63))]))
    flaky_rule = action_rule("flaky", params_hash('{"y":[2],"x":1}'))
    advice = advice_for("flaky")
    assert len(advice) == 1
    assert advice[0]["action"] == "SKIP_RETRIES" and advice[0]["failures"] == 3
    assert action_rule(advice[0]["tool"], advice[0]["params_hash"]) == flaky_rule
    assert advice[0]["advised_at"] == t0 + 4 * MICROS

    # Attempt 4 fails after the advice; attempt 1 wakes up late (it ended: nothing to watch); a heartbeat later moves
    # the plan clock past b's deadline (a stall), and past where attempt 1's would have been.
    fourth = (SUBGOAL_STATUS, status(plans, "a", 4, "FAILED", t0 + 5 * MICROS))
    zombie = (SUBGOAL_STATUS, status(plans, "a", 1, "HEARTBEAT", t0 + 6 * MICROS))
    asyncio.run(send_plan_events(settings, [fourth, zombie, (EXECUTOR_HEARTBEAT, heartbeat(t0 + 40 * MICROS))]))

    expected = {
        ("repeated_failure", flaky_rule, 3.0), ("repeated_failure", flaky_rule, 4.0),
        ("repeated_failure", action_rule("db", params_hash('{"id":7}')), 3.0),
        ("reward_variance", action_rule("search", params_hash('{"q":"same"}')), 0.25),
        ("stall", action_rule("slow", params_hash("{}")), 39.0),
        ("stall", action_rule("hang", params_hash("{}")), 10.0),
    }  # fmt: skip

    def found() -> set[tuple[str, str, float]]:
        return {(r["metric"], r["rule"], round(r["value"], 6)) for r in metric_rows(settings, (plans, steps))}

    wait_for(
        lambda: expected <= found(), 120, "plan_diagnosis's metric rows",
        explain=lambda: f"rows: {metric_rows(settings, (plans, steps))}\n{worker.log_tail(40)}",
    )  # fmt: skip
    rows = metric_rows(settings, (plans, steps))
    assert found() == expected, rows
    by_metric = {(r["metric"], r["rule"], round(r["value"], 6)): r for r in rows}
    variance = by_metric[("reward_variance", action_rule("search", params_hash('{"q":"same"}')), 0.25)]
    assert variance["severity"] == "high"
    assert by_metric[("repeated_failure", flaky_rule, 3.0)]["session_id"] == plans

    # The scheduler's fold over the log as it now stands: attempt 4 went to the fallback (advice), not a retry.
    log = asyncio.run(plan_log(settings))
    assert sorted(r["tool"] for s, r in log if s == SCHEDULER_ADVICE) == ["db", "flaky"]
    query = "SELECT tool, failures, action FROM scheduler_advice_latest ORDER BY tool"
    advice_rows = wait_for(
        lambda: (found := run_sql(settings, query)[1]) and len(found) == 2 and found,
        120, "the advice rows in scheduler_advice (migration 0020)",
    )  # fmt: skip
    assert advice_rows == [["db", 3, "SKIP_RETRIES"], ["flaky", 3, "SKIP_RETRIES"]]
    scheduler = PlanScheduler(work_topic_prefix=f"{settings.topic_prefix}.work")
    decisions = [d for schema, record in log for d in scheduler.apply(schema, record)]
    a = [(d.schema, d.record.get("failed_attempt")) for d in decisions if d.record.get("subgoal_id") == "a"]
    assert (SUBGOAL_REROUTED, 4) in a and (SUBGOAL_RETRIED, 3) in a and (SUBGOAL_RETRIED, 4) not in a, a


def test_failure_windows_and_watches_survive_a_worker_killed_with_9(deployment: Settings, worker_factory) -> None:
    """Two failures and a running attempt before a kill -9, the rest after: the same rows as without the kill (one
    advice at the third failure, one stall), whether the restarted worker found the state in its table's changelog
    or replayed inputs whose offsets were not committed."""
    settings = deployment.model_copy(update={"processors": ("plan_diagnosis",), "diagnosis_failure_threshold": 3})
    worker = worker_factory(settings).start()
    worker.wait_ready()
    t0 = time.time_ns() // 1000
    session = f"kill-{uuid7()[-12:]}"
    specs = [subgoal("a", "flaky", "{}", 30.0, 6, "backup"), subgoal("b", "slow", "{}", 10.0, 1, None)]
    submitted = {"envelope": plan_envelope(session, "p", t0), "plan_id": "p", "goal": "g", "subgoals": specs}
    before = [(EXECUTOR_HEARTBEAT, heartbeat(t0)), (PLAN_SUBMITTED, submitted)]
    before += [(SUBGOAL_STATUS, status(session, "b", 1, "RUNNING", t0 + MICROS))]
    before += [(SUBGOAL_STATUS, status(session, "a", n, "FAILED", t0 + (1 + n) * MICROS)) for n in (1, 2)]
    asyncio.run(send_plan_events(settings, before))
    time.sleep(3)  # let it fold some of it (the test holds wherever the kill lands)
    worker.kill()

    worker = worker_factory(settings).start()
    worker.wait_ready()
    after = [(SUBGOAL_STATUS, status(session, "a", 3, "FAILED", t0 + 4 * MICROS))]
    after += [(EXECUTOR_HEARTBEAT, heartbeat(t0 + 30 * MICROS))]
    asyncio.run(send_plan_events(settings, after))
    expected = {("repeated_failure", action_rule("flaky", params_hash("{}")), 3.0),
                ("stall", action_rule("slow", params_hash("{}")), 29.0)}  # fmt: skip
    wait_for(
        lambda: {(r["metric"], r["rule"], r["value"]) for r in metric_rows(settings, (session,))} == expected,
        120, "the rows of the failures and the stall across the kill",
        explain=lambda: f"rows: {metric_rows(settings, (session,))}\n{worker.log_tail(40)}",
    )  # fmt: skip
    advice = [r for s, r in asyncio.run(plan_log(settings)) if s == SCHEDULER_ADVICE]
    assert [(r["tool"], r["failures"]) for r in advice] == [("flaky", 3)]
