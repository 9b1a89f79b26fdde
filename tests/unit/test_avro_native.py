"""The native Avro codec (native/src/avro.rs) against fastavro, the reference, and the generated Python codec.

Wherever it writes or reads, its answer is fastavro's, byte for byte and value for value; where it cannot vouch for
a value or bytes it raises `Refused`, never guesses, and the codec asks fastavro. `make install` builds it (cargo);
these tests fail, not skip, where it is missing.
"""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
import treadle_native
from fastavro import parse_schema, schemaless_writer
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.test_avro_reader import EVERY_TYPE, MALFORMED, corrupted, fastavro_read, same, several_blocks
from tests.unit.test_avro_writer import (
    MISSING,
    NAMES,
    ODD_VALUES,
    PROPERTY,
    RECORDS,
    SCHEMAS,
    any_record,
    fastavro_bytes,
    paths,
    records,
    replaced,
    sample,
)
from topics import native_codec
from topics.codec import HEADER, MAGIC, AvroCodec

NATIVE = {
    name: treadle_native.RecordCodec(json.dumps(SCHEMAS[name].json), HEADER.pack(MAGIC, SCHEMAS[name].fingerprint))
    for name in NAMES
}
# Every Avro type the native codec covers: EVERY_TYPE less fixed and the five-branch union.
EVERY_NATIVE_TYPE = {
    **EVERY_TYPE,
    "name": "EveryNative",
    "fields": [
        *[f for f in EVERY_TYPE["fields"] if f["name"] not in ("x", "x2", "u")],
        {"name": "u1", "type": ["null", "string"]},
        {"name": "u2", "type": ["long", "null"]},
        {"name": "u3", "type": ["null", "In"]},
        {"name": "u4", "type": ["null", {"type": "array", "items": "double"}]},
    ],
}
EVERY_NATIVE = treadle_native.RecordCodec(json.dumps(EVERY_NATIVE_TYPE))
EVERY_NATIVE_PARSED = parse_schema(EVERY_NATIVE_TYPE)


def native_outcome(name: str, record: Any) -> tuple[str, Any]:
    try:
        return "bytes", NATIVE[name].encode(record)
    except treadle_native.Refused:
        return "refused", None


@PROPERTY
@given(any_record)
def test_native_writer_is_byte_identical_to_fastavro(named_record: tuple[str, dict[str, Any]]) -> None:
    name, record = named_record
    assert NATIVE[name].encode(record) == fastavro_bytes(name, record)


@PROPERTY
@given(records(EVERY_NATIVE_TYPE, {}))
def test_every_avro_type_it_covers_writes_and_reads_as_in_fastavro(record: dict[str, Any]) -> None:
    buf = io.BytesIO()
    schemaless_writer(buf, EVERY_NATIVE_PARSED, record)
    assert EVERY_NATIVE.encode(record) == buf.getvalue()
    data = b"pad" + buf.getvalue()
    assert same(EVERY_NATIVE.decode(data, 3), fastavro_read(EVERY_NATIVE_PARSED, data, 3))


@pytest.mark.parametrize("name", NAMES)
def test_odd_values_are_refused_or_written_as_fastavro_writes_them(name: str) -> None:
    """Every field, at every depth, set to a wrong type, a bool for a long, an int for a double, a tuple, a subclass,
    or left out: the native writer refuses it (fastavro then decides) or writes fastavro's bytes. It never guesses."""
    record = sample(SCHEMAS[name].json, {})
    assert NATIVE[name].encode(record) == fastavro_bytes(name, record)
    for path in paths(record):
        for value in [*ODD_VALUES, 1e39, MISSING] if isinstance(path[-1], str) else [*ODD_VALUES, 1e39]:
            odd = replaced(record, path, value)
            kind, written = native_outcome(name, odd)
            if kind == "bytes":
                assert written == fastavro_bytes(name, odd), (path, value)


def test_a_double_too_large_for_a_float_is_refused() -> None:
    """struct.pack("<f") raises for it, and fastavro has its own answer: the native writer must not write inf."""
    schema = {"type": "record", "name": "F", "fields": [{"name": "f", "type": "float"}]}
    codec = treadle_native.RecordCodec(json.dumps(schema))
    assert codec.encode({"f": 3.0e38}) == _fastavro(schema, {"f": 3.0e38})
    with pytest.raises(treadle_native.Refused):
        codec.encode({"f": 1e39})
    assert codec.encode({"f": float("inf")}) == _fastavro(schema, {"f": float("inf")})


@PROPERTY
@given(any_record)
def test_native_reader_returns_what_fastavro_returns(named_record: tuple[str, dict[str, Any]]) -> None:
    name, record = named_record
    data = fastavro_bytes(name, record)
    assert same(NATIVE[name].decode(data, HEADER.size), fastavro_read(SCHEMAS[name].parsed, data, HEADER.size))


@PROPERTY
@given(st.data())
def test_corrupted_bytes_are_read_as_fastavro_reads_them_or_refused(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(NAMES))
    bad = fastavro_bytes(name, data.draw(RECORDS[name]))
    for _ in range(data.draw(st.integers(1, 3))):
        bad = corrupted(bad, data.draw)
    try:
        mine = NATIVE[name].decode(bad, HEADER.size)
    except treadle_native.Refused:
        return
    assert same(mine, fastavro_read(SCHEMAS[name].parsed, bad, HEADER.size))


def test_a_string_read_again_is_the_same_object_and_every_string_reads_back_as_written() -> None:
    """The reader hands out a string it read lately again (events repeat sessions, sources, names, attribute keys),
    so records share it; strings that took over each other's cache slots, long ones and map keys read back exactly."""
    schema = {
        "type": "record",
        "name": "S",
        "fields": [{"name": "a", "type": "string"}, {"name": "m", "type": {"type": "map", "values": "string"}}],
    }
    codec = treadle_native.RecordCodec(json.dumps(schema))
    written = [{"a": f"session-{i % 7}", "m": {f"k{i}": "x" * (i % 100), "scope": "step"}} for i in range(20_000)]
    read = [codec.decode(_fastavro(schema, record), 0)[0] for record in written]
    assert read == written  # 40,000 distinct strings through 4,096 slots: every one read back as it was written
    first, second = (codec.decode(_fastavro(schema, {"a": "judge", "m": {}}), 0)[0] for _ in range(2))
    assert first["a"] == "judge" and first["a"] is second["a"]


def _fastavro(schema: Any, record: Any) -> bytes:
    buf = io.BytesIO()
    schemaless_writer(buf, parse_schema(schema), record)
    return buf.getvalue()


def test_blocks_with_negative_counts_and_sizes_read_as_in_fastavro() -> None:
    schema, data, record = several_blocks()
    got = treadle_native.RecordCodec(json.dumps(schema)).decode(data, 0)
    assert got == fastavro_read(parse_schema(schema), data, 0)
    assert got[0] == record


@pytest.mark.parametrize("field_type, data", MALFORMED)
def test_bytes_it_does_not_vouch_for_are_refused(field_type: Any, data: bytes) -> None:
    schema = {"type": "record", "name": "R", "fields": [{"name": "f", "type": field_type}]}
    with pytest.raises(treadle_native.Refused):
        treadle_native.RecordCodec(json.dumps(schema)).decode(data, 0)


@pytest.mark.parametrize(
    "field_type",
    [
        ["null", "string", "long"],
        ["string", "long"],
        {"type": "long", "logicalType": "timestamp-millis"},
        {"type": "fixed", "name": "F", "size": 4},
        "Undefined",
    ],
)
def test_schemas_it_does_not_cover_are_refused_at_build_time(field_type: Any) -> None:
    schema = {"type": "record", "name": "R", "fields": [{"name": "f", "type": field_type}]}
    with pytest.raises(ValueError):
        treadle_native.RecordCodec(json.dumps(schema))
    assert native_codec.record_codec(schema) is None  # the codec then uses the generated Python one


def test_the_codec_uses_the_native_one_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "treadle.derived.Transition"
    record = sample(SCHEMAS[name].json, {})
    on = AvroCodec(SCHEMAS)
    assert on.native and native_codec.describe().startswith("native")
    monkeypatch.setenv(native_codec.ENV, "0")
    off = AvroCodec(SCHEMAS)
    assert not off.native and "TREADLE_NATIVE=0" in native_codec.describe()
    assert on.encode(name, record) == off.encode(name, record) == fastavro_bytes(name, record)
    assert same(on.decode(on.encode(name, record)), off.decode(off.encode(name, record)))
    # which writer each one compiled (private, but the point of the switch): a native method, a generated function
    assert type(on._writers[name]).__name__ == "builtin_function_or_method"
    assert type(off._writers[name]).__name__ == "function"
