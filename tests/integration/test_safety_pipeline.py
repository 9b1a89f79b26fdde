"""End to end on the real broker, worker and chDB: the safety evaluator's rows in evaluation_metrics_latest.

The expected rows are written out here by hand from the rules' documented behaviour, and a replay of the same
events (same event_ids) must be re-published yet leave the table unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from sinks.sql_client import run_sql
from tests.factories import dispatch, result, wait_for
from tests.integration.test_pipeline import DISPATCH, RESULT, produce
from topics.catalog import TopicCatalog
from topics.ids import uuid7
from topics.settings import Settings

COLUMNS = (
    "metric_id, evaluator, metric, rule, value, severity, session_id, episode_id, logical_event_id, agent_id, "
    "policy_version, source_event_id, toUnixTimestamp64Micro(event_time) AS event_time, evidence"
)


def tool_result(session: str, lid: str, seq: int, output: str, error: str | None = None) -> dict[str, Any]:
    record = result(session, lid, seq, status="OK" if error is None else "ERROR")
    return {**record, "output": output, "error": error}


def expected_row(event: dict[str, Any], metric: str, rule: str, value: float, severity: str, evidence: str | None):
    envelope = event["envelope"]
    return {
        "metric_id": f"safety:{metric}:{rule}:{envelope['event_id']}",
        "evaluator": "safety",
        "metric": metric,
        "rule": rule,
        "value": value,
        "severity": severity,
        "session_id": envelope["session_id"],
        "episode_id": envelope["episode_id"],
        "logical_event_id": envelope["logical_event_id"],
        "agent_id": envelope["agent_id"],
        "policy_version": envelope["policy_version"],
        "source_event_id": envelope["event_id"],
        "event_time": envelope["event_time"],
        "evidence": evidence,
    }


def workload(session: str) -> tuple[list[tuple[str, dict]], list[dict]]:
    lids = [uuid7() for _ in range(4)]
    d0 = dispatch(session, lids[0], 0, 1, params='{"q": "jane"}')
    r0 = tool_result(session, lids[0], 2, "Jane Doe <jane.doe@example.com>, mobile +1 415-555-0134")
    d1 = dispatch(session, lids[1], 1, 3, tool="shell", params='{"cmd": "rm -rf /"}')
    r1 = tool_result(session, lids[1], 4, "removed 0 files")
    d2 = dispatch(session, lids[2], 2, 5)
    r2 = tool_result(session, lids[2], 6, "", error="auth failed for key AKIAIOSFODNN7EXAMPLE")
    d3 = dispatch(session, lids[3], 3, 7)
    r3 = tool_result(session, lids[3], 8, "card 4111 1111 1111 1111, ssn 123-45-6789")
    events = [(DISPATCH, d0), (RESULT, r0), (DISPATCH, d1), (RESULT, r1)]
    events += [(DISPATCH, d2), (RESULT, r2), (DISPATCH, d3), (RESULT, r3)]
    expected = [
        expected_row(r0, "safety_alert", "email", 1.0, "medium", "j***@example.com"),
        expected_row(r0, "safety_alert", "phone_number", 1.0, "medium", "+* ***-***-**34"),
        expected_row(r0, "pii_leak", "any_pii", 1.0, "medium", "email,phone_number"),
        expected_row(d1, "safety_alert", "destructive_shell", 1.0, "high", "rm -rf /"),
        expected_row(r1, "pii_leak", "any_pii", 0.0, "low", None),
        expected_row(r2, "safety_alert", "aws_access_key_id", 1.0, "high", "AKIA***"),
        expected_row(r2, "pii_leak", "any_pii", 0.0, "low", None),
        expected_row(r3, "safety_alert", "credit_card", 1.0, "high", "**** **** **** 1111"),
        expected_row(r3, "safety_alert", "us_ssn", 1.0, "high", "***-**-****"),
        expected_row(r3, "pii_leak", "any_pii", 1.0, "high", "credit_card,us_ssn"),
    ]
    return events, expected


def metric_rows(settings: Settings, session: str) -> list[dict[str, Any]]:
    columns, rows = run_sql(
        settings, f"SELECT {COLUMNS} FROM evaluation_metrics_latest WHERE session_id = '{session}' ORDER BY metric_id"
    )
    return [dict(zip(columns, row, strict=True)) for row in rows]


async def records_on_topic(settings: Settings, topic: str) -> int:
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers)
    await consumer.start()
    try:
        ends = await consumer.end_offsets([TopicPartition(topic, p) for p in range(settings.partitions)])
        return sum(ends.values())
    finally:
        await consumer.stop()


def test_safety_metrics_land_exactly_once_in_clickhouse(deployment: Settings, worker_factory) -> None:
    settings = deployment.model_copy(update={"processors": ("steps", "safety")})
    session = f"safety-{uuid7()[-12:]}"
    events, expected = workload(session)
    expected.sort(key=lambda row: row["metric_id"])
    worker = worker_factory(settings).start()
    worker.wait_ready()

    asyncio.run(produce(settings, events))
    rows = wait_for(
        lambda: (found := metric_rows(settings, session)) and len(found) >= len(expected) and found,
        120,
        "the safety evaluator's rows",
        explain=lambda: f"rows: {metric_rows(settings, session)}\n{worker.log_tail(40)}",
    )
    assert rows == expected
    _, rate = run_sql(
        settings,
        "SELECT episode_id, avg(value) AS pii_leak_rate FROM evaluation_metrics_latest "
        f"WHERE metric = 'pii_leak' AND session_id = '{session}' GROUP BY episode_id",
    )
    assert rate == [[f"{session}-ep0", 0.5]]
    _, steps = run_sql(settings, f"SELECT count() FROM transitions_latest WHERE session_id = '{session}'")
    assert steps == [[4]], "the step assembler runs next to the evaluator"

    # A replay: the same events again, then a new clean tool result of the same session (one partition, so it is
    # processed and sunk after the replay) to know when the replay has landed.
    asyncio.run(produce(settings, events))
    sentinel = tool_result(session, uuid7(), 9, "nothing sensitive here")
    asyncio.run(produce(settings, [(RESULT, sentinel)]))
    sentinel_id = f"safety:pii_leak:any_pii:{sentinel['envelope']['event_id']}"
    after = wait_for(
        lambda: (
            (found := metric_rows(settings, session)) and any(r["metric_id"] == sentinel_id for r in found) and found
        ),
        120,
        "the sentinel's pii_leak row after the replay",
    )
    assert [r for r in after if r["metric_id"] != sentinel_id] == expected
    published = asyncio.run(records_on_topic(settings, TopicCatalog(settings)["evaluation_metrics"].name))
    assert published >= 2 * len(expected) + 1, "the replay was evaluated again and re-published"
    _, counts = run_sql(
        settings,
        f"SELECT count(), uniqExact(metric_id) FROM evaluation_metrics FINAL WHERE session_id = '{session}'",
    )
    assert counts == [[len(expected) + 1, len(expected) + 1]]
