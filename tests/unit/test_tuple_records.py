"""Records given as tuples of their field values (AvroCodec.writer, AvroCodec.record_of), as the SDK's hot paths
build them: the same bytes as the dict, natively or not, and the SDK's tuple layouts are the schemas' field orders."""

from __future__ import annotations

from typing import Any

import pytest
import treadle_native
from hypothesis import given

from streams.sdk.emitter import DISPATCH_FIELDS, ENVELOPE_FIELDS, REWARD_FIELDS, TOOL_RESULT_FIELDS
from tests.unit.test_avro_writer import PROPERTY, SCHEMAS, any_record, fastavro_bytes
from topics import native_codec
from topics.codec import AvroCodec
from topics.names import DISPATCH, REWARD, TOOL_RESULT
from topics.settings import Settings
from treadle import AgentStream

NATIVE = AvroCodec(SCHEMAS)
PYTHON = AvroCodec(SCHEMAS)
PYTHON.native = False  # the generated Python writers, as without treadle_native


def as_tuples(schema: Any, value: Any) -> Any:
    """`value` with every record defined in place given as a tuple (the inverse of AvroCodec.record_of)."""
    if isinstance(schema, dict) and schema.get("type") == "record" and isinstance(value, dict):
        return tuple(as_tuples(field["type"], value[field["name"]]) for field in schema["fields"])
    if isinstance(schema, list) and isinstance(value, dict):
        branch = next((b for b in schema if isinstance(b, dict) and b.get("type") == "record"), None)
        return as_tuples(branch, value) if branch is not None else value
    return value


def test_this_build_of_treadle_native_takes_tuples() -> None:
    assert native_codec.TAKES_TUPLES


@PROPERTY
@given(any_record)
def test_a_record_as_tuples_encodes_as_the_dict_and_reads_back_as_it(named_record: tuple[str, Any]) -> None:
    name, record = named_record
    values = as_tuples(SCHEMAS[name].json, record)
    assert NATIVE.record_of(name, values) == record
    expected = fastavro_bytes(name, record)
    for codec in (NATIVE, PYTHON):
        try:
            written = codec.writer(name)(values)
        except Exception:  # a value the compiled writer does not take: encode (fastavro) decides, from the dict
            written = codec.encode(name, codec.record_of(name, values))
        assert written == expected


def test_a_tuple_of_the_wrong_length_is_refused() -> None:
    envelope = ("e", "s", "a", "ep", "l", 1, 5, "v", "t", {})
    with pytest.raises(treadle_native.Refused):
        NATIVE.writer(REWARD)((envelope, "judge", "q", 0.5, 0.9, "LLM"))
    with pytest.raises(ValueError, match="7 fields, the tuple given 6"):
        NATIVE.record_of(REWARD, (envelope, "judge", "q", 0.5, 0.9, "LLM"))


@pytest.mark.parametrize(
    ("schema", "fields"), [(DISPATCH, DISPATCH_FIELDS), (TOOL_RESULT, TOOL_RESULT_FIELDS), (REWARD, REWARD_FIELDS)]
)
def test_the_sdk_tuple_layouts_are_the_schemas_field_orders(schema: str, fields: tuple[str, ...]) -> None:
    declared = SCHEMAS[schema].json["fields"]
    assert tuple(f["name"] for f in declared) == fields
    assert tuple(f["name"] for f in declared[0]["type"]["fields"]) == ENVELOPE_FIELDS


class Text(str):
    """A str subclass: the native writer refuses it, fastavro writes it."""


def test_the_sdk_encodes_values_the_native_writer_refuses_through_fastavro() -> None:
    stream = AgentStream(Settings(), agent_id="a", policy_version="v1")
    envelope = ("e", "s", "a", "ep", "l", 1, 5, "v", "t", {"k": "v"})
    plain = (envelope, "judge", "q", 0.5, 0.9, "LLM", None)
    odd = (envelope, Text("judge"), "q", 0.5, 0.9, "LLM", None)
    expected = fastavro_bytes(REWARD, NATIVE.record_of(REWARD, plain))
    assert stream._encode(REWARD, plain) == expected
    assert stream._encode(REWARD, odd) == expected
    with pytest.raises(ValueError, match="cannot encode RewardSignal"):
        stream._encode(REWARD, (envelope, "judge", "q", "half", 0.9, "LLM", None))
