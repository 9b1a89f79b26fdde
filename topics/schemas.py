"""The Avro contract loaded from avro/: parsed once, fingerprinted, and looked up by name or fingerprint.

Parsing is the expensive part of Avro in Python (fastavro #444: re-parsing per message costs up to
1000x), so a `SchemaSet` parses every schema exactly once and hands out the parsed form.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from fastavro import parse_schema
from fastavro.schema import fingerprint, load_schema, to_parsing_canonical_form

# The .avsc files travel as package data (topics/avro links the repository's avro/ folder into the package).
AVRO_DIR = Path(str(resources.files("topics") / "avro"))


def strip_logical_types(schema: Any) -> Any:
    """Drop logicalType annotations so decoded records keep plain ints and strings.

    Logical types are not part of the Parsing Canonical Form, so fingerprints and bytes on the wire
    are unchanged; only the Python representation differs (micros as int instead of datetime).
    """
    if isinstance(schema, list):
        return [strip_logical_types(s) for s in schema]
    if isinstance(schema, dict):
        return {k: strip_logical_types(v) for k, v in schema.items() if k != "logicalType"}
    return schema


def schema_fingerprint(schema: dict[str, Any]) -> int:
    """CRC-64-AVRO fingerprint of the schema's Parsing Canonical Form, as an unsigned int.

    fastavro's hex string is the fingerprint's little-endian bytes, so packing the int little-endian
    (as the single-object header does) reproduces exactly the bytes Java's BinaryMessageEncoder writes.
    """
    canonical = to_parsing_canonical_form(parse_schema(schema, _write_hint=False))
    return int.from_bytes(bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO")), "little")


@dataclass(frozen=True)
class AvroSchema:
    """One named schema: its JSON (with named types inlined), parsed form and fingerprint."""

    name: str
    json: dict[str, Any]
    parsed: Any
    fingerprint: int

    @classmethod
    def from_json(cls, schema: dict[str, Any]) -> AvroSchema:
        schema = strip_logical_types(schema)
        # Keep fastavro's write hint: without it, fastavro re-parses the schema on every call (fastavro #444).
        parsed = parse_schema(schema)
        return cls(name=parsed["name"], json=schema, parsed=parsed, fingerprint=schema_fingerprint(schema))

    @classmethod
    def from_file(cls, path: Path) -> AvroSchema:
        """An .avsc file; named types it references are loaded from `<full name>.avsc` beside it."""
        return cls.from_json(_expand_named(load_schema(str(path), _write_hint=False)))

    @property
    def doc(self) -> str:
        return str(self.json.get("doc", ""))


class SchemaSet:
    """Schemas by full name and by fingerprint."""

    def __init__(self, schemas: list[AvroSchema]) -> None:
        self._by_name = {s.name: s for s in schemas}
        self._by_fingerprint = {s.fingerprint: s for s in schemas}

    @classmethod
    def load(cls, directory: Path = AVRO_DIR) -> SchemaSet:
        """Load every `<namespace>.<Name>.avsc`; references between files are resolved by full name."""
        schemas = []
        for path in sorted(directory.glob("*.avsc")):
            schemas.append(AvroSchema.from_file(path))
        return cls(schemas)

    def __getitem__(self, name: str) -> AvroSchema:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no Avro schema named {name!r}; known: {sorted(self._by_name)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __iter__(self):
        return iter(self._by_name.values())

    def by_fingerprint(self, fp: int) -> AvroSchema | None:
        return self._by_fingerprint.get(fp)

    def add(self, schema: AvroSchema) -> None:
        """Learn a writer schema (e.g. a newer version from the registry) for decoding."""
        self._by_fingerprint[schema.fingerprint] = schema


def _expand_named(parsed: Any) -> dict[str, Any]:
    """fastavro's load_schema output with the internal hints removed, usable as a JSON schema."""
    text = json.dumps(parsed, default=str)
    data = json.loads(text)
    return _drop_private(data)


def _drop_private(node: Any) -> Any:
    if isinstance(node, list):
        return [_drop_private(n) for n in node]
    if isinstance(node, dict):
        return {k: _drop_private(v) for k, v in node.items() if not k.startswith("__")}
    return node
