"""Bad input lands in dead letters with its stage, reason, position and raw bytes; the stream goes on."""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path

from sinks.sql_client import run_sql
from tests.factories import RawProducer, dispatch, result, reward, wait_for
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.ids import uuid7
from topics.registry import SchemaRegistry
from topics.schemas import AvroSchema, SchemaSet
from topics.settings import Settings

TOOL_SCHEMAS = {"search": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}


def tool_result_without_tool_field() -> AvroSchema:
    """An older/foreign writer schema of ToolResult that lacks the required `tool` field."""
    current = SchemaSet.load()["treadle.events.ToolResult"].json
    variant = dict(current, fields=[f for f in current["fields"] if f["name"] != "tool"])
    return AvroSchema.from_json(variant)


async def send_bad_inputs(settings: Settings) -> dict[str, dict]:
    """Each bad input, keyed by a label, with the topic it went to and the exact bytes sent."""
    variant = tool_result_without_tool_field()
    # Registered as another tool (or an older treadle) could: treadle's own registry refuses a writer its ToolResult
    # cannot read (readers=None checks against the shipped schemas; an empty set checks nothing).
    schemas_topic = TopicCatalog(settings)["schemas"].name
    registry = SchemaRegistry(settings.kafka_bootstrap_servers, schemas_topic, readers=SchemaSet([]))
    await registry.register([variant])  # known writer, but unreadable as the current ToolResult
    variant_codec = AvroCodec(SchemaSet([variant]))
    codec = AvroCodec()

    missing_tool = result("s-missing", "lid-missing", 1)
    del missing_tool["tool"]
    empty_session = dispatch("", "lid-empty", 0, 1)
    bad = {
        "garbage": ("actions", b"\x00\x01garbage that is not avro", b"s-garbage"),
        "unknown_schema": ("rewards", b"\xc3\x01" + struct.pack("<Q", 0xDEADBEEF) + b"\x02x", b"s-unknown"),
        "invalid_params": (
            "actions",
            codec.encode("treadle.events.ActionDispatched", dispatch("s-params", uuid7(), 0, 1, params='{"q": 5}')),
            b"s-params",
        ),
        "missing_field": (
            "tool_results",
            variant_codec.encode("treadle.events.ToolResult", missing_tool),
            b"s-missing",
        ),
        "empty_session": ("actions", codec.encode("treadle.events.ActionDispatched", empty_session), b""),
        "no_key": ("rewards", codec.encode("treadle.events.RewardSignal", reward("s-nokey", uuid7(), 1, 0.5)), None),
        "tombstone": ("lifecycle", None, b"s-tomb"),
    }
    sent = {}
    async with RawProducer(settings) as producer:
        for label, (kind, value, key) in bad.items():
            topic = producer.catalog[kind].name
            metadata = await (await producer.producer.send(topic, value, key=key))
            sent[label] = {"topic": topic, "partition": metadata.partition, "offset": metadata.offset, "value": value}
    return sent


async def send_good_step(settings: Settings) -> tuple[str, str]:
    session, lid = f"s-good-{uuid7()[:8]}", uuid7()
    async with RawProducer(settings) as producer:
        await producer.send("treadle.events.ActionDispatched", dispatch(session, lid, 0, 1))
        await producer.send("treadle.events.ToolResult", result(session, lid, 2))
        await producer.flush()
    return session, lid


EXPECTED = {
    "garbage": ("DECODE", "not Avro single-object encoding"),
    "unknown_schema": ("SCHEMA", "unknown writer schema fingerprint 00000000deadbeef"),
    "invalid_params": ("VALIDATE", "params of search invalid at q: 5 is not of type 'string'"),
    "missing_field": ("SCHEMA", "No default value for field tool"),
    "empty_session": ("VALIDATE", "envelope.session_id is empty"),
    "no_key": ("VALIDATE", "the message has no key; events must be keyed by envelope.session_id ('s-nokey')"),
    "tombstone": ("DECODE", "tombstone"),
}


def test_each_bad_input_is_a_dead_letter_and_the_stream_continues(
    deployment: Settings, worker_factory, tmp_path: Path
) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOL_SCHEMAS))
    settings = deployment.model_copy(update={"tool_schemas": tools})
    sent = asyncio.run(send_bad_inputs(settings))
    worker = worker_factory(settings).start()
    worker.wait_ready()
    session, _ = asyncio.run(send_good_step(settings))

    def dead_letters() -> dict | None:
        columns, rows = run_sql(
            settings,
            "SELECT topic, partition, offset, stage, reason, hex(value) AS value_hex FROM dead_letters_latest",
        )
        found = {(r[0], r[1], r[2]): dict(zip(columns, r, strict=True)) for r in rows}
        return found if len(found) >= len(sent) else None

    found = wait_for(dead_letters, 60, "one dead letter per bad input")
    assert len(found) == len(sent)
    for label, where in sent.items():
        row = found[(where["topic"], where["partition"], where["offset"])]
        stage, reason = EXPECTED[label]
        assert row["stage"] == stage, (label, row)
        assert reason in row["reason"], (label, row)
        assert (row["value_hex"] or "") == (where["value"] or b"").hex().upper(), label

    query = f"SELECT tool_status FROM transitions_latest WHERE session_id = '{session}'"
    _, rows = wait_for(lambda: (r := run_sql(settings, query))[1] and r, 60, "the valid step after the bad inputs")
    assert rows == [["OK"]]
    _, raw = run_sql(settings, "SELECT count() FROM raw_events_latest WHERE session_id IN ('s-params', '')")
    assert raw == [[0]], "dead-lettered events must not appear as raw events"


def test_an_event_written_with_a_schema_registered_after_the_worker_started_is_read_not_dead_lettered(
    deployment: Settings, worker_factory
) -> None:
    """A producer registers a newer RewardSignal (one more optional field) and sends with it at once, long before the
    worker's 10 s registry refresh: the worker and its sink reload the registry on the unknown fingerprint, so the
    reward is woven and lands in raw_events, and nothing goes to dead letters."""
    worker = worker_factory(deployment).start()
    worker.wait_ready()
    session, lid = f"s-newer-{uuid7()[:8]}", uuid7()
    name = "treadle.events.RewardSignal"
    newer = SchemaSet.load()[name].json
    newer = AvroSchema.from_json(dict(newer, fields=[*newer["fields"], {"name": "rubric", "type": ["null", "string"],
                                                                        "default": None}]))  # fmt: skip

    async def register_and_send() -> None:
        registry = SchemaRegistry(deployment.kafka_bootstrap_servers, TopicCatalog(deployment)["schemas"].name)
        await registry.register([newer])
        value = AvroCodec(SchemaSet([newer])).encode(name, {**reward(session, lid, 3, 0.75, "judge"), "rubric": "r1"})
        async with RawProducer(deployment) as producer:
            await producer.send("treadle.events.ActionDispatched", dispatch(session, lid, 0, 1))
            await producer.producer.send(producer.catalog["rewards"].name, value, key=session.encode())
            await producer.flush()

    asyncio.run(register_and_send())
    query = f"SELECT reward FROM transitions_latest WHERE session_id = '{session}' AND reward IS NOT NULL"
    _, rows = wait_for(lambda: (r := run_sql(deployment, query))[1] and r, 60, "the reward woven into its step")
    assert rows == [[0.75]]
    raw = f"SELECT count() FROM raw_events_latest WHERE session_id = '{session}' AND kind = 'rewards'"
    assert wait_for(lambda: run_sql(deployment, raw)[1] == [[1]], 30, "the reward in raw_events")
    _, letters = run_sql(deployment, f"SELECT reason FROM dead_letters_latest WHERE session_id = '{session}'")
    assert letters == []
