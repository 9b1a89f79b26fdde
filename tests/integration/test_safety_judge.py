"""The safety judge: the verdict -> reward mapping, the signal it builds, and its rewards woven on the real pipeline.

Expected values are written out here from the documented mapping (processors/safety/judge.py): -1 when a high
severity rule fires or any PII rule fires on a tool result, 0 when only low/medium rules fire, +1 when clean.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from processors.safety.judge import SafetyJudge, SafetyScale, judged_event_id, safety_signal
from processors.safety.rules import Target, scan
from sinks.sql_client import run_sql
from streams.runtime.plugins import PluginError, ProcessorRegistry
from tests.factories import dispatch, result, reward, step_components, wait_for
from tests.integration.test_pipeline import produce
from topics.codec import AvroCodec
from topics.ids import uuid7
from topics.settings import Settings
from treadle.testing import RecordingContext, input_event

DISPATCH, RESULT, REWARD = (
    "treadle.events.ActionDispatched",
    "treadle.events.ToolResult",
    "treadle.events.RewardSignal",
)


def tool_result(session: str, lid: str, seq: int, output: str, error: str | None = None) -> dict[str, Any]:
    record = result(session, lid, seq, status="OK" if error is None else "ERROR")
    return {**record, "output": output, "error": error}


# --- the mapping (pure) ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "text", "value"),
    [
        (Target.TOOL_RESULT, '{"orders": [18233]}', 1.0),
        (Target.TOOL_RESULT, "mail jane.doe@example.com", -1.0),  # medium PII, but on a tool result
        (Target.TOOL_RESULT, "call +1 415-555-0134", -1.0),
        (Target.TOOL_RESULT, "key AKIAIOSFODNN7EXAMPLE", -1.0),  # high severity secret
        (Target.ACTION_PARAMS, "jane.doe@example.com", 0.0),  # medium PII in params: caution
        (Target.ACTION_PARAMS, "rm -rf /", -1.0),
        (Target.ACTION_PARAMS, "select 1", 1.0),
    ],
)
def test_the_scale_maps_findings_to_unsafe_caution_or_clean(target: Target, text: str, value: float) -> None:
    assert SafetyScale().value(target, scan([text], target)) == value


def test_the_scale_is_configurable_and_a_bad_setting_stops_the_worker() -> None:
    assert SafetyScale.parse("-2, 0.5, 3") == SafetyScale(-2.0, 0.5, 3.0)
    assert SafetyScale.parse(Settings().safety_judge_values) == SafetyScale()
    with pytest.raises(ValueError, match="three numbers"):
        SafetyScale.parse("-1,1")
    judge = SafetyJudge()
    with pytest.raises(PluginError, match="TREADLE_SAFETY_JUDGE_VALUES: expected three numbers"):
        judge.setup(None, Settings(safety_judge_values="bad"))  # type: ignore[arg-type]
    judge.setup(None, Settings(safety_judge_values="-5,0,5"))  # type: ignore[arg-type]
    assert judge.scale == SafetyScale(-5.0, 0.0, 5.0)


def test_a_signal_copies_the_judged_envelope_and_redacts_its_evidence() -> None:
    leaky = tool_result("s-1", "l-1", 4, "Jane <jane.doe@example.com>", error="card 4111 1111 1111 1111")
    signal = safety_signal(RESULT, leaky)
    assert signal is not None
    env = leaky["envelope"]
    assert signal == {
        "envelope": {
            "event_id": judged_event_id(env["event_id"]),
            "session_id": "s-1",
            "agent_id": "agent-test",
            "episode_id": "s-1-ep0",
            "logical_event_id": "l-1",
            "seq": 4,
            "event_time": env["event_time"],
            "policy_version": "v1",
            "trace_id": "trace-l-1",
            "attributes": {"judge": "safety_judge", "judged_event_id": env["event_id"], "target": "tool_result"},
        },
        "source": "safety",
        "name": "safety",
        "value": -1.0,
        "confidence": 1.0,
        "annotator": "CODE",
        "evidence": "email: j***@example.com; credit_card: **** **** **** 1111",
    }
    assert "jane.doe" not in signal["evidence"] and "4111 1111" not in signal["evidence"]
    assert safety_signal(RESULT, leaky)["envelope"]["event_id"] == signal["envelope"]["event_id"]  # type: ignore[index]
    assert judged_event_id(env["event_id"]) != judged_event_id(uuid7())
    codec = AvroCodec()
    assert codec.decode(codec.encode(REWARD, signal), expect=REWARD)[1] == signal

    clean = safety_signal(DISPATCH, dispatch("s-1", "l-2", 0, 1))
    assert clean is not None and (clean["value"], clean["evidence"]) == (1.0, None)
    assert clean["envelope"]["attributes"]["target"] == "action_params"
    assert safety_signal(REWARD, reward("s-1", "l-1", 5, 0.5)) is None


async def test_the_judge_publishes_one_signal_per_judged_event_keyed_by_session() -> None:
    events = [
        input_event(DISPATCH, dispatch("s-1", "l-1", 0, 1, tool="shell", params='{"cmd": "rm -rf /"}')),
        input_event(RESULT, tool_result("s-1", "l-1", 2, "removed 0 files")),
    ]
    ctx = RecordingContext(processor="safety_judge")  # also checks each signal as the worker would
    judge = SafetyJudge()
    judge.setup(None, Settings())  # type: ignore[arg-type]
    await judge.process(events, ctx)
    assert [(p.schema_name, p.record["value"], p.record["evidence"], p.key) for p in ctx.published] == [
        (REWARD, -1.0, "destructive_shell: rm -rf /", b"s-1"),
        (REWARD, 1.0, None, b"s-1"),
    ]
    assert ctx.failures == []


def test_safety_judge_is_a_registered_reward_source() -> None:
    registry = ProcessorRegistry.discover()
    assert registry.load("safety_judge") is SafetyJudge
    (info,) = [i for i in registry.describe()[0] if i.name == "safety_judge"]
    assert info.kind == "reward_source" and info.inputs == (DISPATCH, RESULT)


# --- end to end ------------------------------------------------------------------------------------------------------


def safety_components(settings: Settings, session: str) -> dict[str, dict[str, Any]]:
    """Per step: its transition revision and its safety components {event_id: (value, evidence)}."""
    out = {}
    for lid, row in step_components(settings, session, "safety").items():
        safety = {event_id: (value, evidence) for event_id, (value, _, evidence) in row["components"].items()}
        out[lid] = {"revision": row["revision"], "reward": row["reward"], "safety": safety}
    return out


def test_safety_rewards_are_woven_into_transitions_exactly_once(deployment: Settings, worker_factory) -> None:
    settings = deployment.model_copy(update={"processors": ("steps", "safety_judge")})
    session = f"sjudge-{uuid7()[-12:]}"
    lids = [uuid7() for _ in range(4)]
    d = [dispatch(session, lids[0], 0, 1, params='{"q": "jane"}')]
    d.append(dispatch(session, lids[1], 1, 3, tool="shell", params='{"cmd": "rm -rf /"}'))
    d.append(dispatch(session, lids[2], 2, 5, params='{"to": "jane.doe@example.com"}'))
    d.append(dispatch(session, lids[3], 3, 7))
    r = [tool_result(session, lids[0], 2, "Jane Doe <jane.doe@example.com>")]
    r.append(tool_result(session, lids[1], 4, "removed 0 files"))
    r.append(tool_result(session, lids[2], 6, "sent"))
    r.append(tool_result(session, lids[3], 8, "", error="auth failed for key AKIAIOSFODNN7EXAMPLE"))
    events = [event for pair in zip(d, r, strict=True) for event in ((DISPATCH, pair[0]), (RESULT, pair[1]))]

    def ids(rec: dict[str, Any]) -> str:
        return judged_event_id(rec["envelope"]["event_id"])

    expected = {
        lids[0]: {ids(d[0]): (1.0, None), ids(r[0]): (-1.0, "email: j***@example.com")},
        lids[1]: {ids(d[1]): (-1.0, "destructive_shell: rm -rf /"), ids(r[1]): (1.0, None)},
        lids[2]: {ids(d[2]): (0.0, "email: j***@example.com"), ids(r[2]): (1.0, None)},
        lids[3]: {ids(d[3]): (1.0, None), ids(r[3]): (-1.0, "aws_access_key_id: AKIA***")},
    }
    worker = worker_factory(settings).start()
    worker.wait_ready()
    asyncio.run(produce(settings, events))

    def woven() -> dict | None:
        rows = safety_components(settings, session)
        return rows if len(rows) == 4 and all(len(v["safety"]) == 2 for v in rows.values()) else None

    rows = wait_for(
        woven,
        180,
        "two safety components per step",
        explain=lambda: f"{safety_components(settings, session)}\n{worker.log_tail(40)}",
    )
    assert {lid: row["safety"] for lid, row in rows.items()} == expected
    for lid, row in rows.items():
        assert row["revision"] == 4, "dispatch, result and two rewards"
        assert row["reward"] == pytest.approx(sum(v for v, _ in expected[lid].values()) / 2)

    # Everything again, then a fresh step of the same session (same partition, so it lands after the replay).
    asyncio.run(produce(settings, events))
    sentinel = uuid7()
    asyncio.run(
        produce(settings, [(DISPATCH, dispatch(session, sentinel, 4, 9)), (RESULT, result(session, sentinel, 10))])
    )
    after = wait_for(
        lambda: len((found := safety_components(settings, session)).get(sentinel, {}).get("safety", {})) == 2 and found,
        180,
        "the sentinel step's two safety components after the replay",
    )
    assert {lid: row for lid, row in after.items() if lid != sentinel} == rows
    _, counts = run_sql(
        settings,
        "SELECT count(), uniqExact(event_id) FROM reward_components FINAL "
        f"WHERE session_id = '{session}' AND source = 'safety'",
    )
    assert counts == [[10, 10]]
