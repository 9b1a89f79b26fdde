"""A per-schema Avro binary writer, generated once from the schema, for the SDK's hot path.

fastavro's schemaless_writer walks the schema for every record (type lookups, union validation,
default handling): 9-14 us per input event here, the largest cost the SDK added per event. The
writer built here is straight-line Python with the field order, enum indexes and union branch
bytes precomputed (callgrind: 31-42k instructions per input event against fastavro's ~87k), and
byte-identical to fastavro for every record it accepts (tests/test_avro_writer.py). The generated
source stays in `writer.__globals__["__source__"]` for reading.

It accepts only the plain, exactly typed values the SDK builds (dicts, lists, str, int within
64 bits, float, bytes, None for nullable unions). Anything else (a missing field left to its
default, an int for a double, a tuple for an array, a bool for a long, an unknown enum symbol)
raises, and the codec then encodes the record with fastavro, which either writes it as it always
has or raises its own error: leniency and error messages stay fastavro's. Schemas using features
this writer does not cover (logical types, unions other than null + one primitive) get no writer.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from topics.avro_codegen import SchemaCompiler, UnsupportedSchema, indent, primitive_kind

__all__ = ["RecordWriter", "UnsupportedSchema", "compile_writer", "zigzag_long"]

RecordWriter = Callable[[Any], bytes]

_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1
_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1


class _Mismatch(Exception):
    """A value outside the writer's exact types: the caller falls back to fastavro."""


def _make_varint() -> Callable[[int], bytes]:
    """`varint(n)` for an unsigned n < 2**64: a ladder of thresholds, each rung one unrolled bytes((...)) call.

    Cheaper than a loop for the 8-byte timestamps every event carries.
    """
    lines = ["def varint(n):"]
    for size in range(1, 11):
        groups = [f"n >> {7 * i} & 0x7F | 0x80" for i in range(size - 1)] + [f"n >> {7 * (size - 1)}"]
        lines += [f"    if n < {1 << (7 * size)}:", f"        return bytes(({', '.join(groups)},))"]
    lines.append("    raise OverflowError(n)")
    env: dict[str, Any] = {}
    exec("\n".join(lines), env)
    return env["varint"]


_varint = _make_varint()
_SMALL = [bytes((n,)) for n in range(0x80)]  # one-byte varints, by zig-zagged value


class _Lengths(dict[int, bytes]):
    """Length prefixes of strings and bytes: the common ones precomputed, others computed on demand (not kept)."""

    def __missing__(self, n: int) -> bytes:
        return zigzag_long(n)


_LEN = _Lengths((n, _varint(2 * n)) for n in range(1024))


_high: tuple[int, bytes] = (-1, b"")  # the last n >> 28 written by _wide_varint, and its varint


def _wide_varint(n: int) -> bytes:
    """varint(n) for n >= 2**28: four continued bytes of the low 28 bits, then varint(n >> 28) from a one-entry
    cache. The high bits of an event time change every couple of minutes; this halves the cost of writing one."""
    global _high
    high = n >> 28
    cached = _high
    if cached[0] != high:
        cached = _high = (high, _varint(high))  # one tuple: threads never see a value with another's bytes
    low = n & 0xFFFFFFF
    return bytes((low & 0x7F | 0x80, low >> 7 & 0x7F | 0x80, low >> 14 & 0x7F | 0x80, low >> 21 | 0x80)) + cached[1]


def zigzag_long(value: int) -> bytes:
    """An Avro int/long: zig-zag, then base-128 varint, little end first (as fastavro's 64-bit write_long)."""
    if type(value) is not int or not _LONG_MIN <= value <= _LONG_MAX:
        raise _Mismatch
    n = (value << 1) ^ (value >> 63)
    return _SMALL[n] if n < 0x80 else _varint(n) if n < 1 << 28 else _wide_varint(n)


def compile_writer(schema: Any, prefix: bytes = b"") -> RecordWriter:
    """A function record -> prefix + Avro binary of the record; UnsupportedSchema if it cannot be generated."""
    return _Compiler().build(schema, prefix)


Code = tuple[list[str], list[str]]  # (statements, expressions of the byte strings they produce, in order)


class _Compiler(SchemaCompiler[Code]):
    """Generates straight-line code that gathers a record's byte strings and joins them once.

    Records are inlined where they are defined; each also gets a function returning its bytes, for
    references by name and array items. Checks that would let a value reach fastavro's leniency
    (wrong type, out of range) raise _Mismatch.
    """

    def __init__(self) -> None:
        super().__init__(
            {
                "_Mismatch": _Mismatch,
                "_long": zigzag_long,
                "_varint": _varint,
                "_wide_varint": _wide_varint,
                "_SMALL": _SMALL,
                "_LEN": _LEN,
                "_pack_d": struct.Struct("<d").pack,
                "_pack_f": struct.Struct("<f").pack,
            }
        )

    def build(self, schema: Any, prefix: bytes) -> RecordWriter:
        if not isinstance(schema, dict) or schema.get("type") != "record":
            raise UnsupportedSchema("only record schemas get a writer")
        self.env["_PREFIX"] = bytes(prefix)
        stmts, parts = self.record(schema, "r", "")
        body = ["def write(r):", *indent(stmts), f"    return b''.join((_PREFIX, {', '.join(parts)}))"]
        return self.finish(body, f"avro writer {schema['name']}")

    def record(self, schema: dict[str, Any], value: str, namespace: str) -> Code:
        """A record defined here: its fields inline, plus a function `_wN(r) -> bytes` for later references."""
        full = self.define(schema, namespace)
        self.names[full] = func = self.var("_w")
        stmts = [f"if type({value}) is not dict:", "    raise _Mismatch"]  # fastavro fills defaults etc.
        parts: list[str] = []
        floats: list[tuple[str, str]] = []  # adjacent float/double fields: one struct.pack call for all of them
        for field in schema["fields"]:
            kind = primitive_kind(field["type"])
            item = f"{value}[{field['name']!r}]"
            if kind != "string":  # a string is read once, other values more often
                stmts.append(f"{(item := self.var('v'))} = {value}[{field['name']!r}]")
            if kind in ("double", "float"):
                stmts += [f"if type({item}) is not float:", "    raise _Mismatch"]
                floats.append(("d" if kind == "double" else "f", item))
                continue
            parts += self._pack(floats)
            more, produced = self.value(field["type"], item, full.rpartition(".")[0])
            stmts += more
            parts += produced
        parts += self._pack(floats)
        joined = f"b''.join(({', '.join(parts)},))" if parts else "b''"
        self.functions += [f"def {func}({value}):", *indent(stmts), f"    return {joined}", ""]
        return stmts, parts

    def _pack(self, floats: list[tuple[str, str]]) -> list[str]:
        """One struct.pack for the pending float/double values (little-endian IEEE 754, as fastavro); empties them."""
        if not floats:
            return []
        layout = "<" + "".join(code for code, _ in floats)
        pack = self.env.setdefault(f"_pack_{layout[1:]}", struct.Struct(layout).pack)
        call = f"_pack_{layout[1:]}({', '.join(item for _, item in floats)})"
        assert pack is not None
        floats.clear()
        return [call]

    def blocks(self, schema: dict[str, Any], value: str, namespace: str) -> Code:
        """An array or map as fastavro writes it: one block of all items (if any), then a zero count."""
        out, item = self.var("a"), self.var("i")
        if schema["type"] == "array":
            more, parts = self.value(schema["items"], item, namespace)
            loop = [f"for {item} in {value}:"]
        else:
            key = self.var("k")
            key_stmts, key_parts = self._string(key)
            more, parts = self.value(schema["values"], item, namespace)
            more, parts = key_stmts + more, key_parts + parts
            loop = [f"for {key}, {item} in {value}.items():"]
        stmts = [
            f"if type({value}) is not {'list' if schema['type'] == 'array' else 'dict'}:",
            "    raise _Mismatch",
            f"if {value}:",
            f"    {out} = [_long(len({value}))]",
            f"    {loop[0]}",
            *indent(more, 8),
            f"        {out} += ({', '.join(parts)},)" if parts else "        pass",
            f"    {out}.append(b'\\x00')",
            f"    {out} = b''.join({out})",
            "else:",
            f"    {out} = b'\\x00'",
        ]
        return stmts, [out]

    def record_ref(self, name: str, value: str) -> Code:
        return [], [f"{self.names[name]}({value})"]

    def primitive(self, kind: str, value: str) -> Code:
        if kind == "null":
            return [], []  # fastavro writes nothing for a null, whatever the value
        if kind == "boolean":
            return [], [f"(b'\\x01' if {value} else b'\\x00')"]  # truthiness, as fastavro's C bint
        if kind in ("int", "long"):  # fastavro writes both as a 64-bit varint, without an int32 range check
            zz = self.var("z")
            return [
                f"if type({value}) is not int or not {_LONG_MIN} <= {value} <= {_LONG_MAX}:",
                "    raise _Mismatch",
                f"{zz} = ({value} << 1) ^ ({value} >> 63)",
            ], [f"(_SMALL[{zz}] if {zz} < 128 else _varint({zz}) if {zz} < 268435456 else _wide_varint({zz}))"]
        if kind in ("double", "float"):
            pack = "_pack_d" if kind == "double" else "_pack_f"
            return [f"if type({value}) is not float:", "    raise _Mismatch"], [f"{pack}({value})"]
        if kind == "bytes":
            return [f"if type({value}) is not bytes:", "    raise _Mismatch"], [self._length(value), value]
        return self._string(value)

    def _string(self, value: str) -> Code:
        # str.encode() as fastavro does: a non-str raises (fastavro: TypeError), lone surrogates raise
        raw = self.var("b")
        return [f"{raw} = {value}.encode()"], [self._length(raw), raw]

    @staticmethod
    def _length(raw: str) -> str:
        return f"_LEN[len({raw})]"

    def enum(self, schema: dict[str, Any], value: str) -> Code:
        table = self.var("_E")
        self.env[table] = {symbol: zigzag_long(i) for i, symbol in enumerate(schema["symbols"])}
        # a plain str only: list.index (fastavro) and a dict lookup agree on those; anything else goes to fastavro
        return [f"if type({value}) is not str:", "    raise _Mismatch"], [f"{table}[{value}]"]

    def fixed(self, schema: dict[str, Any], value: str) -> Code:
        return [f"if type({value}) is not bytes or len({value}) != {int(schema['size'])}:", "    raise _Mismatch"], [
            value
        ]

    def union(self, branches: list[Any], value: str, namespace: str = "") -> Code:
        """null + at most one primitive: the branch is the one fastavro's validation picks for these exact types.

        Also null + one record (a dict; a dict the record does not take raises _Mismatch, and fastavro decides).
        """
        if len(branches) == 2 and "null" in branches and self._is_record(branches[1 - branches.index("null")]):
            null, record = branches.index("null"), 1 - branches.index("null")
            out = self.var("u")
            more, parts = self.value(branches[record], value, namespace)
            return [
                f"if {value} is None:",
                f"    {out} = {zigzag_long(null)!r}",
                f"elif type({value}) is dict:",
                *indent(more),
                f"    {out} = b''.join(({zigzag_long(record)!r}, {', '.join(parts)}))",
                "else:",
                "    raise _Mismatch",
            ], [out]
        kinds = [primitive_kind(b) for b in branches]
        if len(branches) > 2 or None in kinds or len(set(kinds)) != len(kinds):
            raise UnsupportedSchema(f"union {branches!r}: only null + one primitive type get a writer")
        out = self.var("u")
        stmts: list[str] = []
        for index, kind in enumerate(kinds):
            test = {
                "null": f"{value} is None",
                "boolean": f"type({value}) is bool",
                "int": f"type({value}) is int and {_INT_MIN} <= {value} <= {_INT_MAX}",
                "long": f"type({value}) is int and {_LONG_MIN} <= {value} <= {_LONG_MAX}",
                "float": f"type({value}) is float",
                "double": f"type({value}) is float",
                "bytes": f"type({value}) is bytes",
                "string": f"type({value}) is str",
            }[str(kind)]
            more, parts = self.primitive(str(kind), value)
            stmts += [f"{'elif' if index else 'if'} {test}:", *indent(more)]
            stmts.append(f"    {out} = b''.join(({zigzag_long(index)!r}, {', '.join(parts)}))" if parts else
                         f"    {out} = {zigzag_long(index)!r}")  # fmt: skip
        return [*stmts, "else:", "    raise _Mismatch"], [out]

    def _is_record(self, schema: Any) -> bool:
        if isinstance(schema, str):
            return self.named.get(schema, {}).get("type") == "record"
        return isinstance(schema, dict) and schema.get("type") == "record"
