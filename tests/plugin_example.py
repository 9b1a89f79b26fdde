"""docs/plugins.md's example processor plugin, plus broken variants; test_plugins loads them through entry points."""

from __future__ import annotations

from processors.evaluation import metric_record
from processors.rewards import reward_signal
from topics.names import EVALUATION_METRIC, REWARD

TOOL_RESULT = "treadle.events.ToolResult"


class LongOutput:
    """Flags tool outputs over 10,000 characters."""

    name = "long_output"  # the entry point's name; TREADLE_PROCESSORS lists it
    kind = "evaluator"  # core, reward_source or evaluator
    inputs = frozenset({"treadle.events.ToolResult"})

    def setup(self, app, settings) -> None:
        """Create Faust tables here if the processor keeps state."""

    async def process(self, events, ctx) -> None:
        for event in events:
            value = float(len(event.record["output"]) > 10_000)
            metric = metric_record(self.name, "long_output", "over_10k", value, "low", event.record)
            await ctx.publish(EVALUATION_METRIC, metric, key=event.session_key)


class ToolSuccess:
    """docs/plugins.md's tutorial reward source: +1 when a tool call succeeded, -1 otherwise."""

    name = "tool_success"
    kind = "reward_source"
    inputs = frozenset({TOOL_RESULT})

    def setup(self, app, settings) -> None:
        """It keeps no state."""

    async def process(self, events, ctx) -> None:
        for event in events:
            record = event.record
            value = 1.0 if record["status"] == "OK" else -1.0
            evidence = f"{record['tool']} {record['status']} in {record['latency_ms']:.0f} ms"
            signal = reward_signal(self.name, value, record, name="success", evidence=evidence)
            await ctx.publish(REWARD, signal, key=event.session_key)


class Misnamed(LongOutput):
    name = "something_else"


class NoKind:
    name = "no_kind"
    inputs = frozenset({TOOL_RESULT})

    def setup(self, app, settings) -> None: ...

    async def process(self, events, ctx) -> None: ...


class WrongKind(LongOutput):
    name = "wrong_kind"
    kind = "judge"


class ReadsOutputs(LongOutput):
    name = "reads_outputs"
    inputs = frozenset({"treadle.derived.Transition"})


def not_a_class() -> None:
    """An entry point must name a class."""
