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


LC_SCHEMA = {
    "type": "record",
    "name": "t.Keys",
    "fields": [
        {"name": "k", "type": ["null", "string"]},
        {"name": "ks", "type": {"type": "array", "items": "string"}},
    ],
}
LC_COLUMNS = [("k", "LowCardinality(Nullable(String))"), ("ks", "Array(LowCardinality(String))")]


def lc_body(values: list[str | None], nullable: bool) -> bytes:
    """ClickHouse's LowCardinality body for `values`, the reference the writer's dictionary is held to: keys in
    order of first appearance after the default string (after a null placeholder when nullable), then an index per
    value, as narrow as the key count allows."""
    if not values:
        return b""
    keys: list[bytes] = [b"", b""] if nullable else [b""]
    default, at, indexes = len(keys) - 1, {}, []
    for value in values:
        if value is None:
            indexes.append(0)
        elif value == "":
            indexes.append(default)
        else:
            raw = value.encode()
            if raw not in at:
                at[raw] = len(keys)
                keys.append(raw)
            indexes.append(at[raw])
    width, kind = (1, 0) if len(keys) <= 0x100 else (2, 1) if len(keys) <= 0x10000 else (4, 2)
    body = struct.pack("<QQ", kind | 0x600, len(keys)) + b"".join(varuint(len(k)) + k for k in keys)
    return body + struct.pack("<Q", len(values)) + b"".join(i.to_bytes(width, "little") for i in indexes)


def varuint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    return bytes([*out, n])


def keys_record(k: str | None, ks: list[str]) -> bytes:
    body = long(0) if k is None else long(1) + long(len(k.encode())) + k.encode()
    if ks:
        body += long(len(ks)) + b"".join(long(len(s.encode())) + s.encode() for s in ks)
    return PREFIX + body + long(0)


# Few distinct values (so they repeat, as LowCardinality columns' do), some empty, some not ASCII; or many.
_keys = st.sampled_from(["", "a", "tool", "é", "名前", "x" * 200, "ok\x00"]) | st.text(max_size=12)


@given(st.lists(st.tuples(st.none() | _keys, st.lists(_keys, max_size=4)), max_size=30))
def test_low_cardinality_keys_in_order_of_first_appearance(rows: list[tuple[str | None, list[str]]]) -> None:
    block = treadle_native.NativeBlockWriter(json.dumps(LC_SCHEMA), LC_COLUMNS, PREFIX).block(
        [keys_record(k, ks) for k, ks in rows]
    )
    items = [s for _, ks in rows for s in ks]
    offsets, total = b"", 0
    for _, ks in rows:
        total += len(ks)
        offsets += struct.pack("<Q", total)
    expected = varuint(2) + varuint(len(rows))
    expected += text("k") + text("LowCardinality(Nullable(String))") + struct.pack("<Q", 1)
    expected += lc_body([k for k, _ in rows], nullable=True)
    expected += text("ks") + text("Array(LowCardinality(String))") + struct.pack("<Q", 1) + offsets
    expected += lc_body(items, nullable=False)
    assert block == expected


def test_a_low_cardinality_column_of_many_keys_has_wider_indexes() -> None:
    rows = [(f"k{i}", [f"v{i % 300}", ""]) for i in range(70_000)]
    block = treadle_native.NativeBlockWriter(json.dumps(LC_SCHEMA), LC_COLUMNS, PREFIX).block(
        [keys_record(k, ks) for k, ks in rows]
    )
    assert lc_body([k for k, _ in rows], nullable=True) in block  # 70,002 keys: 4-byte indexes
    assert lc_body([s for _, ks in rows for s in ks], nullable=False) in block  # 301 keys: 2-byte indexes


def test_a_low_cardinality_value_that_is_not_utf8_is_refused_after_valid_ones() -> None:
    good = keys_record("same", ["same"])
    bad = PREFIX + long(1) + long(2) + b"\xc3\x28" + long(0)
    with pytest.raises(treadle_native.Refused):
        treadle_native.NativeBlockWriter(json.dumps(LC_SCHEMA), LC_COLUMNS, PREFIX).block([good, good, bad])


def test_a_block_still_held_is_not_written_over_by_the_next() -> None:
    w = writer()
    first = w.block([record("hi", 1, 0, [(1.0, 2)])])
    kept = bytes(first)
    second = w.block([record("other", None, 1, [])])
    assert first == kept
    assert second == writer().block([record("other", None, 1, [])])
    del first, second  # nothing holds them: the writer reuses its buffer
    assert w.block([record("hi", 1, 0, [(1.0, 2)])]) == kept
