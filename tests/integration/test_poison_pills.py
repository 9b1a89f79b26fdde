"""No input can stop the pipeline: each poison-pill class costs its own record (a dead letter with stage and reason),
and the good events behind it on the same partition become correct transitions (issue 25). Real Kafka, chDB, worker.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from sinks.sql_client import run_sql
from tests.factories import RawProducer, dispatch, envelope, result, wait_for
from topics.admin import TopicMismatchError, ensure_topics
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.ids import uuid7
from topics.settings import Settings
from treadle import AgentStream, EventTooLargeError
from treadle.devstack.worker_process import WorkerProcess

STATE_DELTA = "treadle.events.StateDelta"


def plugin_path(tmp_path: Path) -> Path:
    """A folder whose dist-info declares tests.poison_plugin's processors (`explodes`, `hangs`), as an installed plugin
    would look to importlib.metadata; the worker gets it on PYTHONPATH."""
    site = tmp_path / "site"
    info = site / "poison_plugin-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: poison-plugin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[treadle.processors]\nexplodes = tests.poison_plugin:ExplodesOnMark\nhangs = tests.poison_plugin:HangsOnMark\n"
    )
    return site


@pytest.fixture
def poison_worker(deployment: Settings, tmp_path: Path) -> Iterator[tuple[Settings, WorkerProcess]]:
    settings = deployment.model_copy(update={"processors": ("steps", "explodes")})
    worker = WorkerProcess(settings, settings.home / "worker.log", env={"PYTHONPATH": str(plugin_path(tmp_path))})
    try:
        worker.start().wait_ready()
        yield settings, worker
    finally:
        worker.stop()


def deep_json(levels: int) -> str:
    return '{"q": ' + "[" * levels + "]" * levels + "}"


async def send_poison(settings: Settings, session: str) -> dict[str, list]:
    """Good and poisoned events on ONE session (one partition), good ones before, between and after the others.
    Returns what each step should look like, by label."""
    codec = AvroCodec()
    lids = {label: uuid7() for label in ("first", "deep", "over", "near", "huge", "explodes", "last")}
    seq = iter(range(1, 100))

    def step(label: str, params: str = '{"q": "x"}', output: str | None = "fine") -> list[tuple[str, dict]]:
        events = [("treadle.events.ActionDispatched", dispatch(session, lids[label], 0, next(seq), params=params))]
        if output is not None:
            tool_result = result(session, lids[label], next(seq))
            tool_result["output"] = output
            events.append(("treadle.events.ToolResult", tool_result))
        return events

    deep_delta = {
        "envelope": envelope(session, uuid7(), next(seq)),
        "node_upserts": [{"id": "n1", "type": "doc", "data_json": deep_json(5_000), "ttl_seconds": None}],
        "node_deletes": [],
        "edge_upserts": [],
        "edge_deletes": [],
        "rollback_to": None,
    }
    events = [
        *step("first"),
        *step("deep", params=deep_json(5_000)),  # the dispatch: VALIDATE, too deep to parse
        (STATE_DELTA, deep_delta),  # VALIDATE, too deep
        *step("over", output="o" * 950_000),  # the result: VALIDATE, above TREADLE_MAX_EVENT_BYTES
        *step("near", output="n" * 895_000),  # just under the limit: a transition with the whole output
        *step("huge", params=json.dumps({"q": "h" * 500_000}), output="h" * 500_000),  # result: PROCESS, step too big
        *step("explodes", output="EXPLODE here"),  # the plugin raises: PROCESS, only for it
        *step("last"),
    ]
    async with RawProducer(settings, codec) as producer:
        for schema_name, record in events:
            if schema_name == STATE_DELTA:  # RawProducer.send knows the step inputs only
                await producer.send_bytes("state_deltas", codec.encode(schema_name, record), key=session.encode())
            else:
                await producer.send(schema_name, record)
        await producer.flush()
    return {label: lid for label, lid in lids.items()}


def test_each_poison_pill_is_one_dead_letter_and_the_steps_behind_it_arrive(poison_worker) -> None:
    settings, worker = poison_worker
    session = f"s-poison-{uuid7()[:8]}"
    lids = asyncio.run(send_poison(settings, session))

    def letters() -> list[dict] | None:
        columns, rows = run_sql(
            settings,
            "SELECT stage, reason, schema_name, event_id, length(value) AS kept, value_truncated_bytes, offset "
            f"FROM dead_letters_latest WHERE session_id = '{session}' ORDER BY topic, offset",
        )
        found = [dict(zip(columns, row, strict=True)) for row in rows]
        return found if len(found) >= 5 else None

    found = wait_for(letters, 120, "five dead letters", explain=worker.log_tail)
    by_reason = {row["reason"]: row for row in found}
    assert len(found) == 5, found

    def one(fragment: str) -> dict:
        matches = [row for reason, row in by_reason.items() if fragment in reason]
        assert len(matches) == 1, (fragment, list(by_reason))
        return matches[0]

    deep = one("params_json nests deeper than 64 levels (5001)")
    assert (deep["stage"], deep["schema_name"]) == ("VALIDATE", "treadle.events.ActionDispatched")
    delta = one("node_upserts[0].data_json nests deeper than 64 levels (5001)")
    assert (delta["stage"], delta["schema_name"]) == ("VALIDATE", STATE_DELTA)
    over = one("above the 900,000-byte limit (TREADLE_MAX_EVENT_BYTES)")
    assert over["stage"] == "VALIDATE" and "the event is 950," in over["reason"]
    assert over["value_truncated_bytes"] > 0 and over["kept"] + over["value_truncated_bytes"] > 950_000
    huge = one("of one step's table record")
    assert (huge["stage"], huge["schema_name"]) == ("PROCESS", "treadle.events.ToolResult")
    assert "processor steps failed" in huge["reason"]
    exploded = one("processor explodes failed: RuntimeError")
    assert exploded["stage"] == "PROCESS" and exploded["value_truncated_bytes"] == 0

    expected = {
        "first": ("OK", 4),
        "deep": None,  # its dispatch was the poison: no step
        "over": (None, None),  # dispatched, its result refused
        "near": ("OK", 895_000),
        "huge": (None, None),
        "explodes": ("OK", len("EXPLODE here")),  # the steps processor folded it; only the plugin failed on it
        "last": ("OK", 4),
    }

    def transitions() -> dict | None:
        _, rows = run_sql(
            settings,
            "SELECT logical_event_id, tool_status, length(output), truncated_bytes FROM transitions_latest "
            f"WHERE session_id = '{session}'",
        )
        seen = {lid: (status, size if status else None) for lid, status, size, _ in rows}
        assert all(cut == 0 for *_, cut in rows)
        want = {lids[label]: shape for label, shape in expected.items() if shape is not None}
        return seen if seen == want else None

    wait_for(transitions, 120, "the good steps as transitions", explain=worker.log_tail)
    assert worker.proc is not None and worker.proc.poll() is None, "the worker must still run"


async def test_the_sdk_refuses_an_event_over_the_limit_before_sending_it(deployment: Settings) -> None:
    settings = deployment.model_copy(update={"max_event_bytes": 50_000})
    async with AgentStream(settings, agent_id="agent-big") as stream:
        with pytest.raises(EventTooLargeError, match=r"ActionDispatched is 60,[0-9]{3} bytes encoded, above the "
                           r"50,000-byte limit \(TREADLE_MAX_EVENT_BYTES\); nothing was sent"):  # fmt: skip
            await stream.dispatch("blob", {"data": "x" * 60_000})
        assert stream.pending == 0
        ref = await stream.dispatch("blob", {"data": "fits"})  # the stream goes on, and the failed one cost no seq
        assert ref.logical_event_id


async def test_a_topic_taking_smaller_records_than_the_producers_send_is_refused_at_start(
    deployment: Settings,
) -> None:
    catalog = TopicCatalog(deployment)
    admin = AIOKafkaAdminClient(bootstrap_servers=deployment.kafka_bootstrap_servers)
    await admin.start()
    try:
        name = catalog["transitions"].name
        await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, name, {"max.message.bytes": "100000"})])
    finally:
        await admin.close()
    deadline = time.monotonic() + 20
    while True:  # the brokers apply a config change a moment after the controller took it
        try:
            await ensure_topics(catalog, deployment.kafka_bootstrap_servers)
        except TopicMismatchError as exc:
            refusal = str(exc)
            break
        assert time.monotonic() < deadline, "the topic's smaller limit was never refused"
        await asyncio.sleep(0.5)
    assert f"{name} (100,000); raise their max.message.bytes to 1048588" in refusal
