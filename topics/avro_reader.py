"""A per-schema Avro binary reader, generated once from the schema: the decoding twin of topics/avro_writer.py.

fastavro's schemaless_reader walks the schema for every record (a type dispatch per field, a BytesIO read per
value): 7-9 us per input event here, the largest single cost of the sink's loop (~20% of its Python time) and ~10%
of a worker's. The reader built here is straight-line Python over the bytes, with the field order, enum symbols and
union branches precomputed: 4.9-5.2 us against fastavro's 7.6-7.9 per event of the weaving bench's input mix
(20,000 events of bench/workload.py, decoded in a loop on an idle core).

It accepts only well-formed Avro and returns exactly what fastavro returns for it (tests/test_avro_reader.py
compares both on generated records and on corrupted bytes). Anything else (a truncated value, a varint longer than
64 bits, an enum or union index out of range, a boolean byte other than 0 or 1, bad UTF-8) raises, and the codec
then reads the record with fastavro, which decodes it as it always has or raises its own error: leniency and error
messages stay fastavro's. Only a writer schema read as itself gets a reader; schema resolution stays fastavro's.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from topics.avro_codegen import SchemaCompiler, UnsupportedSchema, indent, primitive_kind

__all__ = ["RecordReader", "compile_reader"]

# (data, position of the record) -> (record, position after it)
RecordReader = Callable[[bytes, int], tuple[dict[str, Any], int]]


class _Reject(Exception):
    """Bytes this reader does not vouch for: the caller reads them with fastavro."""


def _varint_rest(data: bytes, pos: int, first: int) -> tuple[int, int]:
    """The rest of a varint whose first byte (`first`, continuation bit set) was read; at most 10 bytes (64 bits)."""
    n, shift = first & 0x7F, 7
    while True:
        byte = data[pos]
        pos += 1
        n |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if n >> 64:
                raise _Reject  # fastavro's 64-bit read would wrap; let it decide
            return n, pos
        shift += 7
        if shift > 63:
            raise _Reject


def _span(data: bytes, pos: int) -> tuple[int, int]:
    """(start, end) of the string or bytes whose length varint starts at `pos`."""
    n, pos = data[pos], pos + 1
    if n & 0x80:
        n, pos = _varint_rest(data, pos, n)
    n = (n >> 1) ^ -(n & 1)
    if n < 0:
        raise _Reject
    return pos, pos + n


def compile_reader(schema: Any) -> RecordReader:
    """A function (data, pos) -> (record, end) for the Avro binary of `schema` at data[pos:]."""
    return _Compiler().build(schema)


Code = list[str]  # statements that leave the value in the variable they were given


class _Compiler(SchemaCompiler[Code]):
    """Generates straight-line code over `b` (the bytes) and `p` (the position).

    Records are inlined where they are defined; each also gets a function for references by name.
    """

    def __init__(self) -> None:
        super().__init__({"_Reject": _Reject, "_rest": _varint_rest, "_span": _span})

    def build(self, schema: Any) -> RecordReader:
        if not isinstance(schema, dict) or schema.get("type") != "record":
            raise UnsupportedSchema("only record schemas get a reader")
        out = self.var("r")
        stmts = self.value(schema, out, "")
        # A string or bytes value running past the end is sliced short without an error; p then lies past the end.
        body = [
            "def read(b, p):",
            *indent(stmts),
            "    if p > len(b):",
            "        raise _Reject",
            f"    return {out}, p",
        ]
        return self.finish(body, f"avro reader {schema['name']}")

    def record(self, schema: dict[str, Any], out: str, namespace: str) -> Code:
        """Fields into locals, in order, then one dict display (fastavro's key order: the schema's)."""
        full = self.define(schema, namespace)
        self.names[full] = func = self.var("_r")
        inner = full.rpartition(".")[0]
        stmts: list[str] = []
        items: list[str] = []
        doubles: list[str] = []  # adjacent double fields: one struct.unpack_from for all of them
        for field in schema["fields"]:
            var = self.var("f")
            items.append(f"{field['name']!r}: {var}")
            if primitive_kind(field["type"]) == "double":
                doubles.append(var)
                continue
            stmts += self._unpack_doubles(doubles)
            stmts += self.value(field["type"], var, inner)
        stmts += self._unpack_doubles(doubles)
        stmts.append(f"{out} = {{{', '.join(items)}}}")
        self.functions += [f"def {func}(b, p):", *indent(stmts), f"    return {out}, p", ""]
        return stmts

    def _unpack_doubles(self, doubles: list[str]) -> Code:
        if not doubles:
            return []
        layout = "<" + "d" * len(doubles)
        unpack = f"_unpack_{len(doubles)}d"
        self.env.setdefault(unpack, struct.Struct(layout).unpack_from)
        targets = ", ".join(doubles) + ("," if len(doubles) == 1 else "")
        stmts = [f"{targets} = {unpack}(b, p)", f"p += {8 * len(doubles)}"]
        doubles.clear()
        return stmts

    def record_ref(self, name: str, out: str) -> Code:
        return [f"{out}, p = {self.names[name]}(b, p)"]

    @staticmethod
    def _long(out: str) -> Code:
        """A zig-zag varint into `out`: one byte inline, longer ones through _rest."""
        return [
            f"{out} = b[p]",
            "p += 1",
            f"if {out} & 0x80:",
            f"    {out}, p = _rest(b, p, {out})",
            f"{out} = ({out} >> 1) ^ -({out} & 1)",
        ]

    def primitive(self, kind: str, out: str) -> Code:
        if kind == "null":
            return [f"{out} = None"]
        if kind == "boolean":
            return [f"{out} = b[p]", "p += 1", f"if {out} > 1:", "    raise _Reject", f"{out} = {out} == 1"]
        if kind in ("int", "long"):
            return self._long(out)
        if kind == "double":
            return self._unpack_doubles([out])
        if kind == "float":
            self.env.setdefault("_unpack_f", struct.Struct("<f").unpack_from)
            return [f"{out}, = _unpack_f(b, p)", "p += 4"]
        start = self.var("s")
        value = f"b[{start}:p]" if kind == "bytes" else f"b[{start}:p].decode()"
        return [  # a length below 64 is one even byte; _span reads any other
            f"{out} = b[p]",
            f"if {out} & 0x81:",
            f"    {start}, p = _span(b, p)",
            "else:",
            f"    {start} = p + 1",
            f"    p = {start} + ({out} >> 1)",
            f"{out} = {value}",
        ]

    def enum(self, schema: dict[str, Any], out: str) -> Code:
        symbols = self.var("_S")
        self.env[symbols] = tuple(schema["symbols"])
        return [
            *self._long(out),
            f"if not 0 <= {out} < {len(schema['symbols'])}:",
            "    raise _Reject",
            f"{out} = {symbols}[{out}]",
        ]

    def fixed(self, schema: dict[str, Any], out: str) -> Code:
        size = int(schema["size"])
        return [f"{out} = b[p:p + {size}]", f"p += {size}"]

    def union(self, branches: list[Any], out: str, namespace: str) -> Code:
        index = self.var("u")
        stmts = self._long(index)
        for i, branch in enumerate(branches):
            stmts += [f"{'elif' if i else 'if'} {index} == {i}:", *indent(self.value(branch, out, namespace))]
        return [*stmts, "else:", "    raise _Reject"]

    def blocks(self, schema: dict[str, Any], out: str, namespace: str) -> Code:
        """Blocks of items until a zero count; a negative count is followed by the block's size in bytes."""
        count, size, item = self.var("c"), self.var("z"), self.var("i")
        if schema["type"] == "array":
            start, read, add = f"{out} = []", self.value(schema["items"], item, namespace), f"{out}.append({item})"
        else:
            key = self.var("k")
            read = self.primitive("string", key) + self.value(schema["values"], item, namespace)
            start, add = f"{out} = {{}}", f"{out}[{key}] = {item}"
        return [
            start,
            "while True:",
            *indent(self._long(count)),
            f"    if not {count}:",
            "        break",
            f"    if {count} < 0:",
            f"        {count} = -{count}",
            *indent(self._long(size), 8),
            f"    for _ in range({count}):",
            *indent(read, 8),
            f"        {add}",
        ]
