"""One per-key table value stays below TREADLE_MAX_EVENT_BYTES, whatever one session sends.

A processor's table value (a step, an episode's credit state, a judged step, a session's state graph records) is
a RocksDB value and a changelog record: above the broker's record limit its changelog write is refused, and the
worker meets that refusal again after every restart. So an input event that would take a value past the limit is
refused instead, as the step table refuses one (StepProcessor): a PROCESS dead letter naming the limit, counted in
treadle_state_limit_refusals_total, and the value stays as it was. The other events go on.

Measuring a value means serializing it, which for a value that grows with its session (an episode's state) would
cost O(n) per event. ValueBudget measures only near the limit: it adds an upper bound of each folded event's
growth to the last measured size, and asks for an exact size once that bound could pass the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from streams.runtime.processor import InputEvent, ProcessingContext

LIMIT_SETTING = "TREADLE_MAX_EVENT_BYTES"
GROWTH_PER_EVENT_BYTE = 2  # a value's JSON grows by at most this much per byte of the Avro event folded into it
GROWTH_SLACK = 512  # plus this per event (field names, quoting)


class TableValueTooLargeError(ValueError):
    """An input event that would take a per-key table value past its size limit; the value is left as it was."""


def too_large(processor: str, what: str, size: int, limit: int) -> TableValueTooLargeError:
    return TableValueTooLargeError(
        f"{what} would be {size:,} bytes with this event, past the {limit:,}-byte limit ({LIMIT_SETTING}) of one "
        f"{processor} table value; the event is refused and the value kept as it was"
    )


async def refuse(ctx: ProcessingContext, processor: str, event: InputEvent, error: TableValueTooLargeError) -> None:
    """The event becomes a PROCESS dead letter with the reason, counted per processor."""
    metrics = getattr(ctx, "metrics", None)  # a test's bare context may have none
    if metrics is not None:
        metrics.state_limit_refusals.labels(processor).inc()
    await ctx.failed(processor, event, error)


@dataclass
class ValueBudget:
    """What is known of one value's size while events fold into it: `size` is exact after `measured`, and an upper
    bound after `grew`."""

    limit: int
    size: int = 0

    def near(self, event_bytes: int) -> bool:
        """Whether folding an event of `event_bytes` could take the value past the limit (then measure it)."""
        return self.size + GROWTH_PER_EVENT_BYTE * event_bytes + GROWTH_SLACK > self.limit

    def grew(self, event_bytes: int) -> None:
        self.size += GROWTH_PER_EVENT_BYTE * event_bytes + GROWTH_SLACK

    def measured(self, size: int) -> None:
        self.size = size
