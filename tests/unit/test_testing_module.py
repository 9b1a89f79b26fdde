"""treadle.testing: factories make events the worker would hand over, and the recording context refuses what the
worker would refuse, naming the plugin and the field (issue 30)."""

from __future__ import annotations

import time

import pytest

from topics.codec import AvroCodec
from topics.names import DISPATCH, LIFECYCLE, REWARD, STATE_DELTA, TOOL_RESULT
from topics.validation import InputValidator
from treadle import metric_record, reward_signal
from treadle.testing import (
    PublishError,
    RecordingContext,
    check_publish,
    dispatch,
    input_event,
    lifecycle,
    reward,
    run_sync,
    state_delta,
    tool_result,
)


def test_every_input_record_has_a_factory_valid_by_default() -> None:
    events = [
        dispatch(),
        tool_result(),
        reward(),
        state_delta([{"id": "n1", "type": "doc"}], edge_upserts=[{"src": "n1", "dst": "n1", "type": "causes"}]),
        lifecycle("EPISODE_ENDED", done=True, episode_reward=1.0),
    ]
    assert [e.schema_name for e in events] == [DISPATCH, TOOL_RESULT, REWARD, STATE_DELTA, LIFECYCLE]
    codec, validator = AvroCodec(), InputValidator()
    for event in events:
        assert codec.decode(event.source.value, expect=event.schema_name)[1] == event.record
        assert validator.problem(event.schema_name, event.record, event.source.key) is None
        assert event.session_key == event.source.key == b"session-1"
    assert len({e.record["envelope"]["event_id"] for e in events}) == 5
    assert len({e.record["envelope"]["logical_event_id"] for e in events}) == 5, "each its own step by default"

    same_step = tool_result(logical_event_id="step-7", session_id="s-9", latency_ms=3.0)
    assert (same_step.record["envelope"]["logical_event_id"], same_step.session_key) == ("step-7", b"s-9")
    assert input_event(TOOL_RESULT, same_step.record).record == same_step.record


def test_a_factory_refuses_what_the_worker_would_never_hand_over() -> None:
    with pytest.raises(ValueError, match=r"never hands a processor this RewardSignal: confidence must be in \[0, 1\]"):
        reward(confidence=2.0)
    with pytest.raises(ValueError, match="latency_ms must be a finite non-negative number"):
        tool_result(latency_ms=-1)
    with pytest.raises(ValueError, match="never hands a processor this ToolResult"):
        tool_result(status="FINE")


def test_a_bad_publish_raises_with_the_plugins_name_and_the_field() -> None:
    judged = tool_result().record
    good = reward_signal("my_source", 1.0, judged)
    check_publish(REWARD, good, b"session-1", "my_source")
    cases = [
        ({**good, "confidence": 2.0}, b"session-1", r"confidence must be in \[0, 1\], got 2.0"),
        ({**good, "value": float("nan")}, b"session-1", "reward value must be finite"),
        ({**good, "annotator": "ROBOT"}, b"session-1", "field RewardSignal.annotator is 'ROBOT', expected one of LLM"),
        ({**good, "confidence": "high"}, b"session-1", "field RewardSignal.confidence is 'high', expected double"),
        (good, None, "the message has no key"),
        (good, b"other", "differs from envelope.session_id"),
    ]
    for record, key, problem in cases:
        with pytest.raises(PublishError, match=r"^plugin 'my_source' published a RewardSignal .*" + problem):
            check_publish(REWARD, record, key, "my_source")
    with pytest.raises(PublishError, match=r"treadle\.events\.ToolResult is not a record a processor can publish"):
        check_publish(TOOL_RESULT, judged, b"session-1", "my_source")


class Careless:
    """Publishes a confidence of 2 for every tool result."""

    name = "careless"
    kind = "reward_source"
    inputs = frozenset({TOOL_RESULT})

    def setup(self, app, settings) -> None: ...

    async def process(self, events, ctx) -> None:
        for event in events:
            signal = reward_signal(self.name, 1.0, event.record, confidence=2.0)
            await ctx.publish(REWARD, signal, key=event.session_key)


def test_run_records_publishes_and_fails_at_the_line_that_made_a_bad_one() -> None:
    with pytest.raises(PublishError, match=r"^plugin 'careless' published a RewardSignal"):
        run_sync(Careless(), tool_result())

    class Evaluator(Careless):
        name = "length"
        kind = "evaluator"

        async def process(self, events, ctx) -> None:
            for event in events:
                record = metric_record(self.name, "chars", "all", len(event.record["output"]), "low", event.record)
                await ctx.publish("treadle.derived.EvaluationMetric", record, key=event.session_key)

    started = time.perf_counter()
    ctx = run_sync(Evaluator(), tool_result(output="abc"), tool_result(output=""))
    assert time.perf_counter() - started < 0.5
    assert isinstance(ctx, RecordingContext) and ctx.processor == "length"
    assert [m["value"] for m in ctx.evaluation_metrics] == [3.0, 0.0] and ctx.rewards == [] and ctx.failures == []


def test_reward_signal_is_deterministic_and_lands_on_the_judged_step() -> None:
    judged = tool_result(logical_event_id="step-1").record
    a, b = reward_signal("src", 0.5, judged, name="q"), reward_signal("src", 0.5, judged, name="q")
    assert a == b and a["envelope"]["event_id"] != judged["envelope"]["event_id"]
    assert reward_signal("src", 0.5, judged, name="other")["envelope"]["event_id"] != a["envelope"]["event_id"]
    assert a["envelope"]["logical_event_id"] == "step-1"
    assert a["envelope"]["event_time"] == judged["envelope"]["event_time"]
    assert a["envelope"]["attributes"]["judged_event_id"] == judged["envelope"]["event_id"]
