"""Pure logic of the contract: the Avro codec, schema compatibility, the registry's versions, tool schemas.

No broker here: these are unit and property tests (hypothesis) of topics/codec.py, topics/compatibility.py,
topics/registry.py (SchemaVersions) and topics/tool_schemas.py.
"""

from __future__ import annotations

import copy
import io
import json
import struct
from pathlib import Path
from typing import Any

import pytest
from fastavro import schemaless_writer
from fastavro.schema import parse_schema, to_parsing_canonical_form
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from jsonschema.exceptions import SchemaError

from topics.codec import HEADER, MAGIC, AvroCodec, DeadLetterStage, DecodeError
from topics.compatibility import Compatibility, compatibility_errors, read_errors
from topics.registry import IncompatibleSchemaError, RegisteredSchema, SchemaVersions
from topics.schemas import AvroSchema, SchemaSet
from topics.tool_schemas import InvalidParamsError, ToolSchemas

SCHEMAS = SchemaSet.load()
CODEC = AvroCodec(SCHEMAS)
NAMES = sorted(s.name for s in SCHEMAS)
INPUT_NAMES = [n for n in NAMES if n.startswith("treadle.events.") and n != "treadle.events.Envelope"]
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- records of any Avro schema, for round trips -------------------------------------------------------

_PRIMITIVES = {
    "null": st.none(),
    "boolean": st.booleans(),
    "int": st.integers(-(2**31), 2**31 - 1),
    "long": st.integers(-(2**63), 2**63 - 1),
    "float": st.floats(width=32, allow_nan=False),
    "double": st.floats(allow_nan=False),
    "bytes": st.binary(max_size=16),
    "string": st.text(max_size=16),
}


def records(schema: Any, named: dict[str, Any] | None = None) -> st.SearchStrategy[Any]:
    """Values that conform to an Avro schema (JSON form, named types defined before they are referenced)."""
    named = {} if named is None else named
    if isinstance(schema, str):
        if schema in _PRIMITIVES:
            return _PRIMITIVES[schema]
        return records(named[schema], named)
    if isinstance(schema, list):
        return st.one_of([records(branch, named) for branch in schema])
    kind = schema["type"]
    if isinstance(kind, dict | list):
        return records(kind, named)
    if kind in _PRIMITIVES:
        return _PRIMITIVES[kind]
    if kind in ("record", "enum", "fixed"):
        named[schema["name"]] = schema
        named.setdefault(schema["name"].rsplit(".", 1)[-1], schema)
    if kind == "record":
        return st.fixed_dictionaries({f["name"]: records(f["type"], named) for f in schema["fields"]})
    if kind == "enum":
        return st.sampled_from(schema["symbols"])
    if kind == "array":
        return st.lists(records(schema["items"], named), max_size=3)
    if kind == "map":
        return st.dictionaries(st.text(max_size=8), records(schema["values"], named), max_size=3)
    if kind == "fixed":
        return st.binary(min_size=schema["size"], max_size=schema["size"])
    raise AssertionError(f"no strategy for {schema!r}")


RECORDS = {name: records(SCHEMAS[name].json) for name in NAMES}
any_record = st.sampled_from(NAMES).flatmap(lambda n: st.tuples(st.just(n), RECORDS[n]))


def decode_or_decode_error(data: bytes) -> tuple[str, dict[str, Any]] | DecodeError:
    """decode's contract: a record, or DecodeError with a stage and a reason; never anything else."""
    try:
        return CODEC.decode(data)
    except DecodeError as exc:
        assert isinstance(exc.stage, DeadLetterStage) and exc.reason
        return exc


# -- the codec -----------------------------------------------------------------------------------------


@PROPERTY
@given(any_record)
def test_every_record_round_trips(named_record: tuple[str, dict[str, Any]]) -> None:
    name, record = named_record
    data = CODEC.encode(name, record)
    assert CODEC.decode(data) == (name, record)
    assert CODEC.decode(data, expect=name) == (name, record)


@PROPERTY
@given(any_record)
def test_wire_format_is_marker_fingerprint_then_plain_avro_binary(named_record: tuple[str, dict[str, Any]]) -> None:
    name, record = named_record
    data = CODEC.encode(name, record)
    schema = SCHEMAS[name]
    assert data[:2] == b"\xc3\x01"
    assert data[2:10] == struct.pack("<Q", schema.fingerprint)
    body = io.BytesIO()
    schemaless_writer(body, schema.parsed, record)
    assert data[10:] == body.getvalue()


def test_crc64_avro_reference_matches_the_spec_test_vector() -> None:
    """Avro's own test data: the fingerprint of the schema "null" is 7195948357588979594."""
    assert crc64_avro(b'"null"') == 7195948357588979594


@pytest.mark.parametrize("name", INPUT_NAMES)
def test_fingerprint_header_interoperates_with_other_avro_libraries(name: str) -> None:
    """Single-object encoding per the Avro spec: the 8-byte little-endian CRC-64-AVRO of the canonical form."""
    schema = SCHEMAS[name]
    canonical = to_parsing_canonical_form(parse_schema(schema.json, _write_hint=False))
    assert schema.fingerprint == crc64_avro(canonical.encode())


def crc64_avro(data: bytes) -> int:
    """The Avro specification's reference fingerprint, written out independently of fastavro."""
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for byte in data:
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    return fp


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_garbage_bytes_raise_decode_error_only(data: bytes) -> None:
    result = decode_or_decode_error(data)
    if not data.startswith(MAGIC) or len(data) < HEADER.size:
        assert isinstance(result, DecodeError) and result.stage is DeadLetterStage.DECODE


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(NAMES), st.binary(max_size=120))
def test_known_header_with_garbage_body_raises_decode_error_only(name: str, body: bytes) -> None:
    data = HEADER.pack(MAGIC, SCHEMAS[name].fingerprint) + body
    result = decode_or_decode_error(data)
    if isinstance(result, DecodeError):
        assert result.stage is DeadLetterStage.DECODE
        assert name in result.reason


@PROPERTY
@given(any_record, st.data())
def test_corrupted_records_raise_decode_error_only(
    named_record: tuple[str, dict[str, Any]], data: st.DataObject
) -> None:
    name, record = named_record
    encoded = bytearray(CODEC.encode(name, record))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(encoded) - 1))
        encoded[at] = data.draw(st.integers(0, 255))
    decode_or_decode_error(bytes(encoded))


@PROPERTY
@given(any_record, st.data())
def test_truncated_records_raise_decode_error_only(
    named_record: tuple[str, dict[str, Any]], data: st.DataObject
) -> None:
    name, record = named_record
    encoded = CODEC.encode(name, record)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    decode_or_decode_error(encoded[:cut])


@PROPERTY
@given(any_record, st.binary(min_size=1, max_size=8))
def test_trailing_bytes_are_refused(named_record: tuple[str, dict[str, Any]], extra: bytes) -> None:
    name, record = named_record
    with pytest.raises(DecodeError, match="trailing") as caught:
        CODEC.decode(CODEC.encode(name, record) + extra)
    assert caught.value.stage is DeadLetterStage.DECODE


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc3", b"\xc3\x01", b"\xc3\x01\x00\x00", b"{}", b"\x00\x01" + bytes(8) + b"x", b"\xc3\x02" + bytes(8)],
)
def test_not_single_object_encoding(data: bytes) -> None:
    with pytest.raises(DecodeError, match="single-object") as caught:
        CODEC.decode(data)
    assert caught.value.stage is DeadLetterStage.DECODE


def test_a_null_value_is_a_decode_error() -> None:
    with pytest.raises(DecodeError):
        CODEC.decode(None)  # type: ignore[arg-type]


def test_unknown_fingerprint_is_a_schema_error() -> None:
    with pytest.raises(DecodeError, match="unknown writer schema fingerprint 0000000000000007") as caught:
        CODEC.decode(HEADER.pack(MAGIC, 7) + b"\x00")
    assert caught.value.stage is DeadLetterStage.SCHEMA


def test_expecting_another_record_is_a_schema_error() -> None:
    data = CODEC.encode("treadle.events.LifecycleEvent", lifecycle_record())
    with pytest.raises(DecodeError, match=r"expected a treadle\.events\.ToolResult") as caught:
        CODEC.decode(data, expect="treadle.events.ToolResult")
    assert caught.value.stage is DeadLetterStage.SCHEMA


def test_encoding_an_invalid_record_raises_before_any_bytes() -> None:
    record = lifecycle_record()
    record["kind"] = "NOT_A_PHASE"
    with pytest.raises(ValueError):
        CODEC.encode("treadle.events.LifecycleEvent", record)
    with pytest.raises(KeyError, match="no Avro schema named"):
        CODEC.encode("treadle.events.Nope", record)


def lifecycle_record() -> dict[str, Any]:
    return {
        "envelope": {
            "event_id": "01890000-0000-7000-8000-000000000000",
            "session_id": "s",
            "agent_id": "a",
            "episode_id": "e",
            "logical_event_id": "l",
            "seq": 0,
            "event_time": 1,
            "policy_version": "",
            "trace_id": "",
            "attributes": {},
        },
        "kind": "SESSION_CREATED",
        "done": False,
        "truncated": False,
        "reason": None,
        "reward": None,
        "steps": None,
    }


def evolved(name: str, extra_field: dict[str, Any]) -> AvroSchema:
    schema = copy.deepcopy(SCHEMAS[name].json)
    schema["fields"].append(extra_field)
    return AvroSchema.from_json(schema)


def test_new_reader_fills_defaults_for_data_written_with_the_old_schema() -> None:
    """A v2 consumer reads v1 bytes: it learns the writer schema from the registry lookup and resolves."""
    name = "treadle.events.LifecycleEvent"
    v1 = SCHEMAS[name]
    v2 = evolved(name, {"name": "note", "type": "string", "default": "n/a"})
    assert not compatibility_errors(v2.json, v1.json, Compatibility.BACKWARD)
    old_bytes = AvroCodec(SchemaSet([v1])).encode(name, lifecycle_record())
    looked_up: list[int] = []

    def lookup(fp: int) -> AvroSchema | None:
        looked_up.append(fp)
        return v1 if fp == v1.fingerprint else None

    new_codec = AvroCodec(SchemaSet([v2]), lookup=lookup)
    assert new_codec.decode(old_bytes, expect=name) == (name, {**lifecycle_record(), "note": "n/a"})
    new_codec.decode(old_bytes, expect=name)
    assert looked_up == [v1.fingerprint]  # learned once, then cached


def test_old_reader_ignores_a_field_added_by_a_newer_writer() -> None:
    name = "treadle.events.LifecycleEvent"
    v2 = evolved(name, {"name": "note", "type": "string", "default": "n/a"})
    new_bytes = AvroCodec(SchemaSet([v2])).encode(name, {**lifecycle_record(), "note": "hello"})
    with pytest.raises(DecodeError) as caught:
        CODEC.decode(new_bytes)  # no lookup: the v2 fingerprint is unknown
    assert caught.value.stage is DeadLetterStage.SCHEMA
    old_codec = AvroCodec(SchemaSet.load(), lookup=lambda fp: v2 if fp == v2.fingerprint else None)
    assert old_codec.decode(new_bytes, expect=name) == (name, lifecycle_record())


# -- compatibility -------------------------------------------------------------------------------------

FIELD_NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True)

# (type, a valid default for it)
TYPED_DEFAULTS: list[tuple[Any, Any]] = [
    ("int", 0),
    ("long", 7),
    ("float", 1.5),
    ("double", -2.0),
    ("boolean", True),
    ("string", "x"),
    ("bytes", ""),
    (["null", "string"], None),
    (["null", "long"], None),
    ({"type": "array", "items": "string"}, []),
    ({"type": "map", "values": "long"}, {}),
]
typed_default = st.sampled_from(TYPED_DEFAULTS)


@st.composite
def record_schemas(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(FIELD_NAMES, min_size=1, max_size=6, unique=True))
    fields = []
    for n in names:
        kind, default = draw(typed_default)
        field: dict[str, Any] = {"name": n, "type": copy.deepcopy(kind)}
        if draw(st.booleans()):
            field["default"] = copy.deepcopy(default)
        fields.append(field)
    if draw(st.booleans()):
        fields.append({"name": "mood", "type": {"type": "enum", "name": "Mood", "symbols": ["A", "B", "C"]}})
    return {"type": "record", "name": "test.R", "fields": fields}


@PROPERTY
@given(record_schemas())
def test_a_schema_is_fully_compatible_with_itself(schema: dict[str, Any]) -> None:
    assert compatibility_errors(schema, copy.deepcopy(schema), Compatibility.FULL) == []


@pytest.mark.parametrize("name", NAMES)
def test_every_shipped_schema_is_fully_compatible_with_itself(name: str) -> None:
    assert compatibility_errors(SCHEMAS[name].json, SCHEMAS[name].json, Compatibility.FULL) == []


@PROPERTY
@given(record_schemas(), FIELD_NAMES, typed_default)
def test_adding_a_field_with_a_default_is_fully_compatible(
    old: dict[str, Any], name: str, kind_default: tuple[Any, Any]
) -> None:
    assume(name not in {f["name"] for f in old["fields"]})
    kind, default = kind_default
    new = copy.deepcopy(old)
    new["fields"].append({"name": name, "type": kind, "default": default})
    assert compatibility_errors(new, old, Compatibility.BACKWARD) == []
    assert compatibility_errors(new, old, Compatibility.FULL) == []


@PROPERTY
@given(record_schemas(), FIELD_NAMES, typed_default)
def test_adding_a_field_without_a_default_is_refused_naming_it(
    old: dict[str, Any], name: str, kind_default: tuple[Any, Any]
) -> None:
    assume(name not in {f["name"] for f in old["fields"]})
    new = copy.deepcopy(old)
    new["fields"].append({"name": name, "type": kind_default[0]})
    errors = compatibility_errors(new, old, Compatibility.BACKWARD)
    assert len(errors) == 1 and errors[0].startswith("new schema cannot read old data")
    assert f"{name}: field added without a default" in errors[0]
    assert compatibility_errors(new, old, Compatibility.FORWARD) == []  # old readers just skip it


PROMOTABLE = {
    ("int", "long"),
    ("int", "float"),
    ("int", "double"),
    ("long", "float"),
    ("long", "double"),
    ("float", "double"),
    ("string", "bytes"),
    ("bytes", "string"),
}
PRIMITIVE_NAMES = ["boolean", "int", "long", "float", "double", "bytes", "string"]


@PROPERTY
@given(record_schemas(), st.data())
def test_changing_a_field_type_is_refused_naming_the_field(old: dict[str, Any], data: st.DataObject) -> None:
    old = copy.deepcopy(old)
    index = data.draw(st.integers(0, len(old["fields"]) - 1))
    before, after = data.draw(st.sampled_from(PRIMITIVE_NAMES)), data.draw(st.sampled_from(PRIMITIVE_NAMES))
    assume(before != after and (before, after) not in PROMOTABLE)
    old["fields"][index]["type"] = before
    old["fields"][index].pop("default", None)
    new = copy.deepcopy(old)
    new["fields"][index]["type"] = after
    field = old["fields"][index]["name"]
    errors = compatibility_errors(new, old, Compatibility.BACKWARD)
    assert errors == [f"new schema cannot read old data: {field}: type changed from {before} to {after}"]


@pytest.mark.parametrize(("before", "after"), sorted(PROMOTABLE))
def test_promotions_are_backward_compatible(before: str, after: str) -> None:
    old = {"type": "record", "name": "R", "fields": [{"name": "x", "type": before}]}
    new = {"type": "record", "name": "R", "fields": [{"name": "x", "type": after}]}
    assert compatibility_errors(new, old, Compatibility.BACKWARD) == []
    narrowing = compatibility_errors(new, old, Compatibility.FORWARD)
    assert (narrowing == []) == ((after, before) in PROMOTABLE)


@PROPERTY
@given(st.lists(st.sampled_from("ABCDEFGH"), min_size=2, max_size=8, unique=True), st.data())
def test_removing_an_enum_symbol_is_refused_naming_field_and_symbol(symbols: list[str], data: st.DataObject) -> None:
    removed = data.draw(st.sampled_from(symbols))
    enum = {"type": "enum", "name": "K", "symbols": symbols}
    old = {"type": "record", "name": "R", "fields": [{"name": "kind", "type": enum}]}
    new = copy.deepcopy(old)
    new["fields"][0]["type"]["symbols"] = [s for s in symbols if s != removed]
    (error,) = compatibility_errors(new, old, Compatibility.BACKWARD)
    assert error.startswith("new schema cannot read old data: kind:") and repr(removed) in error
    # adding a symbol is the mirror image: fine for new readers, refused for old ones
    assert compatibility_errors(old, new, Compatibility.BACKWARD) == []
    assert len(compatibility_errors(old, new, Compatibility.FORWARD)) == 1
    # a reader-side enum default makes removal safe (Avro spec: unknown symbols resolve to the default)
    new["fields"][0]["type"]["default"] = new["fields"][0]["type"]["symbols"][0]
    assert compatibility_errors(new, old, Compatibility.BACKWARD) == []


def test_removing_a_field_breaks_only_old_readers_without_a_default() -> None:
    old = {"type": "record", "name": "R", "fields": [{"name": "a", "type": "long"}, {"name": "b", "type": "string"}]}
    new = {"type": "record", "name": "R", "fields": [{"name": "a", "type": "long"}]}
    assert compatibility_errors(new, old, Compatibility.BACKWARD) == []
    (error,) = compatibility_errors(new, old, Compatibility.FORWARD)
    assert error.startswith("old schema cannot read new data: b:")
    old["fields"][1]["default"] = ""
    assert compatibility_errors(new, old, Compatibility.FULL) == []


def test_nested_changes_report_the_field_path() -> None:
    def schema(kind: str) -> dict[str, Any]:
        inner = {"type": "record", "name": "Inner", "fields": [{"name": "score", "type": kind}]}
        return {
            "type": "record",
            "name": "Outer",
            "fields": [
                {"name": "inner", "type": inner},
                {"name": "items", "type": {"type": "array", "items": "Inner"}},
                {"name": "by_key", "type": {"type": "map", "values": "string"}},
            ],
        }

    errors = read_errors(schema("string"), schema("double"))
    assert errors == ["inner.score: type changed from double to string"]


def test_unions_may_widen_but_not_narrow() -> None:
    old = {"type": "record", "name": "R", "fields": [{"name": "v", "type": ["null", "string"]}]}
    new = {"type": "record", "name": "R", "fields": [{"name": "v", "type": ["null", "string", "long"]}]}
    assert compatibility_errors(new, old, Compatibility.BACKWARD) == []
    (error,) = compatibility_errors(old, new, Compatibility.BACKWARD)
    assert "v: writer type long matches no branch of the reader union" in error
    plain = {"type": "record", "name": "R", "fields": [{"name": "v", "type": "string"}]}
    assert compatibility_errors(old, plain, Compatibility.BACKWARD) == []  # a non-union writer fits a branch


def test_renamed_record_needs_an_alias() -> None:
    old = {"type": "record", "name": "a.Old", "fields": []}
    new = {"type": "record", "name": "a.New", "fields": []}
    (error,) = read_errors(new, old)
    assert "renamed from a.Old to a.New" in error
    assert read_errors({**new, "aliases": ["a.Old"]}, old) == []


def test_mode_none_accepts_anything() -> None:
    old = {"type": "record", "name": "R", "fields": [{"name": "a", "type": "long"}]}
    new = {"type": "record", "name": "R", "fields": [{"name": "a", "type": "boolean"}]}
    assert compatibility_errors(new, old, Compatibility.NONE) == []


# -- the registry's versions (the part without Kafka) ----------------------------------------------------


def subject_v(version_fields: list[dict[str, Any]]) -> AvroSchema:
    return AvroSchema.from_json({"type": "record", "name": "t.Subject", "fields": version_fields})


V1 = [{"name": "a", "type": "long"}]
V2 = [*V1, {"name": "b", "type": "string", "default": ""}]


def test_versions_number_from_one_and_skip_known_schemas() -> None:
    versions = SchemaVersions()
    first = versions.next_version(subject_v(V1))
    assert first is not None and (first.subject, first.version) == ("t.Subject", 1)
    versions.add(first)
    assert versions.next_version(subject_v(V1)) is None  # same fingerprint: nothing to publish
    second = versions.next_version(subject_v(V2))
    assert second is not None and second.version == 2
    versions.add(second)
    versions.add(second)  # idempotent
    assert [r.version for r in versions.versions("t.Subject")] == [1, 2]
    assert versions.latest("t.Subject") == second
    assert versions.lookup(first.schema.fingerprint) == first.schema
    assert versions.lookup(12345) is None
    assert versions.subjects() == ["t.Subject"]
    assert versions.latest("unknown") is None and versions.versions("unknown") == []


def test_an_incompatible_version_is_refused_with_the_reasons() -> None:
    versions = SchemaVersions()
    versions.add(RegisteredSchema("t.Subject", 1, subject_v(V1)))
    bad = subject_v([{"name": "a", "type": "string"}, {"name": "c", "type": "long"}])
    with pytest.raises(IncompatibleSchemaError) as caught:
        versions.next_version(bad)
    assert caught.value.subject == "t.Subject" and caught.value.mode is Compatibility.BACKWARD
    assert any("a: type changed from long to string" in r for r in caught.value.reasons)
    assert any("c: field added without a default" in r for r in caught.value.reasons)
    assert "c: field added without a default" in str(caught.value)
    lenient = SchemaVersions(Compatibility.NONE)
    lenient.add(RegisteredSchema("t.Subject", 1, subject_v(V1)))
    accepted = lenient.next_version(bad)
    assert accepted is not None and accepted.version == 2


def test_a_writer_the_shipped_schema_cannot_read_is_refused_though_backward_compatible() -> None:
    """A new ToolStatus symbol is BACKWARD compatible (the new schema reads old data), but the worker reads every
    ToolResult as the shipped schema, which has no such symbol: each event would be a dead letter."""
    name = "treadle.events.ToolResult"
    shipped = SCHEMAS[name]
    more_symbols = copy.deepcopy(shipped.json)
    [status] = [f for f in more_symbols["fields"] if f["name"] == "status"]
    status["type"]["symbols"].append("CANCELLED")
    newer = AvroSchema.from_json(more_symbols)
    assert not compatibility_errors(newer.json, shipped.json, Compatibility.BACKWARD)
    versions = SchemaVersions(readers=SchemaSet.load())
    versions.add(RegisteredSchema(name, 1, shipped))
    with pytest.raises(IncompatibleSchemaError) as caught:
        versions.next_version(newer)
    reasons = caught.value.reasons
    assert reasons and all(r.startswith(f"treadle's own {name} cannot read it") for r in reasons)
    assert "CANCELLED" in str(caught.value)
    added = evolved(name, {"name": "rubric", "type": ["null", "string"], "default": None})
    accepted = versions.next_version(added)  # a field with a default: the shipped schema skips it
    assert accepted is not None and accepted.version == 2


def test_versions_are_ordered_whatever_the_order_they_are_loaded_in() -> None:
    versions = SchemaVersions()
    versions.add(RegisteredSchema("t.Subject", 2, subject_v(V2)))
    versions.add(RegisteredSchema("t.Subject", 1, subject_v(V1)))
    assert [r.version for r in versions.versions("t.Subject")] == [1, 2]
    latest = versions.latest("t.Subject")
    assert latest is not None and latest.version == 2


@pytest.mark.parametrize("name", NAMES)
def test_registered_schema_round_trips_through_its_topic_bytes(name: str) -> None:
    registered = RegisteredSchema(name, 3, SCHEMAS[name])
    back = RegisteredSchema.from_bytes(registered.to_bytes())
    assert (back.subject, back.version, back.schema.fingerprint) == (name, 3, SCHEMAS[name].fingerprint)
    assert json.loads(registered.to_bytes())["fingerprint"] == f"{SCHEMAS[name].fingerprint:016x}"


# -- tool schemas -----------------------------------------------------------------------------------------

SEARCH = {
    "type": "object",
    "properties": {"q": {"type": "string", "minLength": 1}, "limit": {"type": "integer", "minimum": 1}},
    "required": ["q"],
    "additionalProperties": False,
}
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@PROPERTY
@given(st.dictionaries(st.sampled_from(["q", "limit", "other"]), json_values, max_size=3))
def test_tool_params_are_valid_exactly_when_they_match_the_schema(params: dict[str, Any]) -> None:
    tools = ToolSchemas({"search": SEARCH})
    q, limit = params.get("q"), params.get("limit", 1)
    valid = (
        isinstance(q, str)
        and len(q) >= 1
        and isinstance(limit, int)
        and not isinstance(limit, bool)
        and limit >= 1
        and "other" not in params
    )
    problem = tools.error("search", params)
    assert (problem is None) == valid, (params, problem)
    if valid:
        tools.validate("search", params)
    else:
        assert problem is not None and problem.startswith("params of search invalid at ")
        with pytest.raises(InvalidParamsError):
            tools.validate("search", params)
    assert tools.error_in_json("search", json.dumps(params)) == problem


def test_tool_schema_error_names_the_path() -> None:
    tools = ToolSchemas({"search": SEARCH})
    assert tools.error("search", {"q": "x", "limit": 0}) == (
        "params of search invalid at limit: 0 is less than the minimum of 1"
    )
    assert "<root>" in (tools.error("search", {}) or "")


@pytest.mark.parametrize("params", [[], "q", 3, None])
def test_params_must_be_an_object_even_without_a_schema(params: Any) -> None:
    tools = ToolSchemas()
    assert "must be a JSON object" in (tools.error("anything", params) or "")
    with pytest.raises(InvalidParamsError):
        tools.validate("anything", params)


def test_unknown_tools_accept_any_object_and_membership_is_by_name() -> None:
    tools = ToolSchemas({"search": SEARCH})
    assert "search" in tools and "other" not in tools
    assert tools.error("other", {"anything": [1, 2]}) is None
    assert issubclass(InvalidParamsError, ValueError)


def test_bad_json_params_and_bad_schemas() -> None:
    tools = ToolSchemas({"search": SEARCH})
    assert (tools.error_in_json("search", "{not json") or "").startswith("params of search are not valid JSON")
    with pytest.raises(SchemaError):
        ToolSchemas({"broken": {"type": "no-such-type"}})


def test_tool_schemas_load_from_a_file(tmp_path: Path) -> None:
    assert "search" not in ToolSchemas.load(None)
    path = tmp_path / "tools.json"
    path.write_text(json.dumps({"search": SEARCH}))
    assert "search" in ToolSchemas.load(path)
    path.write_text("{oops")
    with pytest.raises(ValueError, match="cannot read tool schemas"):
        ToolSchemas.load(path)
    with pytest.raises(ValueError, match="cannot read tool schemas"):
        ToolSchemas.load(tmp_path / "missing.json")
