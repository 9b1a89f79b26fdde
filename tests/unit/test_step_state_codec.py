"""How the steps table stores a StepState (processors/steps/state_codec.py): round trips, the bytes events arrived
with kept as they are, events from another writer schema, and states stored as JSON by earlier versions."""

from __future__ import annotations

import copy

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from processors.steps.assembler import StepState
from processors.steps.state_codec import StepStateCodec
from tests.factories import dispatch, result
from tests.unit.test_weaving import T0, S, assembler, at, rows, signal, step_events
from topics.codec import AvroCodec
from topics.names import DISPATCH, REWARD, TOOL_RESULT
from topics.schemas import AvroSchema, SchemaSet

CODEC = AvroCodec()
STATES = StepStateCodec(CODEC)


def full_state(raw: bool) -> StepState:
    """A step with every kind of content: dispatch, result, rewards, passed windows, imputed values, an orphan."""
    a, state = assembler(), StepState("l-1")
    events = [
        (REWARD, signal("l-1", "metric", 0.25, 1, 1)),
        (DISPATCH, at(dispatch("s-1", "l-1", 0, 2), 0)),
        (DISPATCH, at(dispatch("s-1", "l-1", 0, 3), 0)),  # a second dispatch: only its id is kept
        (TOOL_RESULT, at(result("s-1", "l-1", 4), 1)),
        (REWARD, signal("l-1", "judge", 1.0, 2, 5)),
    ]
    for name, record in events:
        a.fold(state, name, record, CODEC.encode(name, record) if raw else None)
    state.partition = 3
    state.orphans.append(next(iter(state.rewards)))
    a.pass_windows(state, T0 + 1000 * S)  # human's window passes: imputed with its default
    assert state.passed and state.imputed and state.extra_dispatches and state.results
    return state


def test_a_state_round_trips_with_and_without_the_bytes_its_events_came_with() -> None:
    for raw in (True, False):
        state = full_state(raw)
        stored = STATES.encode(state)
        again = STATES.decode(stored)
        assert again == state and rows(assembler(), again) == rows(assembler(), state)
        assert STATES.encode(again) == stored  # the same bytes again: nothing depends on how it was loaded
        assert set(again.raw) == {state.dispatch["envelope"]["event_id"], *state.results, *state.rewards}


def test_the_bytes_an_event_came_with_are_stored_as_they_are() -> None:
    state = full_state(raw=True)
    stored = STATES.encode(state)
    for event_id, data in state.raw.items():
        assert data in stored, event_id
    losing = state.extra_dispatches[0]
    assert losing not in state.raw  # the dispatch that lost is an id only, its bytes are not kept


def test_an_event_from_another_writer_schema_is_read_as_the_intake_read_it() -> None:
    """A reward written with a newer RewardSignal (one more field): the state keeps those bytes, and reading the
    state resolves them into the schema the worker reads, via the registry, as the intake did."""
    shipped = CODEC.schemas[REWARD]
    newer_json = copy.deepcopy(shipped.json)
    newer_json["fields"].append({"name": "note", "type": "string", "default": ""})
    newer = AvroSchema.from_json(newer_json)
    written_by_newer = AvroCodec(SchemaSet([newer]))
    registry = {newer.fingerprint: newer}
    worker_codec = AvroCodec(lookup=registry.get)
    record = signal("l-1", "judge", 0.5, 2, 2)
    data = written_by_newer.encode(REWARD, {**record, "note": "from a newer producer"})
    _, as_read = worker_codec.decode(data, expect=REWARD)
    a, state = assembler(), StepState("l-1")
    a.fold(state, REWARD, as_read, data)
    states = StepStateCodec(worker_codec)
    again = states.decode(states.encode(state))
    assert again.rewards == {record["envelope"]["event_id"]: record} and again.raw == state.raw


def test_states_stored_as_json_by_earlier_versions_are_still_read() -> None:
    state = full_state(raw=False)
    earlier = orjson.dumps(
        {
            "l": state.logical_event_id, "d": state.dispatch, "t": state.results, "r": state.rewards,
            "x": state.extra_dispatches, "p": state.partition, "v": state.reward_policy, "w": state.passed,
            "i": state.imputed, "o": state.orphans,
        }
    )  # fmt: skip
    again = STATES.decode(earlier)
    assert again == state
    assert STATES.decode(STATES.encode(again)) == state  # written back in the current form


@settings(max_examples=100, deadline=None)
@given(step_events(), st.lists(st.booleans(), min_size=12, max_size=12), st.floats(0, 300))
def test_any_step_round_trips(events: list[tuple[str, dict]], with_raw: list[bool], watermark_s: float) -> None:
    a, state = assembler(), StepState("l-1")
    for (name, record), raw in zip(events, with_raw * 2, strict=False):
        a.fold(state, name, record, CODEC.encode(name, record) if raw else None)
    a.pass_windows(state, T0 + int(watermark_s * S))
    again = STATES.decode(STATES.encode(state))
    assert again == state and rows(assembler(), again) == rows(assembler(), state)
