"""Plan topics into ClickHouse (migration 0019) and `treadle plan show`: real Kafka, a `treadle sink` process, chDB.

The plan_events log of tests.plan_scenario goes through the real scheduler fold (PlanScheduler) for its decisions;
both are produced as the processor and executors would (plan events keyed "plans", decisions by session), the
decisions and a plan submission twice (a replay). Every table and view is checked against expectations computed
here from the records, the scheduler's own view of each subgoal's state, and the critical path.
"""

from __future__ import annotations

import asyncio
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from processors.plans.dag import MICROS, Decision, PlanScheduler
from sinks.sql_client import run_sql
from streams.runtime.run_info import SqlEndpoint
from tests import plan_scenario
from tests.factories import treadle, wait_for
from tests.plan_scenario import SESSION, T0
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.names import EXECUTOR_HEARTBEAT, PLAN_EVENTS_KEY, PLAN_SUBMITTED, SUBGOAL_STATUS
from topics.settings import Settings
from treadle.devstack.worker_process import WorkerProcess

pytestmark = pytest.mark.integration

CODEC = AvroCodec()
OPEN = -1.0  # an open validity range, as the queries below write it


def seconds(column: str) -> str:
    """SQL: seconds after T0 of a DateTime64 column (NULL stays NULL)."""
    return f"(toUnixTimestamp64Micro({column}) - {T0}) / 1e6"


def s(micros: int) -> float:
    return (micros - T0) / MICROS


async def produce(settings: Settings, events: list[tuple[str, dict[str, Any]]], decisions: list[Decision]) -> None:
    catalog = TopicCatalog(settings)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap_servers, acks="all")
    await producer.start()
    try:
        for schema, record in events:
            await producer.send(catalog["plan_events"].name, CODEC.encode(schema, record), key=PLAN_EVENTS_KEY.encode())
        for d in decisions:
            await producer.send(catalog["plan_decisions"].name, CODEC.encode(d.schema, d.record), key=d.key.encode())
        await producer.flush()
    finally:
        await producer.stop()


async def produce_bytes(settings: Settings, values: list[bytes]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap_servers, acks="all")
    await producer.start()
    try:
        for value in values:  # one partition, so the offsets give their order
            await producer.send(TopicCatalog(settings)["plan_decisions"].name, value, key=SESSION.encode(), partition=0)
        await producer.flush()
    finally:
        await producer.stop()


def submitted_first(log: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    return next(record for schema, record in log if schema == PLAN_SUBMITTED)


def rows(settings: Settings, sql: str) -> list[tuple[Any, ...]]:
    return [tuple(row) for row in run_sql(settings, sql)[1]]


def count(settings: Settings, table: str) -> int:
    return rows(settings, f"SELECT count() FROM {table}")[0][0]


# -- expectations from the records ------------------------------------------------------------------------------


def expected_attempts(log: list[tuple[str, dict]], decisions: list[Decision]) -> dict[tuple, tuple]:
    """(plan, subgoal, attempt) -> (executor, outcome, error_class, released, running, ended), in seconds: a report
    counts until the attempt's timeout."""
    statuses = defaultdict(list)
    for schema, r in log:
        if schema == SUBGOAL_STATUS:
            statuses[r["plan_id"], r["subgoal_id"], r["attempt"]].append(r)
    timeouts = {(d.record["plan_id"], d.record["subgoal_id"], d.record["attempt"]): d.record["decided_at"]
                for d in decisions if d.record["decision_id"].endswith("/timed_out")}  # fmt: skip
    out = {}
    for d in decisions:
        r = d.record
        if not r["decision_id"].endswith("/released"):
            continue
        key = (r["plan_id"], r["subgoal_id"], r["attempt"])
        cutoff = timeouts.get(key, 1 << 62)
        seen = sorted((x for x in statuses[key] if x["envelope"]["event_time"] < cutoff),
                      key=lambda x: x["envelope"]["event_time"])  # fmt: skip
        running = next((x["envelope"]["event_time"] for x in seen if x["state"] in ("RUNNING", "HEARTBEAT")), None)
        end = next((x for x in seen if x["state"] in ("SUCCEEDED", "FAILED")), None)
        if end is not None:
            outcome, error, ended = end["state"], end["error_class"], end["envelope"]["event_time"]
        elif key in timeouts:
            outcome, error, ended = "TIMED_OUT", "timeout", cutoff
        else:
            outcome, error, ended = "", None, None
        out[key] = (r["executor_id"], outcome, error, s(r["released_at"]), running and s(running), ended and s(ended))
    return out


def successes(log: list[tuple[str, dict]]) -> dict[tuple[str, str], tuple[float, int]]:
    """(plan, subgoal) -> (when, attempt) its success counted, by the scheduler fold itself, input by input."""
    scheduler, found = PlanScheduler(), {}
    for schema, record in log:
        scheduler.apply(schema, record)
        if schema == SUBGOAL_STATUS and record["state"] == "SUCCEEDED":
            key = (record["plan_id"], record["subgoal_id"])
            state = scheduler.subgoal_states(SESSION, key[0]).get(key[1])
            if state == "SUCCEEDED" and key not in found:
                found[key] = (s(record["envelope"]["event_time"]), record["attempt"])
    return found


def expected_history(
    log: list[tuple[str, dict]], decisions: list[Decision], attempts: dict[tuple, tuple]
) -> dict[tuple[str, str], list[tuple[str, int, float, float]]]:
    """(plan, subgoal) -> [(state, attempt, valid_from, valid_to)] in seconds, the last one open; nothing after the
    first terminal state."""
    events: dict[tuple[str, str], list[tuple[float, int, int, str]]] = defaultdict(list)  # (at, attempt, rank, state)
    succeeded = successes(log)
    for key, (at, attempt) in succeeded.items():
        events[key].append((at, attempt, 4, "SUCCEEDED"))
    for (plan, sid, attempt), (_, _, _, released, running, _) in attempts.items():
        events[plan, sid].append((released, attempt, 2, "RELEASED"))
        if running is not None:
            events[plan, sid].append((running, attempt, 3, "RUNNING"))
    for schema, r in log:
        if schema != PLAN_SUBMITTED:
            continue
        for g in r["subgoals"]:
            key, deps = (r["plan_id"], g["subgoal_id"]), g["depends_on"]
            submitted = s(r["envelope"]["event_time"])
            events[key].append((submitted, 1, 1, "READY") if not deps else (submitted, 0, 0, "WAITING"))
            if deps and all((r["plan_id"], d) in succeeded for d in deps):
                events[key].append((max(succeeded[r["plan_id"], d][0] for d in deps), 1, 1, "READY"))
    for d in decisions:
        r, kind = d.record, d.record["decision_id"].rsplit("/", 1)[1]
        key = (r["plan_id"], r.get("subgoal_id", ""))
        if kind == "retried":
            if r["retry_at"] > r["decided_at"]:
                events[key].append((s(r["decided_at"]), r["failed_attempt"], 5, "BACKOFF"))
            events[key].append((s(r["retry_at"]), r["next_attempt"], 1, "READY"))
        elif kind == "rerouted":
            events[key].append((s(r["decided_at"]), r["next_attempt"], 1, "READY"))
        elif kind == "escalated":
            events[key].append((s(r["decided_at"]), r["attempts"], 7, "ESCALATED"))
            for cancelled in r["cancelled"]:
                events[r["plan_id"], cancelled].append((s(r["decided_at"]), 0, 7, "CANCELLED"))
    history = {}
    for key, found in events.items():
        found.sort()
        last = next((i for i, e in enumerate(found) if e[3] in ("SUCCEEDED", "ESCALATED", "CANCELLED")), len(found))
        found = found[: last + 1]
        history[key] = [(state, attempt, at, found[i + 1][0] if i + 1 < len(found) else OPEN)
                        for i, (at, attempt, _, state) in enumerate(found)]  # fmt: skip
    return history


# -- the test ------------------------------------------------------------------------------------------------------


@pytest.fixture
def sink(deployment: Settings) -> Any:
    process = WorkerProcess(
        deployment, deployment.home / "sink.log", command=[sys.executable, "-m", "treadle.cli", "sink"]
    ).start()
    try:
        wait_for(lambda: SqlEndpoint.read(deployment), 120, "the sink serving SQL", explain=process.log_tail)
        yield process
    finally:
        process.stop()


def test_plan_tables_and_plan_show(deployment: Settings, sink: WorkerProcess, tmp_path: Path) -> None:
    scheduler, log, decisions = plan_scenario.run()
    asyncio.run(produce(deployment, log, decisions))
    statuses = [r for schema, r in log if schema == SUBGOAL_STATUS]
    wait_for(lambda: count(deployment, "plan_decisions") == len(decisions)
             and count(deployment, "subgoal_statuses") == len(statuses), 90, "the plan rows",
             explain=sink.log_tail)  # fmt: skip
    # a replay: every decision and the first plan again, in later inserts (other parts), collapsing to one row each;
    # and a different plan under p-ok's id, later (the scheduler refuses it): the first submission stays the plan
    first = submitted_first(log)
    other = {**first, "envelope": {**first["envelope"], "event_id": "0190b6c2-0000-7000-8000-999999999999",
                                   "event_time": T0 + 60 * MICROS}, "goal": "another plan",
             "subgoals": [*first["subgoals"], {**first["subgoals"][0], "subgoal_id": "extra"}]}  # fmt: skip
    asyncio.run(produce(deployment, [(PLAN_SUBMITTED, first), (PLAN_SUBMITTED, other)], decisions))
    wait_for(lambda: count(deployment, "plan_decisions") == 2 * len(decisions), 90, "the replayed decisions",
             explain=sink.log_tail)  # fmt: skip
    wait_for(lambda: count(deployment, "plans") == 4, 30, "the replayed plans", explain=sink.log_tail)
    assert count(deployment, "rejected_rows") == 0
    # what cannot become a row on a decisions topic (not Avro; a plan, which is not a decision) is a rejected row
    asyncio.run(produce_bytes(deployment, [b"\x00garbage", CODEC.encode(PLAN_SUBMITTED, submitted_first(log))]))
    rejected = wait_for(lambda: rows(deployment, "SELECT target_table, reason FROM rejected_rows ORDER BY offset"), 60,
                        "the rejected rows", explain=sink.log_tail)  # fmt: skip
    assert [table for table, _ in rejected] == ["plan_decisions", "plan_decisions"]
    assert "expected one of" in rejected[1][1] and PLAN_SUBMITTED in rejected[1][1]

    # tables: one row per record (per decision_id, per plan)
    submitted = [r for schema, r in log if schema == PLAN_SUBMITTED]
    assert sorted(rows(deployment, f"SELECT session_id, plan_id, goal, subgoal_count, {seconds('submitted_at')} "
                                   "FROM plans_latest")) == sorted(
        (SESSION, r["plan_id"], r["goal"], len(r["subgoals"]), s(r["envelope"]["event_time"])) for r in submitted
    )  # fmt: skip
    assert rows(deployment, "SELECT plan_id, subgoal_id, depends_on, resource_class, gpu_memory_mb, max_attempts "
                            "FROM plan_subgoals_latest ORDER BY plan_id, position") == sorted(
        ((r["plan_id"], g["subgoal_id"], g["depends_on"], g["resource_class"], g["profile"]["gpu_memory_mb"],
          g["retry"]["max_attempts"]) for r in submitted for g in r["subgoals"]),
        key=lambda row: (row[0], [g["subgoal_id"] for g in plan_scenario.PLANS[row[0]]].index(row[1])),
    )  # fmt: skip
    assert sorted(rows(deployment, f"SELECT subgoal_id, attempt, state, executor_id, error_class, "
                                   f"{seconds('event_time')} FROM subgoal_statuses_latest")) == sorted(
        (r["subgoal_id"], r["attempt"], r["state"], r["executor_id"], r["error_class"], s(r["envelope"]["event_time"]))
        for r in statuses
    )  # fmt: skip
    heartbeats = [r for schema, r in log if schema == EXECUTOR_HEARTBEAT]
    assert sorted(rows(deployment, f"SELECT executor_id, resource_class, free_gpu_memory_mb, {seconds('sent_at')} "
                                   "FROM executor_heartbeats_latest")) == sorted(
        (r["executor_id"], r["resource_class"], r["free_gpu_memory_mb"], s(r["sent_at"])) for r in heartbeats
    )  # fmt: skip
    assert sorted(rows(deployment, f"SELECT decision_id, kind, attempt, {seconds('decided_at')} "
                                   "FROM plan_decisions_latest")) == sorted(
        (d.record["decision_id"], d.record["decision_id"].rsplit("/", 1)[1], _attempt_of(d.record),
         s(d.record.get("released_at") or d.record.get("decided_at") or d.record["finished_at"]))
        for d in decisions
    )  # fmt: skip

    # attempts: released -> running -> ended; the slow lint attempt stays timed out (its late success completes lint)
    attempts = expected_attempts(log, decisions)
    found = rows(deployment, f"SELECT plan_id, subgoal_id, attempt, executor_id, outcome, error_class, "
                             f"{seconds('released_at')}, {seconds('running_at')}, {seconds('ended_at')} "
                             "FROM plan_attempts")  # fmt: skip
    assert {row[:3]: row[3:] for row in found} == attempts and len(found) == len(attempts)
    assert attempts["p-ok", "lint", 1][1:3] == ("TIMED_OUT", "timeout")
    late = f"SELECT attempt, {seconds('succeeded_at')} FROM plan_attempts WHERE subgoal_id = 'lint' ORDER BY attempt"
    assert rows(deployment, late) == [(1, 12.0), (2, 13.0)]

    # state history with validity ranges: ends in the state the scheduler itself holds for each subgoal
    history = expected_history(log, decisions, attempts)
    found_history: dict[tuple[str, str], list] = defaultdict(list)
    for plan, sid, state, attempt, start, end in rows(
        deployment, f"SELECT plan_id, subgoal_id, state, attempt, {seconds('valid_from')}, "
        f"if(toYear(valid_to) >= 2299, {OPEN}, {seconds('valid_to')}) FROM subgoal_state_history "
        "ORDER BY plan_id, subgoal_id, valid_from, attempt",
    ):  # fmt: skip
        found_history[plan, sid].append((state, attempt, start, end))
    assert dict(found_history) == history
    for plan in plan_scenario.PLANS:
        for sid, state in scheduler.subgoal_states(SESSION, plan).items():
            assert history[plan, sid][-1][0] == state and history[plan, sid][-1][3] == OPEN
    assert [h[0] for h in history["p-ok", "train"]] == [
        "WAITING", "READY", "RELEASED", "RUNNING", "BACKOFF", "READY", "RELEASED", "RUNNING", "SUCCEEDED"
    ]  # fmt: skip
    assert history["p-ok", "lint"][-2:] == [("RUNNING", 2, 11.0, 12.0), ("SUCCEEDED", 1, 12.0, OPEN)]

    # time per state: the closed intervals summed
    per_state: dict[tuple, float] = defaultdict(float)
    for (plan, sid), intervals in history.items():
        for state, _, start, end in intervals:
            if end != OPEN:
                per_state[plan, sid, state] += end - start
    found_per_state = rows(deployment, "SELECT plan_id, subgoal_id, state, seconds FROM subgoal_time_in_state")
    assert {row[:3]: pytest.approx(row[3]) for row in found_per_state} == dict(per_state)

    # queueing: ready -> released per attempt (p-bad's subgoals wait for the one CPU slot), and per class
    ready = {(p, sid, a): start for (p, sid), hs in history.items() for state, a, start, _ in hs if state == "READY"}
    delays = {key: (attempts[key][3] - ready[key], None if att[4] is None else att[4] - att[3])
              for key, att in attempts.items()}  # fmt: skip
    queued = rows(deployment, "SELECT plan_id, subgoal_id, attempt, ready_to_released_s, released_to_running_s "
                              "FROM plan_queueing_delays")  # fmt: skip
    assert {row[:3]: row[3:] for row in queued} == delays and len(queued) == len(delays)
    assert delays["p-bad", "c", 1][0] == 13.0
    classes = rows(deployment, "SELECT resource_class, attempts, ready_to_released_max_s, ready_to_released_avg_s "
                               "FROM plan_queueing_by_class")  # fmt: skip
    by_class = {row[0]: row[1:] for row in classes}
    for cls in ("cpu", "gpu"):
        waits = [delays[key][0] for key in attempts if _class_of(key) == cls]
        assert by_class[cls] == (len(waits), max(waits), pytest.approx(sum(waits) / len(waits)))

    # GPU memory released vs advertised, per class and minute (the scenario fits in one minute)
    released_mb = defaultdict(int)
    for d in decisions:
        if d.record["decision_id"].endswith("/released"):
            released_mb[d.record["resource_class"]] += d.record["profile"]["gpu_memory_mb"]
    last_free = {hb["executor_id"]: (hb["resource_class"], hb["free_gpu_memory_mb"]) for hb in heartbeats}
    gpu = rows(deployment, "SELECT resource_class, released_gpu_memory_mb, advertised_free_gpu_memory_mb, "
                           "max_advertised_free_gpu_memory_mb FROM plan_gpu_memory ORDER BY 1")  # fmt: skip
    assert gpu == [
        (cls, released_mb[cls], sum(f for c, f in last_free.values() if c == cls),
         max(hb["free_gpu_memory_mb"] for hb in heartbeats if hb["resource_class"] == cls))
        for cls in ("cpu", "gpu")
    ]  # fmt: skip
    assert gpu[1][1:] == (24_000, 14_000, 16_000)

    # treadle plan show: the DAG with states, attempts and the critical path; a PNG
    png = tmp_path / "p-ok.png"
    shown = treadle(deployment, "plan", "show", "p-ok", "--png", str(png))
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert "plan p-ok (session s-plans): SUCCEEDED, 4 subgoals" in text and "finished after 22.0 s" in text
    assert "critical path: fetch -> train -> report (22.0 s)" in text  # ready -> done: 3 + 16 + 3
    assert "  * train  SUCCEEDED  [gpu]  2 attempt(s)  16.0 s  <- fetch" in text
    assert "    lint  SUCCEEDED  [cpu]  2 attempt(s)  8.0 s  <- fetch" in text  # its late success at 12
    assert "#1 on gpu-1: FAILED (OOM) 3.0 s" in text
    assert "#1 on cpu-1: TIMED_OUT (timeout) 6.0 s, succeeded late" in text
    assert text.index("layer 0") < text.index("* fetch") < text.index("layer 1") < text.index("layer 2")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000

    bad = treadle(deployment, "plan", "show", "p-bad", "--session", SESSION)
    assert bad.returncode == 0 and "plan p-bad (session s-plans): FAILED" in bad.stdout
    assert "ESCALATED" in bad.stdout and "CANCELLED" in bad.stdout

    for args in (("no-such-plan",), ("p-ok", "--session", "other")):
        missing = treadle(deployment, "plan", "show", *args)
        assert missing.returncode == 1
        assert missing.stderr.startswith("error: no plan ") and len(missing.stderr.strip().splitlines()) == 1
        assert "Traceback" not in missing.stderr + missing.stdout


def _attempt_of(record: dict[str, Any]) -> int:
    for name in ("attempt", "failed_attempt", "attempts"):
        if name in record:
            return record[name]
    raise AssertionError(record)


def _class_of(key: tuple[str, str, int]) -> str:
    plan, sid, _ = key
    return next(g["resource_class"] for g in plan_scenario.PLANS[plan] if g["subgoal_id"] == sid)
