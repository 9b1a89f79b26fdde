"""What the generated Avro writer (topics/avro_writer.py) and reader (topics/avro_reader.py) share: the walk over
a schema's JSON form, named types, fresh variable names, and the exception for what they do not generate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

PRIMITIVES = frozenset(("null", "boolean", "int", "long", "float", "double", "bytes", "string"))

Code = TypeVar("Code")  # what a compiler makes of one value (the writer: statements and byte parts)


class UnsupportedSchema(Exception):
    """The schema uses something no code is generated for; fastavro handles it."""


class SchemaCompiler(Generic[Code]):
    """Dispatches each part of a schema (named types are defined before they are referenced, as SchemaSet expands
    them) to the subclass's method for its kind; `target` names the variable the code reads or fills."""

    def __init__(self, env: dict[str, Any]) -> None:
        self.named: dict[str, Any] = {}  # full name -> schema, for references by name
        self.names: dict[str, str] = {}  # full record name -> the name of its generated function
        self.functions: list[str] = []  # source lines of those functions
        self.env = env  # the generated code's globals
        self.counter = 0

    def finish(self, entry: list[str], label: str) -> Callable[..., Any]:
        """Compile the record functions and `entry` (one function, defined last); that function. Its source stays
        in its globals as `__source__`, for reading."""
        source = "\n".join([*self.functions, *entry, ""])
        self.env["__source__"] = source
        exec(compile(source, f"<{label}>", "exec"), self.env)
        name = entry[0].removeprefix("def ").partition("(")[0]
        return self.env[name]

    def var(self, stem: str) -> str:
        """A variable name not used before in this compilation."""
        self.counter += 1
        return f"{stem}{self.counter}"

    def define(self, schema: dict[str, Any], namespace: str) -> str:
        """Register a named type; its full name."""
        name = str(schema["name"])
        space = schema.get("namespace", namespace)
        full = name if "." in name or not space else f"{space}.{name}"
        if full in self.named:
            raise UnsupportedSchema(f"named type {full} defined twice")
        self.named[full] = schema
        return full

    def value(self, schema: Any, target: str, namespace: str) -> Code:
        if isinstance(schema, list):
            return self.union(schema, target, namespace)
        if isinstance(schema, str):
            return self.primitive(schema, target) if schema in PRIMITIVES else self.ref(schema, target)
        if not isinstance(schema, dict):
            raise UnsupportedSchema(f"not an Avro schema: {schema!r}")
        if "logicalType" in schema:
            raise UnsupportedSchema("logical types are converted by fastavro; no generated code")
        kind = schema["type"]
        if isinstance(kind, dict | list):
            return self.value(kind, target, namespace)
        if kind in PRIMITIVES:
            return self.primitive(kind, target)
        if kind == "record":
            return self.record(schema, target, namespace)
        if kind == "enum":
            self.define(schema, namespace)
            return self.enum(schema, target)
        if kind == "fixed":
            self.define(schema, namespace)
            return self.fixed(schema, target)
        if kind in ("array", "map"):
            return self.blocks(schema, target, namespace)
        if isinstance(kind, str):
            return self.ref(kind, target)
        raise UnsupportedSchema(f"not an Avro schema: {schema!r}")

    def ref(self, name: str, target: str) -> Code:
        """A named type used again: a record through its function, an enum or fixed inline."""
        schema = self.named.get(name)
        if schema is None:
            raise UnsupportedSchema(f"unknown or relative named type {name}")
        if schema["type"] == "record":
            return self.record_ref(name, target)
        return self.enum(schema, target) if schema["type"] == "enum" else self.fixed(schema, target)

    def record(self, schema: dict[str, Any], target: str, namespace: str) -> Code:
        raise NotImplementedError

    def record_ref(self, name: str, target: str) -> Code:
        raise NotImplementedError

    def union(self, branches: list[Any], target: str, namespace: str) -> Code:
        raise NotImplementedError

    def primitive(self, kind: str, target: str) -> Code:
        raise NotImplementedError

    def enum(self, schema: dict[str, Any], target: str) -> Code:
        raise NotImplementedError

    def fixed(self, schema: dict[str, Any], target: str) -> Code:
        raise NotImplementedError

    def blocks(self, schema: dict[str, Any], target: str, namespace: str) -> Code:
        raise NotImplementedError


def primitive_kind(schema: Any) -> str | None:
    """The primitive type a schema is (plain or {"type": ...} without a logical type), else None."""
    if isinstance(schema, str):
        return schema if schema in PRIMITIVES else None
    if isinstance(schema, dict) and schema.get("type") in PRIMITIVES and "logicalType" not in schema:
        return str(schema["type"])
    return None


def indent(lines: list[str], by: int = 4) -> list[str]:
    return [" " * by + line for line in lines]
