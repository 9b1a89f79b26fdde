"""treadle_native.NativeBlockWriter (native/src/columns.rs): Avro records -> one ClickHouse Native block.

That the blocks land in chDB as the Python mappers' rows is tests/integration/test_sink_avro.py; here: the bytes of a
small block, and what the writer refuses (a table it does not cover: ValueError, so the sink keeps Avro; bytes it does
not vouch for: Refused, so the sink decodes that batch in Python). These tests fail, not skip, where it is missing.
"""

from __future__ import annotations

import json
import struct

import pytest
import treadle_native
from hypothesis import given
from hypothesis import strategies as st

from topics.codec import HEADER, MAGIC

PREFIX = HEADER.pack(MAGIC, 1234)
SCHEMA = {
    "type": "record",
    "name": "t.Small",
    "fields": [
        {"name": "s", "type": "string"},
        {"name": "skipped", "type": {"type": "map", "values": "long"}},
        {"name": "n", "type": ["null", "long"]},
        {"name": "kind", "type": {"type": "enum", "name": "t.Kind", "symbols": ["A", "B"]}},
        {"name": "a", "type": {"type": "array", "items": {
            "type": "record", "name": "t.Item",
            "fields": [{"name": "x", "type": "double"}, {"name": "y", "type": "int"}],
        }}},
    ],
}  # fmt: skip
COLUMNS = [
    ("s", "LowCardinality(String)"),
    ("n", "Nullable(Int64)"),
    ("kind", "String"),
    ("a.x", "Array(Float64)"),
    ("a.y", "Array(UInt32)"),
]


def writer() -> treadle_native.NativeBlockWriter:
    return treadle_native.NativeBlockWriter(json.dumps(SCHEMA), COLUMNS, PREFIX)


def long(n: int) -> bytes:
    """Avro's zigzag varint."""
    z, out = (n << 1) ^ (n >> 63), bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    return bytes([*out, z])


def record(s: str | bytes, n: int | None, kind: int, items: list[tuple[float, int]], skipped: int = 0) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    body = long(len(raw)) + raw
    body += (long(1) + long(1) + b"k" + long(skipped) + long(0)) if skipped else long(0)  # a map of one entry
    body += long(0) if n is None else long(1) + long(n)
    body += long(kind)
    if items:
        body += long(len(items)) + b"".join(struct.pack("<d", x) + long(y) for x, y in items)
    return PREFIX + body + long(0)


def text(s: str) -> bytes:
    return bytes([len(s)]) + s.encode()


def test_a_block_is_native_format_column_by_column() -> None:
    block = writer().block([record("hi", None, 1, [(1.5, 3), (2.0, 4)]), record("", 5, 0, [], skipped=9)])
    expected = b"\x05\x02"  # columns, rows
    expected += text("s") + text("LowCardinality(String)") + struct.pack("<QQQ", 1, 0x600, 2)  # version, flags, keys
    expected += text("") + text("hi") + struct.pack("<Q", 2) + bytes([1, 0])  # the default first; an index per row
    expected += text("n") + text("Nullable(Int64)") + b"\x01\x00" + struct.pack("<qq", 0, 5)
    expected += text("kind") + text("String") + text("B") + text("A")
    expected += text("a.x") + text("Array(Float64)") + struct.pack("<QQ", 2, 2) + struct.pack("<dd", 1.5, 2.0)
    expected += text("a.y") + text("Array(UInt32)") + struct.pack("<QQ", 2, 2) + struct.pack("<II", 3, 4)
    assert block == expected


@pytest.mark.parametrize(
    "value",
    [
        record("x", 1, 0, [])[:-1],  # truncated
        record("x", 1, 0, []) + b"\x00",  # trailing bytes
        HEADER.pack(MAGIC, 99) + record("x", 1, 0, [])[HEADER.size :],  # another schema's header
        record("x", 1, 5, []),  # no such enum symbol
        record(b"\xff\xfe", 1, 0, []),  # not UTF-8
        record("x", 1, 0, [(1.0, -1)]),  # a negative int in a UInt32 column
        record("x", 1, 0, [(1.0, 2**31)]),  # an "int" out of its range
    ],
)
def test_bytes_it_does_not_vouch_for_are_refused(value: bytes) -> None:
    good = record("fine", None, 0, [])
    with pytest.raises(treadle_native.Refused):
        writer().block([good, value])


@given(st.binary(max_size=40))
def test_any_bytes_give_a_block_or_refused(tail: bytes) -> None:
    try:
        writer().block([PREFIX + tail])
    except treadle_native.Refused:
        pass


@pytest.mark.parametrize(
    ("columns", "reason"),
    [
        ([*COLUMNS, ("missing", "String")], "no field feeds column missing"),
        ([("s", "Int64")], "field s does not fit"),
        ([("n", "Int64")], "field n does not fit"),  # a nullable field into a column without NULL
        ([("s", "Map(String, String)")], "not covered"),
        ([("a.x", "Float64")], "does not fit"),
    ],
)
def test_a_table_it_does_not_cover_is_a_value_error(columns: list[tuple[str, str]], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        treadle_native.NativeBlockWriter(json.dumps(SCHEMA), columns, PREFIX)
