"""The step assembler as a Faust processor: StepState per logical_event_id in a RocksDB table.

Per batch, each touched step is read once, folded with all its events, written once and its
current rows published once; the fold is order-independent, so batching changes no result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import faust

from processors import table_writes
from processors.base import InputEvent, ProcessingContext
from processors.step_assembler import STEP_INPUTS, StepAssembler, StepState
from streams.settings import Settings


@dataclass
class _Touched:
    state: StepState
    event: InputEvent  # any event of the step: all share its session's partition
    changed: bool = False


class StepProcessor:
    name = "steps"
    inputs = frozenset(STEP_INPUTS)

    def __init__(self, assembler: StepAssembler | None = None) -> None:
        self.assembler = assembler or StepAssembler()
        self.table: Any = None  # faust.Table[bytes, bytes]

    def setup(self, app: faust.App, settings: Settings) -> None:
        self.table = app.Table(
            self.name,
            partitions=settings.partitions,
            key_type=bytes,  # Faust picks the raw serializer from the type; without it, JSON
            value_type=bytes,
            help="StepState per logical_event_id, serialized with orjson.",
        )

    async def process(self, events: list[InputEvent], ctx: ProcessingContext) -> None:
        touched: dict[bytes, _Touched] = {}
        for event in events:
            key = event.record["envelope"]["logical_event_id"].encode()
            entry = touched.get(key)
            try:
                if entry is None:
                    ctx.bind(event)
                    stored = self.table.get(key)
                    state = StepState.from_bytes(stored) if stored is not None else StepState(key.decode())
                    entry = touched[key] = _Touched(state, event)
                entry.changed |= self.assembler.fold(entry.state, event.schema_name, event.record)
            except Exception as exc:  # corrupt state or a bug: dead-letter this event, keep the batch going
                await ctx.failed(self.name, event, exc)
        for key, entry in touched.items():
            if entry.changed:
                await table_writes.put(self.table, key, entry.state.to_bytes(), entry.event, ctx)
            # Unchanged steps were touched by duplicates: re-emit, in case a crash lost the first emission.
            for schema_name, record in self.assembler.outputs(entry.state):
                await ctx.publish(schema_name, record, key=entry.event.session_key)
