"""Avro schema-resolution check: can a reader schema read data written with a writer schema?

BACKWARD compatibility (the default) means the new schema, as reader, can read everything written
with the previous one. The rules are the Avro specification's "Schema Resolution" section; each
violation is reported with the field path so the message tells the author what to fix.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

_PROMOTIONS = {
    "int": {"long", "float", "double"},
    "long": {"float", "double"},
    "float": {"double"},
    "string": {"bytes"},
    "bytes": {"string"},
}
_PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}


class Compatibility(StrEnum):
    BACKWARD = "BACKWARD"
    FORWARD = "FORWARD"
    FULL = "FULL"
    NONE = "NONE"


def compatibility_errors(new: dict[str, Any], old: dict[str, Any], mode: Compatibility) -> list[str]:
    """Reasons `new` may not replace `old` under `mode`; empty when it may."""
    errors: list[str] = []
    if mode in (Compatibility.BACKWARD, Compatibility.FULL):
        errors += [f"new schema cannot read old data: {e}" for e in read_errors(new, old)]
    if mode in (Compatibility.FORWARD, Compatibility.FULL):
        errors += [f"old schema cannot read new data: {e}" for e in read_errors(old, new)]
    return errors


def read_errors(reader: Any, writer: Any) -> list[str]:
    """Reasons data written with `writer` cannot be read with `reader`."""
    return _Resolver().check(reader, writer, path="")


class _Resolver:
    def __init__(self) -> None:
        self._named_reader: dict[str, Any] = {}
        self._named_writer: dict[str, Any] = {}
        self._seen: set[tuple[str, str]] = set()

    def check(self, reader: Any, writer: Any, path: str) -> list[str]:
        reader = self._deref(reader, self._named_reader)
        writer = self._deref(writer, self._named_writer)
        if isinstance(writer, list):
            # Every branch the writer may have used must be readable.
            errors: list[str] = []
            for branch in writer:
                errors += self.check(reader, branch, path)
            return errors
        if isinstance(reader, list):
            for branch in reader:
                if not self.check(branch, writer, path):
                    return []
            return [f"{path or '<root>'}: writer type {_type_name(writer)} matches no branch of the reader union"]
        r_type, w_type = _type_name(reader), _type_name(writer)
        if r_type in _PRIMITIVES or w_type in _PRIMITIVES:
            if r_type == w_type or r_type in _PROMOTIONS.get(w_type, set()):
                return []
            return [f"{path or '<root>'}: type changed from {w_type} to {r_type}"]
        if r_type != w_type:
            return [f"{path or '<root>'}: type changed from {w_type} to {r_type}"]
        if r_type == "record":
            return self._record(reader, writer, path)
        if r_type == "enum":
            missing = [s for s in writer["symbols"] if s not in reader["symbols"]]
            if missing and "default" not in reader:
                return [f"{path or '<root>'}: enum symbols {missing} removed and the reader enum has no default"]
            return []
        if r_type == "array":
            return self.check(reader["items"], writer["items"], f"{path}[]")
        if r_type == "map":
            return self.check(reader["values"], writer["values"], f"{path}{{}}")
        if r_type == "fixed":
            if reader.get("size") != writer.get("size"):
                return [f"{path or '<root>'}: fixed size changed from {writer.get('size')} to {reader.get('size')}"]
            return []
        return [f"{path or '<root>'}: unsupported type {r_type}"]

    def _record(self, reader: dict[str, Any], writer: dict[str, Any], path: str) -> list[str]:
        key = (reader["name"], writer["name"])
        if key in self._seen:  # recursive types: already being checked higher up
            return []
        self._seen.add(key)
        if _short(reader["name"]) != _short(writer["name"]) and writer["name"] not in reader.get("aliases", []):
            return [f"{path or '<root>'}: record renamed from {writer['name']} to {reader['name']} without an alias"]
        writer_fields = {f["name"]: f for f in writer["fields"]}
        errors: list[str] = []
        for field in reader["fields"]:
            names = [field["name"], *field.get("aliases", [])]
            match = next((writer_fields[n] for n in names if n in writer_fields), None)
            field_path = f"{path}.{field['name']}" if path else field["name"]
            if match is None:
                if "default" not in field:
                    errors.append(f"{field_path}: field added without a default")
                continue
            errors += self.check(field["type"], match["type"], field_path)
        return errors

    def _deref(self, schema: Any, named: dict[str, Any]) -> Any:
        if isinstance(schema, str):
            if schema in _PRIMITIVES:
                return schema
            return named.get(schema, schema)
        if isinstance(schema, dict):
            if schema.get("type") in ("record", "enum", "fixed") and "name" in schema:
                named[schema["name"]] = schema
                named.setdefault(_short(schema["name"]), schema)
            if schema.get("type") in _PRIMITIVES:
                return schema["type"]
        return schema


def _type_name(schema: Any) -> str:
    if isinstance(schema, str):
        return schema
    if isinstance(schema, dict):
        t = schema.get("type")
        return t if isinstance(t, str) else "union"
    return "union"


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]
