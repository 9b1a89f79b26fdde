"""The step assembler as a Faust processor: StepState per logical_event_id in a RocksDB table."""

from __future__ import annotations

from typing import Any

import faust

from processors.base import Outputs
from processors.step_assembler import STEP_INPUTS, StepAssembler, StepState
from streams.settings import Settings


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

    async def process(self, schema_name: str, record: dict[str, Any], outputs: Outputs) -> None:
        key = record["envelope"]["logical_event_id"].encode()
        stored = self.table.get(key)
        state = StepState.from_bytes(stored) if stored is not None else StepState(key.decode())
        output = self.assembler.apply(state, schema_name, record)
        if output.changed:
            self.table[key] = state.to_bytes()
        session_key = record["envelope"]["session_id"].encode()
        for derived_schema, derived in output.records:
            await outputs.publish(derived_schema, derived, key=session_key)
