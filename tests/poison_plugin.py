"""A processor plugin that raises on one kind of record, for the poison-pill tests (tests/test_poison_pills.py).

It raises for the whole batch it is handed, as a careless plugin would: the worker must cost only the marked record.
"""

from __future__ import annotations

import asyncio

from processors.evaluation import metric_record
from topics.names import EVALUATION_METRIC

MARK = "EXPLODE"


class ExplodesOnMark:
    """Flags every tool result, and raises on one whose output holds MARK."""

    name = "explodes"
    kind = "evaluator"
    inputs = frozenset({"treadle.events.ToolResult"})

    def setup(self, app, settings) -> None:
        """No state."""

    async def process(self, events, ctx) -> None:
        for event in events:
            if MARK in event.record["output"]:
                raise RuntimeError(f"cannot judge output {event.record['output'][:20]!r}")
        for event in events:
            metric = metric_record(self.name, "seen", "any", 1.0, "low", event.record)
            await ctx.publish(EVALUATION_METRIC, metric, key=event.session_key)


class HangsOnMark(ExplodesOnMark):
    """Never returns from a batch holding a marked tool result, as a plugin stuck on a call without a timeout."""

    name = "hangs"

    async def process(self, events, ctx) -> None:
        if any(MARK in event.record["output"] for event in events):
            await asyncio.Event().wait()
        await super().process(events, ctx)


class PublishesThenExplodes:
    """Flags each tool result as it goes, and raises on a marked one after flagging the ones before it: the batch's
    retry must not send those flags again (issue 30)."""

    name = "explodes_late"
    kind = "evaluator"
    inputs = frozenset({"treadle.events.ToolResult"})

    def setup(self, app, settings) -> None:
        """No state."""

    async def process(self, events, ctx) -> None:
        for event in events:
            if MARK in event.record["output"]:
                raise RuntimeError(f"cannot judge output {event.record['output'][:20]!r}")
            metric = metric_record(self.name, "seen", "any", 1.0, "low", event.record)
            await ctx.publish(EVALUATION_METRIC, metric, key=event.session_key)
