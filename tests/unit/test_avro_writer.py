"""The generated Avro writers (topics/avro_writer.py) against fastavro, the reference: the same bytes, or fastavro's
own result for anything the generated writer does not take.

Pure property tests over every schema in avro/, no broker.
"""

from __future__ import annotations

import copy
import io
from collections import OrderedDict, defaultdict
from enum import StrEnum
from typing import Any

import pytest
from fastavro import schemaless_writer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topics.avro_writer import RecordWriter, UnsupportedSchema, compile_writer, zigzag_long
from topics.codec import HEADER, MAGIC, AvroCodec
from topics.schemas import SchemaSet

SCHEMAS = SchemaSet.load()
CODEC = AvroCodec(SCHEMAS)
NAMES = sorted(s.name for s in SCHEMAS)
INPUT_NAMES = [n for n in NAMES if n.startswith("treadle.events.")]
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

LONG_EDGES = [0, 1, -1, 63, -64, 64, -65, 127, 128, 8191, -8192, 2**31 - 1, -(2**31), 2**62, 2**63 - 1, -(2**63)]
LONGS = st.one_of(st.sampled_from(LONG_EDGES), st.integers(-(2**63), 2**63 - 1))
INTS = st.one_of(st.sampled_from([0, 1, -1, 63, -64, 64, 2**31 - 1, -(2**31)]), st.integers(-(2**31), 2**31 - 1))
# any Unicode except lone surrogates, short or past the 1024-byte length table (2-byte length prefixes)
TEXT = st.one_of(
    st.text(max_size=12),
    st.builds(lambda ch, n: ch * n, st.characters(exclude_categories=("Cs",)), st.integers(20, 1500)),
)
BLOBS = st.one_of(st.binary(max_size=12), st.binary(min_size=1020, max_size=1100))
PRIMITIVES: dict[str, st.SearchStrategy[Any]] = {
    "null": st.none(),
    "boolean": st.booleans(),
    "int": INTS,
    "long": LONGS,
    "float": st.floats(width=32),  # NaN and infinities included
    "double": st.floats(),
    "bytes": BLOBS,
    "string": TEXT,
}


def records(schema: Any, named: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Exactly typed values of an Avro schema (JSON form; named types are defined before they are referenced)."""
    if isinstance(schema, str):
        return PRIMITIVES[schema] if schema in PRIMITIVES else records(named[schema], named)
    if isinstance(schema, list):
        return st.one_of([records(branch, named) for branch in schema])
    kind = schema["type"]
    if isinstance(kind, dict | list):
        return records(kind, named)
    if kind in PRIMITIVES:
        return PRIMITIVES[kind]
    if kind in ("record", "enum", "fixed"):
        named[schema["name"]] = schema
    if kind == "record":
        return st.fixed_dictionaries({f["name"]: records(f["type"], named) for f in schema["fields"]})
    if kind == "enum":
        return st.sampled_from(schema["symbols"])
    if kind == "array":
        return st.lists(records(schema["items"], named), max_size=4)
    if kind == "map":
        return st.dictionaries(st.text(max_size=8), records(schema["values"], named), max_size=4)
    if kind == "fixed":
        return st.binary(min_size=schema["size"], max_size=schema["size"])
    raise AssertionError(f"no strategy for {schema!r}")


RECORDS = {name: records(SCHEMAS[name].json, {}) for name in NAMES}
any_record = st.sampled_from(NAMES).flatmap(lambda n: st.tuples(st.just(n), RECORDS[n]))


def fastavro_bytes(name: str, record: Any) -> bytes:
    schema = SCHEMAS[name]
    buf = io.BytesIO()
    buf.write(HEADER.pack(MAGIC, schema.fingerprint))
    schemaless_writer(buf, schema.parsed, record)
    return buf.getvalue()


def generated_writers() -> dict[str, RecordWriter]:
    out = {}
    for name in NAMES:
        try:
            out[name] = compile_writer(SCHEMAS[name].json, HEADER.pack(MAGIC, SCHEMAS[name].fingerprint))
        except UnsupportedSchema:
            pass
    return out


WRITERS = generated_writers()


@pytest.mark.parametrize("name", INPUT_NAMES)
def test_every_input_schema_gets_a_generated_writer(name: str) -> None:
    assert name in WRITERS, "the SDK's hot path would fall back to fastavro for this schema"


def test_state_versions_get_a_generated_writer() -> None:
    """The state processor publishes one per applied event; null-or-record unions (NodeInterval) are generated."""
    assert "treadle.derived.StateVersion" in WRITERS


@PROPERTY
@given(any_record)
def test_generated_writer_is_byte_identical_to_fastavro(named_record: tuple[str, dict[str, Any]]) -> None:
    name, record = named_record
    expected = fastavro_bytes(name, record)
    if name in WRITERS:  # schemas it cannot generate code for (e.g. a logical type) use fastavro
        assert WRITERS[name](record) == expected  # called directly: it must take every exactly typed record
    assert CODEC.encode(name, record) == expected


class Kind(StrEnum):
    OK = "OK"
    LLM = "LLM"


class Weird(int):
    pass


ODD_VALUES: list[Any] = [
    True, False, 0, 1, -1, 2**63, -(2**63) - 1, 2**70, 1.5, float("nan"), "x", "OK", "LLM", Kind.OK, Kind.LLM, b"x",
    bytearray(b"x"), None, (), [], ["x"], ("x",), {}, {"k": "v"}, {"k": 1}, ("string", "x"), ("null", None),
    Weird(5), OrderedDict(k="v"), defaultdict(str), 10**20 * 1.0, "\ud800",
]  # fmt: skip
MISSING = object()


def paths(record: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every dict key and list index reachable in a record, as paths."""
    out: list[tuple[Any, ...]] = []
    if isinstance(record, dict):
        for key, value in record.items():
            out += [(*prefix, key), *paths(value, (*prefix, key))]
    elif isinstance(record, list):
        for i, value in enumerate(record):
            out += [(*prefix, i), *paths(value, (*prefix, i))]
    return out


def replaced(record: Any, path: tuple[Any, ...], value: Any) -> Any:
    changed = copy.deepcopy(record)
    target = changed
    for step in path[:-1]:
        target = target[step]
    if value is MISSING:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return changed


def outcome(encode: Any, name: str, record: Any) -> tuple[str, Any]:
    try:
        return "bytes", encode(name, record)
    except Exception as exc:
        return "error", type(exc)


def sample(schema: Any, named: dict[str, Any]) -> Any:
    """One plain valid value with every optional part present (non-null branches, one item per array and map)."""
    if isinstance(schema, list):
        return sample(next((b for b in schema if b != "null"), "null"), named)
    if isinstance(schema, str):
        plain = {"null": None, "boolean": True, "int": 7, "long": 7, "float": 0.5, "double": 0.5, "bytes": b"b"}
        return plain.get(schema, "s") if schema in PRIMITIVES else sample(named[schema], named)
    kind = schema["type"]
    if isinstance(kind, dict | list) or kind in PRIMITIVES:
        return sample(kind, named)
    if kind in ("record", "enum", "fixed"):
        named[schema["name"]] = schema
    if kind == "record":
        return {f["name"]: sample(f["type"], named) for f in schema["fields"]}
    if kind == "enum":
        return schema["symbols"][-1]
    if kind == "fixed":
        return b"f" * schema["size"]
    if kind == "array":
        return [sample(schema["items"], named)]
    return {"k": sample(schema["values"], named)}


@pytest.mark.parametrize("name", NAMES)
def test_odd_values_get_fastavros_result(name: str) -> None:
    """Every field, at every depth, set to a wrong type, a bool for a long, an int for a double, a tuple, a subclass,
    or left out (fastavro then writes its default): the codec writes what fastavro writes or raises what it raises.
    The generated writer must never guess."""
    record = sample(SCHEMAS[name].json, {})
    assert CODEC.encode(name, record) == fastavro_bytes(name, record)
    for path in paths(record):
        for value in [*ODD_VALUES, MISSING] if isinstance(path[-1], str) else ODD_VALUES:
            odd = replaced(record, path, value)
            assert outcome(CODEC.encode, name, odd) == outcome(fastavro_bytes, name, odd), (path, value)


@pytest.mark.parametrize("value", [*LONG_EDGES, 2**40 + 12345, -(2**40) - 12345, 1_760_000_000_000_000])
def test_zigzag_varints_match_fastavro(value: int) -> None:
    buf = io.BytesIO()
    schemaless_writer(buf, "long", value)
    assert zigzag_long(value) == buf.getvalue()


def test_unsupported_schemas_are_refused_at_build_time() -> None:
    record_of = lambda t: {"type": "record", "name": "R", "fields": [{"name": "f", "type": t}]}  # noqa: E731
    for field_type in (
        ["null", "string", "long"],
        ["string", {"type": "record", "name": "S", "fields": []}],
        {"type": "long", "logicalType": "timestamp-millis"},
    ):
        with pytest.raises(UnsupportedSchema):
            compile_writer(record_of(field_type))
