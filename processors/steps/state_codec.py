"""A step's state as the steps table stores it (RocksDB + changelog): its events as they came, in one Avro record.

Stored now: single-object Avro of `treadle.internal.StepState` (STEP_STATE_SCHEMA): the step's own fields, and
each event it holds as that event's own single-object Avro bytes. Those are the bytes the event arrived with when
the worker still has them (StepState.raw: nothing to encode), else the event re-encoded. Reading decodes each event
with the worker's codec, as the intake did, so an event from an older writer schema is resolved the same way (the
worker registers every schema it ships, so the registry knows that writer after an upgrade).

Still read, never written: the JSON of earlier versions (it starts with `{`).

Why not JSON: it was ~2.7 KB a step, and orjson took 16-20 us to write one here, the largest single cost of writing
changed steps out. This is ~1.5 KB, written in 7-8 us with the native codec (topics/native_codec.py); reading one
costs about what orjson did (~19 us against ~16 with the garbage collector off), and a worker writes far more
steps than it reads (docs/native-codec.md).
"""

from __future__ import annotations

from typing import Any

import orjson

from processors.steps.assembler import StepState
from topics.codec import AvroCodec
from topics.names import DISPATCH, REWARD, TOOL_RESULT
from topics.schemas import AvroSchema, SchemaSet

STEP_STATE = "treadle.internal.StepState"
STEP_STATE_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": STEP_STATE,
    "doc": "One step's state in the worker's steps table (processors/steps/state_codec.py); never on a topic.",
    "fields": [
        {"name": "logical_event_id", "type": "string"},
        {"name": "partition", "type": ["null", "long"]},
        {"name": "reward_policy", "type": ["null", "string"]},
        {"name": "dispatch", "type": ["null", "bytes"]},  # each event: its single-object Avro bytes
        {"name": "results", "type": {"type": "map", "values": "bytes"}},
        {"name": "rewards", "type": {"type": "map", "values": "bytes"}},
        {"name": "extra_dispatches", "type": {"type": "array", "items": "string"}},
        {"name": "passed", "type": {"type": "array", "items": "string"}},
        {"name": "imputed", "type": {"type": "map", "values": "double"}},
        {"name": "orphans", "type": {"type": "array", "items": "string"}},
    ],
}


class StepStateCodec:
    """StepState <-> the bytes of the steps table. `events`: the worker's codec (it knows the schema registry)."""

    def __init__(self, events: AvroCodec | None = None) -> None:
        self.events = events or AvroCodec()
        self._own = AvroCodec(SchemaSet([AvroSchema.from_json(STEP_STATE_SCHEMA)]))

    def encode(self, state: StepState) -> bytes:
        dispatch, raw, encode = state.dispatch, state.raw, self.events.encode
        return self._own.encode(
            STEP_STATE,
            {
                "logical_event_id": state.logical_event_id,
                "partition": state.partition,
                "reward_policy": state.reward_policy,
                # an event's bytes as it arrived (results and rewards are keyed by event_id), else encoded again
                "dispatch": None
                if dispatch is None
                else raw.get(dispatch["envelope"]["event_id"]) or encode(DISPATCH, dispatch),
                "results": {k: raw.get(k) or encode(TOOL_RESULT, r) for k, r in state.results.items()},
                "rewards": {k: raw.get(k) or encode(REWARD, r) for k, r in state.rewards.items()},
                "extra_dispatches": state.extra_dispatches,
                "passed": state.passed,
                "imputed": state.imputed,
                "orphans": state.orphans,
            },
        )

    def decode(self, data: bytes) -> StepState:
        if data[:1] == b"{":
            return _from_json(data)
        doc = self._own.decode(data, expect=STEP_STATE)[1]
        raw: dict[str, bytes] = {}
        dispatch = self._event(DISPATCH, doc["dispatch"], raw) if doc["dispatch"] is not None else None
        return StepState(
            logical_event_id=doc["logical_event_id"],
            dispatch=dispatch,
            results={k: self._event(TOOL_RESULT, v, raw) for k, v in doc["results"].items()},
            rewards={k: self._event(REWARD, v, raw) for k, v in doc["rewards"].items()},
            extra_dispatches=doc["extra_dispatches"],
            partition=doc["partition"],
            reward_policy=doc["reward_policy"],
            passed=doc["passed"],
            imputed=doc["imputed"],
            orphans=doc["orphans"],
            raw=raw,
        )

    def _event(self, schema_name: str, data: bytes, raw: dict[str, bytes]) -> dict[str, Any]:
        record = self.events.decode(data, expect=schema_name)[1]
        raw[record["envelope"]["event_id"]] = data
        return record


def _from_json(data: bytes) -> StepState:
    """A state as earlier versions stored it (orjson of its fields, one-letter keys)."""
    doc = orjson.loads(data)
    return StepState(
        logical_event_id=doc["l"],
        dispatch=doc["d"],
        results=doc["t"],
        rewards=doc["r"],
        extra_dispatches=doc["x"],
        partition=doc.get("p"),
        reward_policy=doc.get("v"),
        passed=doc.get("w", []),
        imputed=doc.get("i", {}),
        orphans=doc.get("o", []),
    )
