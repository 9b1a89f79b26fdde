"""process_isolated with ProcessorContext: a raising event costs only itself, nothing is sent twice, a bad publish
raises in the plugin with its name, and each processor is counted (issue 30). The pipeline here is a stand-in that
keeps what would be sent; the real worker is in tests/integration/test_plugin_tutorial.py and test_poison_pills.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from streams.runtime.app import process_isolated
from streams.runtime.metrics import WorkerMetrics
from streams.runtime.processor import InputEvent
from topics.codec import AvroCodec
from topics.names import DEAD_LETTER, EVALUATION_METRIC, REWARD, TOOL_RESULT
from topics.validation import InputValidator
from treadle import metric_record, reward_signal
from treadle.testing import tool_result

MARK = "EXPLODE"


@dataclass
class _Intake:
    validator: InputValidator = field(default_factory=InputValidator)


@dataclass
class SentRecords:
    """Stands in for the Pipeline: encodes as it does, keeps what it would send and dead-letter."""

    codec: AvroCodec = field(default_factory=AvroCodec)
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    intake: _Intake = field(default_factory=_Intake)
    outputs: dict[str, str] = field(
        default_factory=lambda: {EVALUATION_METRIC: "eval", REWARD: "rewards", DEAD_LETTER: "dead"}
    )
    sent: list[tuple[str, bytes | None, bytes]] = field(default_factory=list)
    failures: list[tuple[str, InputEvent, Exception]] = field(default_factory=list)

    def encode_output(self, schema_name: str, record: dict[str, Any], key: bytes | None) -> bytes:
        return self.codec.encode(schema_name, record)

    async def send_output(self, schema_name: str, key: bytes | None, value: bytes) -> None:
        self.sent.append((schema_name, key, value))

    async def failed(self, processor: str, event: InputEvent, exc: Exception) -> None:
        self.failures.append((processor, event, exc))

    def metric_ids(self) -> list[str]:
        return [self.codec.decode(v)[1]["metric_id"] for s, _, v in self.sent if s == EVALUATION_METRIC]


class PublishesThenExplodes:
    """Publishes a metric per tool result in order, and raises on a marked one (after publishing the earlier ones)."""

    name = "explodes_late"
    kind = "evaluator"
    inputs = frozenset({TOOL_RESULT})

    def setup(self, app, settings) -> None: ...

    async def process(self, events, ctx) -> None:
        for event in events:
            if MARK in event.record["output"]:
                raise RuntimeError("cannot judge this one")
            record = metric_record(self.name, "seen", "any", 1.0, "low", event.record)
            await ctx.publish(EVALUATION_METRIC, record, key=event.session_key)


def sample(value: Any, name: str, **labels: str) -> float:
    return value.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_a_raising_event_costs_itself_and_nothing_is_sent_twice() -> None:
    events = [tool_result(output=f"out {i}") for i in range(3)]
    events.insert(2, tool_result(output=f"{MARK} here"))
    pipeline = SentRecords()
    await process_isolated(PublishesThenExplodes(), events, pipeline)  # type: ignore[arg-type]
    good = [e for e in events if MARK not in e.record["output"]]
    expected = [f"explodes_late:seen:any:{e.record['envelope']['event_id']}" for e in good]
    assert pipeline.metric_ids() == expected, "each good event's metric exactly once, in order"
    [(processor, event, exc)] = pipeline.failures
    assert (processor, event, str(exc)) == ("explodes_late", events[2], "cannot judge this one")
    assert sample(pipeline, "treadle_processor_duplicates_skipped_total", processor="explodes_late") == 2
    assert sample(pipeline, "treadle_processor_events_in_total", processor="explodes_late") == 4
    labels = {"processor": "explodes_late", "type": EVALUATION_METRIC}
    assert sample(pipeline, "treadle_processor_records_out_total", **labels) == 3
    assert sample(pipeline, "treadle_processor_seconds_total", processor="explodes_late") > 0


class PublishesBadSignal:
    """Rewards every tool result with a confidence of 2.0 (out of range)."""

    name = "my_source"
    kind = "reward_source"
    inputs = frozenset({TOOL_RESULT})

    def setup(self, app, settings) -> None: ...

    async def process(self, events, ctx) -> None:
        for event in events:
            signal = reward_signal(self.name, 1.0, event.record, confidence=2.0)
            await ctx.publish(REWARD, signal, key=event.session_key)


async def test_a_bad_publish_raises_in_the_plugin_and_becomes_its_events_dead_letter() -> None:
    pipeline = SentRecords()
    event = tool_result()
    await process_isolated(PublishesBadSignal(), [event], pipeline)  # type: ignore[arg-type]
    assert pipeline.sent == []
    [(processor, failed, exc)] = pipeline.failures
    assert processor == "my_source" and failed is event
    assert str(exc) == (
        "plugin 'my_source' published a RewardSignal the worker would dead-letter: confidence must be in [0, 1], "
        "got 2.0"
    )


async def test_a_batch_that_succeeds_is_sent_once_as_it_was_published() -> None:
    events = [tool_result(output=f"out {i}") for i in range(3)]
    pipeline = SentRecords()
    await process_isolated(PublishesThenExplodes(), events, pipeline)  # type: ignore[arg-type]
    assert len(pipeline.metric_ids()) == 3 and pipeline.failures == []
    assert sample(pipeline, "treadle_processor_duplicates_skipped_total", processor="explodes_late") == 0
