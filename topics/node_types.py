"""Node-type JSON Schemas: each state-graph node type declares the shape of its data.

They live on their own compacted topic (`_<prefix>.node_types`, keys `node/<type>/<hash>`), read from the
beginning like the schema registry's, so they need no extra service. A new version of a type
must accept every node the previous version accepted (BACKWARD, as for Avro): nodes already in the log must
stay valid. A breaking change is refused with the reasons and a unified diff of the two schemas.

Usage: `treadle node-types register <type> <schema.json>` / `treadle node-types list` (treadle/cli.py), or
`NodeTypeRegistry.register`.
"""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer
from jsonschema import Draft202012Validator

from topics.compacted import read_to_end
from topics.tool_schemas import first_problem

_KEY_PREFIX = b"node/"
_NUMERIC_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_NUMERIC_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")


class IncompatibleNodeTypeError(Exception):
    """A node-type schema change that would make existing nodes invalid; `reasons` and `diff` say how."""

    def __init__(self, node_type: str, reasons: list[str], diff: str) -> None:
        self.node_type, self.reasons, self.diff = node_type, reasons, diff
        super().__init__(f"node type {node_type!r}: breaking change refused: " + "; ".join(reasons) + "\n" + diff)


def schema_diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    """A unified diff of the two schemas, pretty-printed with sorted keys."""
    a = json.dumps(old, indent=2, sort_keys=True).splitlines()
    b = json.dumps(new, indent=2, sort_keys=True).splitlines()
    return "\n".join(difflib.unified_diff(a, b, "registered", "proposed", lineterm=""))


def _types(schema: dict[str, Any]) -> set[str] | None:
    t = schema.get("type")
    if t is None:
        return None
    types = {t} if isinstance(t, str) else set(t)
    if "number" in types:
        types.add("integer")
    return types


def breaking_changes(old: dict[str, Any], new: dict[str, Any], path: str = "") -> list[str]:
    """Why data valid under `old` may be invalid under `new` (empty when the change is safe).

    Structural rules over the keywords node schemas use (type, required, properties, additionalProperties,
    enum, const, items, bounds); anything it cannot reason about, it reports as breaking.
    """
    where = path or "<root>"
    if old == new or new in ({}, True):
        return []
    if not isinstance(old, dict) or not isinstance(new, dict):
        return [f"{where}: schema replaced"]
    reasons: list[str] = []
    old_types, new_types = _types(old), _types(new)
    if new_types is not None and (old_types is None or not old_types <= new_types):
        reasons.append(f"{where}: type narrowed from {sorted(old_types or ['any'])} to {sorted(new_types)}")
    added = set(new.get("required", [])) - set(old.get("required", []))
    for name in sorted(added):
        reasons.append(f"{where}: property {name!r} became required")
    if "enum" in new and (
        "enum" not in old or not set(map(json.dumps, old["enum"])) <= set(map(json.dumps, new["enum"]))
    ):
        dropped = [v for v in old.get("enum", []) if v not in new["enum"]]
        reasons.append(f"{where}: enum narrowed" + (f" (dropped {dropped})" if dropped else ""))
    if "const" in new and old.get("const") != new["const"]:
        reasons.append(f"{where}: const changed to {new['const']!r}")
    for key in _NUMERIC_LOWER:
        if key in new and (key not in old or new[key] > old[key]):
            reasons.append(f"{where}: {key} raised to {new[key]}")
    for key in _NUMERIC_UPPER:
        if key in new and (key not in old or new[key] < old[key]):
            reasons.append(f"{where}: {key} lowered to {new[key]}")
    old_props, new_props = old.get("properties", {}), new.get("properties", {})
    old_extra, new_extra = old.get("additionalProperties", True), new.get("additionalProperties", True)
    if new_extra is False and old_extra is not False:
        reasons.append(f"{where}: additionalProperties became false")
    for name in sorted(set(old_props) - set(new_props)):
        if new_extra is False:
            reasons.append(f"{where}: property {name!r} removed while additionalProperties is false")
    for name in sorted(set(old_props) & set(new_props)):
        reasons += breaking_changes(old_props[name], new_props[name], f"{path}/{name}")
    for name in sorted(set(new_props) - set(old_props)):
        if old_extra is not False:  # old data may already carry this property with any value
            reasons += breaking_changes(
                old_extra if isinstance(old_extra, dict) else {}, new_props[name], f"{path}/{name}"
            )
    if "items" in new:
        reasons += breaking_changes(old.get("items", {}), new["items"], f"{path}[]")
    known = {"type", "required", "enum", "const", "properties", "additionalProperties", "items", "title",
             "description", "$schema", "$id", "default", "examples", *_NUMERIC_LOWER, *_NUMERIC_UPPER}  # fmt: skip
    for key in sorted(set(new) - known):
        if old.get(key) != new[key]:
            reasons.append(f"{where}: keyword {key!r} changed and cannot be checked for compatibility")
    return reasons


@dataclass(frozen=True)
class NodeTypeSchema:
    node_type: str
    version: int
    schema: dict[str, Any]

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.schema, sort_keys=True).encode()).hexdigest()[:16]

    def key(self) -> bytes:
        return _KEY_PREFIX + f"{self.node_type}/{self.digest}".encode()

    def to_bytes(self) -> bytes:
        doc = {"format": "jsonschema", "subject": f"node:{self.node_type}", "version": self.version}
        return json.dumps({**doc, "node_type": self.node_type, "schema": self.schema}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> NodeTypeSchema:
        doc = json.loads(data)
        return cls(doc["node_type"], int(doc["version"]), doc["schema"])


class NodeTypes:
    """Registered node types in memory: the latest version of each validates node data."""

    def __init__(self) -> None:
        self._versions: dict[str, list[NodeTypeSchema]] = {}
        self._validators: dict[str, Draft202012Validator] = {}

    def add(self, registered: NodeTypeSchema) -> None:
        versions = self._versions.setdefault(registered.node_type, [])
        if any(v.version == registered.version for v in versions):
            return
        versions.append(registered)
        versions.sort(key=lambda v: v.version)
        self._validators[registered.node_type] = Draft202012Validator(versions[-1].schema)

    def latest(self, node_type: str) -> NodeTypeSchema | None:
        versions = self._versions.get(node_type)
        return versions[-1] if versions else None

    def types(self) -> list[str]:
        return sorted(self._versions)

    def next_version(self, node_type: str, schema: dict[str, Any]) -> NodeTypeSchema | None:
        """The record to publish, None when `schema` is already the latest; raises if it breaks the latest."""
        Draft202012Validator.check_schema(schema)
        latest = self.latest(node_type)
        if latest is not None:
            if latest.schema == schema:
                return None
            reasons = breaking_changes(latest.schema, schema)
            if reasons:
                raise IncompatibleNodeTypeError(node_type, reasons, schema_diff(latest.schema, schema))
        return NodeTypeSchema(node_type, (latest.version + 1) if latest else 1, schema)

    def problem(self, node_type: str, data: Any) -> str | None:
        """Why `data` is not a valid node of `node_type`, or None (types without a schema accept any JSON)."""
        validator = self._validators.get(node_type)
        return None if validator is None else first_problem(validator, data, f"data of node type {node_type!r}")


class NodeTypeRegistry:
    """NodeTypes persisted in, and loaded from, the schema registry's compacted topic."""

    def __init__(self, bootstrap_servers: str, topic: str) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.types = NodeTypes()

    async def load(self) -> NodeTypes:
        for key, value in await read_to_end(self.bootstrap_servers, self.topic):
            if (key or b"").startswith(_KEY_PREFIX):
                self.types.add(NodeTypeSchema.from_bytes(value))
        return self.types

    async def register(self, node_type: str, schema: dict[str, Any]) -> NodeTypeSchema | None:
        """Register a new version of `node_type`; None if unchanged; IncompatibleNodeTypeError if breaking."""
        await self.load()
        record = self.types.next_version(node_type, schema)
        if record is None:
            return None
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap_servers, acks="all")
        await producer.start()
        try:
            await producer.send_and_wait(self.topic, record.to_bytes(), key=record.key())
        finally:
            await producer.stop()
        self.types.add(record)
        return record


def _main(argv: list[str]) -> int:
    """`python -m topics.node_types register <type> <schema.json>` | `list`."""
    from topics.catalog import TopicCatalog
    from topics.settings import Settings

    settings = Settings.from_env()
    registry = NodeTypeRegistry(settings.kafka_bootstrap_servers, TopicCatalog(settings)["node_types"].name)
    if argv[:1] == ["register"] and len(argv) == 3:
        try:
            record = asyncio.run(registry.register(argv[1], json.loads(Path(argv[2]).read_text())))
        except IncompatibleNodeTypeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print("unchanged" if record is None else f"registered node type {argv[1]} version {record.version}")
        return 0
    if argv[:1] == ["list"]:
        types = asyncio.run(registry.load())
        for name in types.types():
            latest = types.latest(name)
            print(f"{name}\tv{latest.version if latest else '?'}")
        return 0
    print("usage: python -m topics.node_types register <type> <schema.json> | list", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
