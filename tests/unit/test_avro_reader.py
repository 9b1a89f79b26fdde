"""The generated Avro readers (topics/avro_reader.py) against fastavro, the reference: the same record for every
input they accept, and fastavro's own result (through the codec's fallback) for everything else.

Pure property tests over every schema in avro/ plus one schema with every Avro type, no broker.
"""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.test_avro_writer import (
    CODEC,
    NAMES,
    PROPERTY,
    RECORDS,
    SCHEMAS,
    any_record,
    fastavro_bytes,
    records,
    sample,
)
from topics.avro_reader import compile_reader
from topics.avro_writer import UnsupportedSchema
from topics.codec import HEADER, DeadLetterStage, DecodeError

READERS = {name: compile_reader(SCHEMAS[name].json) for name in NAMES}

EVERY_TYPE = {
    "type": "record",
    "name": "Every",
    "fields": [
        {"name": "n", "type": "null"},
        {"name": "b", "type": "boolean"},
        {"name": "i", "type": "int"},
        {"name": "l", "type": "long"},
        {"name": "f", "type": "float"},
        {"name": "d1", "type": "double"},
        {"name": "d2", "type": {"type": "double"}},
        {"name": "raw", "type": "bytes"},
        {"name": "s", "type": "string"},
        {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B", "C"]}},
        {"name": "x", "type": {"type": "fixed", "name": "X", "size": 3}},
        {"name": "inner", "type": {"type": "record", "name": "In", "fields": [{"name": "v", "type": "long"}]}},
        {"name": "again", "type": "In"},
        {"name": "e2", "type": "E"},
        {"name": "x2", "type": "X"},
        {"name": "u", "type": ["null", "string", "long", "In", {"type": "array", "items": "double"}]},
        {"name": "arr", "type": {"type": "array", "items": {"type": "map", "values": ["null", "In"]}}},
        {"name": "m", "type": {"type": "map", "values": "boolean"}},
    ],
}
EVERY_PARSED = parse_schema(EVERY_TYPE)
EVERY_READER = compile_reader(EVERY_TYPE)


def fastavro_read(schema: Any, data: bytes, pos: int) -> tuple[Any, int]:
    body = io.BytesIO(data)
    body.seek(pos)
    return schemaless_reader(body, schema, None), body.tell()


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types, dict keys in the same order, NaN equal to NaN: the reprs match."""
    return repr(a) == repr(b)


def outcome(decode: Any, data: bytes) -> tuple[str, Any]:
    try:
        return "ok", decode(data)
    except Exception as exc:
        return "raised", exc


def reason(error: DecodeError) -> tuple[DeadLetterStage, str]:
    """Stage and reason, without the addresses fastavro's messages may name (`<_io.BytesIO object at 0x...>`)."""
    return error.stage, re.sub(r" at 0x[0-9a-f]+", "", error.reason)


@pytest.mark.parametrize("name", NAMES)
def test_every_schema_gets_a_generated_reader(name: str) -> None:
    assert callable(READERS[name])


@PROPERTY
@given(any_record)
def test_generated_reader_returns_what_fastavro_returns(named_record: tuple[str, dict[str, Any]]) -> None:
    name, record = named_record
    data = fastavro_bytes(name, record)
    expected, end = fastavro_read(SCHEMAS[name].parsed, data, HEADER.size)
    got, got_end = READERS[name](data, HEADER.size)
    assert same(got, expected) and got_end == end == len(data)
    assert same(CODEC.decode(data), (name, expected))


@PROPERTY
@given(records(EVERY_TYPE, {}))
def test_every_avro_type_reads_as_fastavro_reads_it(record: dict[str, Any]) -> None:
    buf = io.BytesIO()
    schemaless_writer(buf, EVERY_PARSED, record)
    data = b"pad" + buf.getvalue()
    assert same(EVERY_READER(data, 3), fastavro_read(EVERY_PARSED, data, 3))


def corrupted(data: bytes, draw: Any) -> bytes:
    kind = draw(st.sampled_from(["flip", "truncate", "insert", "append"]))
    at = draw(st.integers(HEADER.size, max(HEADER.size, len(data) - 1)))
    byte = bytes([draw(st.integers(0, 255))])
    if kind == "flip":
        return data[:at] + byte + data[at + 1 :]
    if kind == "truncate":
        return data[:at]
    if kind == "insert":
        return data[:at] + byte + data[at:]
    return data + byte


@PROPERTY
@given(st.data())
def test_corrupted_bytes_are_read_as_fastavro_reads_them_or_left_to_it(data: st.DataObject) -> None:
    """Whatever the generated reader accepts, fastavro reads the same way; the codec's answer is always fastavro's
    (the same record, or a DecodeError of the same stage and reason)."""
    name = data.draw(st.sampled_from(NAMES))
    bad = fastavro_bytes(name, data.draw(RECORDS[name]))
    for _ in range(data.draw(st.integers(1, 3))):
        bad = corrupted(bad, data.draw)
    mine = outcome(lambda b: READERS[name](b, HEADER.size), bad)
    reference = outcome(lambda b: fastavro_read(SCHEMAS[name].parsed, b, HEADER.size), bad)
    if mine[0] == "ok":
        assert same(reference, mine)
    codec, plain = outcome(CODEC.decode, bad), outcome(_fastavro_decode, bad)
    assert codec[0] == plain[0]
    if codec[0] == "ok":
        assert same(codec, plain)
    else:
        assert reason(codec[1]) == reason(plain[1])


def _fastavro_decode(data: bytes) -> tuple[str, dict[str, Any]]:
    """AvroCodec.decode with fastavro only: what the codec answered before it had generated readers."""
    writer = CODEC.writer_schema(data)
    try:
        record, end = fastavro_read(writer.parsed, data, HEADER.size)
    except Exception as exc:
        raise DecodeError(DeadLetterStage.DECODE, f"body does not match writer schema {writer.name}: {exc!r}") from exc
    if end != len(data):
        raise DecodeError(DeadLetterStage.DECODE, f"{len(data) - end} trailing bytes after a {writer.name} record")
    return writer.name, record


def _long(value: int) -> bytes:
    buf = io.BytesIO()
    schemaless_writer(buf, "long", value)
    return buf.getvalue()


def several_blocks() -> tuple[dict[str, Any], bytes, dict[str, Any]]:
    """(schema, bytes, record) of an array and a map in several blocks, some with a negative count followed by the
    block's size in bytes: fastavro writes one block per array or map, other writers (Java) may not."""
    fields = [{"name": "a", "type": {"type": "array", "items": "long"}},
              {"name": "m", "type": {"type": "map", "values": "string"}}]  # fmt: skip
    schema = {"type": "record", "name": "B", "fields": fields}
    array = _long(2) + _long(1) + _long(2) + _long(-1) + _long(1) + _long(300) + _long(0)
    entry = _long(1) + b"k" + _long(1) + b"v"
    mapping = _long(-1) + _long(len(entry)) + entry + _long(1) + _long(1) + b"j" + _long(0) + _long(0)
    return schema, array + mapping, {"a": [1, 2, 300], "m": {"k": "v", "j": ""}}


def test_blocks_with_negative_counts_and_sizes_read_as_in_fastavro() -> None:
    schema, data, record = several_blocks()
    assert compile_reader(schema)(data, 0) == fastavro_read(parse_schema(schema), data, 0)
    assert compile_reader(schema)(data, 0)[0] == record


# (field type, bytes of the field) a reader must not vouch for; the native one also (it has no fixed)
MALFORMED: list[tuple[Any, bytes]] = [
    ("boolean", b"\x02"),  # neither 0 nor 1
    ({"type": "enum", "name": "E", "symbols": ["A"]}, _long(1)),  # no such symbol
    ({"type": "enum", "name": "E", "symbols": ["A"]}, _long(-1)),
    (["null", "long"], _long(2)),  # no such branch
    ("long", b"\xff" * 10 + b"\x01"),  # longer than 64 bits
    ("string", _long(-2)),  # negative length
    ("string", _long(5) + b"ab"),  # runs past the end
    ("string", _long(1) + b"\xff"),  # not UTF-8
    ("double", b"\x00" * 7),
]


@pytest.mark.parametrize("field_type, data", [*MALFORMED, ({"type": "fixed", "name": "F", "size": 4}, b"abc")])
def test_bytes_the_reader_does_not_vouch_for_raise(field_type: Any, data: bytes) -> None:
    schema = {"type": "record", "name": "R", "fields": [{"name": "f", "type": field_type}]}
    with pytest.raises(Exception):  # noqa: B017 (any exception: the codec then asks fastavro)
        compile_reader(schema)(data, 0)


@pytest.mark.parametrize("name", NAMES)
def test_the_codec_falls_back_to_fastavro_where_the_reader_refuses(name: str) -> None:
    """A truncated record: the reader refuses it, and the codec's dead-letter reason is fastavro's own."""
    record = sample(SCHEMAS[name].json, {})
    data = fastavro_bytes(name, record)
    assert same(CODEC.decode(data), (name, record))
    truncated = data[:-1]
    with pytest.raises(DecodeError) as codec:
        CODEC.decode(truncated)
    with pytest.raises(DecodeError) as plain:
        _fastavro_decode(truncated)
    assert reason(codec.value) == reason(plain.value)


def test_unsupported_schemas_are_refused_at_build_time() -> None:
    record_of = lambda t: {"type": "record", "name": "R", "fields": [{"name": "f", "type": t}]}  # noqa: E731
    with pytest.raises(UnsupportedSchema):
        compile_reader(record_of({"type": "long", "logicalType": "timestamp-millis"}))
    with pytest.raises(UnsupportedSchema):
        compile_reader("long")
