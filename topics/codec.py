"""The wire format: Avro single-object encoding.

    bytes 0-1   C3 01                 marker (Avro spec, "Single-object encoding")
    bytes 2-9   CRC-64-AVRO fingerprint of the writer schema's Parsing Canonical Form, little-endian
    bytes 10-   the record in Avro binary encoding

It needs no extra service: any Avro library (Java's BinaryMessageEncoder, avro-rs, fastavro + 10
header bytes) can produce it, and the fingerprint names the writer schema so readers can resolve
old and new versions. Writer schemas we don't ship are looked up in the schema registry topic.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from fastavro import schemaless_reader, schemaless_writer
from fastavro._read_common import SchemaResolutionError

from topics import native_codec
from topics.avro_reader import RecordReader, compile_reader
from topics.avro_writer import RecordWriter, UnsupportedSchema, compile_writer
from topics.schemas import AvroSchema, SchemaSet

MAGIC = b"\xc3\x01"
HEADER = struct.Struct("<2sQ")


def single_object_header(schema: AvroSchema) -> bytes:
    """What every single-object-encoded value of `schema` starts with: the magic and the schema's fingerprint."""
    return HEADER.pack(MAGIC, schema.fingerprint)


class DeadLetterStage(StrEnum):
    DECODE = "DECODE"
    SCHEMA = "SCHEMA"
    VALIDATE = "VALIDATE"
    PROCESS = "PROCESS"


class DecodeError(Exception):
    """Bytes that cannot become a record; `stage` says where it failed, for the dead-letter row."""

    def __init__(self, stage: DeadLetterStage, reason: str, unknown_writer: bool = False) -> None:
        super().__init__(reason)
        self.stage = stage
        self.reason = reason
        self.unknown_writer = unknown_writer  # the writer's fingerprint is in no schema known here (yet)


class AvroCodec:
    """Encodes records of known schemas and decodes any registered writer schema into a reader schema."""

    def __init__(
        self,
        schemas: SchemaSet | None = None,
        lookup: Callable[[int], AvroSchema | None] | None = None,
    ) -> None:
        self.schemas = schemas or SchemaSet.load()
        self._lookup = lookup
        self.native = native_codec.enabled()  # records go through treadle_native (topics/native_codec.py)
        self._writers: dict[str, RecordWriter | None] = {}  # generated writers by schema name; None: fastavro only
        self._readers: dict[int, RecordReader | None] = {}  # generated readers by writer fingerprint; None: fastavro
        # (fingerprint bytes, expect) -> (reader name, reader) of writers read as themselves: decode's fast path
        self._read_as_itself: dict[tuple[bytes, str | None], tuple[str, RecordReader]] = {}

    def encode(self, schema_name: str, record: dict[str, Any]) -> bytes:
        """Header + Avro binary: the native or generated writer, fastavro for what it does not take (same bytes)."""
        try:
            writer = self._writers[schema_name]
        except KeyError:
            writer = self._writers[schema_name] = self._compile(schema_name)
        if writer is not None:
            try:
                return writer(record)
            except Exception:
                pass  # not the plain, exactly typed values it takes: fastavro encodes them or raises its own error
        return self.encode_fastavro(schema_name, record)

    def writer(self, schema_name: str) -> Callable[[dict[str, Any] | tuple[Any, ...]], bytes]:
        """What `encode` runs first for `schema_name` (the native or generated writer), for a caller that encodes one
        schema per call site and calls `encode` only when it raises; without one, `encode` for that schema.

        It also takes the record as a tuple of its field values in schema order (`record_of`), nested records
        defined at their field as tuples too: the SDK's hot paths build no dicts. The native writer reads tuples
        as they are; the others get the dicts `record_of` makes of them."""
        try:
            writer = self._writers[schema_name]
        except KeyError:
            writer = self._writers[schema_name] = self._compile(schema_name)
        if writer is not None and self.native and native_codec.TAKES_TUPLES:
            return writer
        encode = writer if writer is not None else lambda record: self.encode_fastavro(schema_name, record)
        record_of = self.record_of
        return lambda record: encode(record_of(schema_name, record) if type(record) is tuple else record)

    def record_of(self, schema_name: str, values: tuple[Any, ...] | dict[str, Any]) -> dict[str, Any]:
        """The record `values` gives as a tuple of its field values in schema order (nested records defined at
        their field may be tuples too), as the dict `encode` takes; a dict is returned as it is. ValueError when a
        tuple has too few or too many values."""
        return _record_dict(self.schemas[schema_name].json, values)  # type: ignore[no-any-return]

    def encode_fastavro(self, schema_name: str, record: dict[str, Any]) -> bytes:
        """The reference encoding (fastavro.schemaless_writer); the generated writers must match it byte for byte."""
        schema = self.schemas[schema_name]
        buf = io.BytesIO()
        buf.write(single_object_header(schema))
        schemaless_writer(buf, schema.parsed, record)
        return buf.getvalue()

    def _compile(self, schema_name: str) -> RecordWriter | None:
        """The native writer (topics/native_codec.py), else the generated one, else None (fastavro only)."""
        schema = self.schemas[schema_name]  # KeyError for an unknown name, before anything is cached
        prefix = single_object_header(schema)
        native = native_codec.record_codec(schema.json, prefix) if self.native else None
        if native is not None:
            return native.encode  # type: ignore[no-any-return]
        try:
            return compile_writer(schema.json, prefix)
        except UnsupportedSchema:
            return None

    def writer_schema(self, data: bytes | None) -> AvroSchema:
        """The schema `data` was written with, or DecodeError."""
        if data is None:
            raise DecodeError(DeadLetterStage.DECODE, "null value (tombstone) where an event was expected")
        if len(data) < HEADER.size or data[:2] != MAGIC:
            raise DecodeError(
                DeadLetterStage.DECODE,
                "not Avro single-object encoding (expected marker C3 01 and an 8-byte schema fingerprint)",
            )
        _, fp = HEADER.unpack_from(data)
        schema = self.schemas.by_fingerprint(fp)
        if schema is None and self._lookup is not None:
            schema = self._lookup(fp)
            if schema is not None:
                self.schemas.add(schema)
        if schema is None:
            raise DecodeError(
                DeadLetterStage.SCHEMA, f"unknown writer schema fingerprint {fp:016x}", unknown_writer=True
            )
        return schema

    def decode(self, data: bytes | None, expect: str | frozenset[str] | None = None) -> tuple[str, dict[str, Any]]:
        """(schema name, record); with `expect`, resolved into the current version of that schema (of the writer's,
        when `expect` is a set of schemas a multi-schema topic carries)."""
        if data is not None:  # the common case first: a writer read as itself, bytes its reader vouches for
            known = self._read_as_itself.get((data[2:10], expect))
            if known is not None and data[:2] == MAGIC:
                try:
                    record, end = known[1](data, HEADER.size)
                    if end == len(data):
                        return known[0], record
                except Exception:
                    pass  # the full path below names the error, or asks fastavro
        return self._decode(data, expect)

    def _decode(self, data: bytes | None, expect: str | frozenset[str] | None) -> tuple[str, dict[str, Any]]:
        writer = self.writer_schema(data)
        if isinstance(expect, frozenset):
            if writer.name not in expect:
                raise DecodeError(
                    DeadLetterStage.SCHEMA, f"expected one of {sorted(expect)}, got {writer.name} (wrong topic?)"
                )
            reader_name = writer.name
        else:
            reader_name = expect or writer.name
            if expect is not None and writer.name != expect:
                raise DecodeError(
                    DeadLetterStage.SCHEMA, f"expected a {expect} record, got {writer.name} (wrong topic?)"
                )
        reader = self.schemas[reader_name] if reader_name in self.schemas else writer
        assert data is not None  # writer_schema raised otherwise
        if reader.fingerprint == writer.fingerprint:
            record, end = self._read_generated(writer, data)
            if record is not None:
                record = self._whole(record, end, data, writer)
                read = self._readers[writer.fingerprint]
                if read is not None:  # next time, straight to it (decode)
                    self._read_as_itself[(data[2:10], expect)] = (reader_name, read)
                return reader_name, record
        try:
            body = io.BytesIO(data)
            body.seek(HEADER.size)
            if reader.fingerprint == writer.fingerprint:
                record = schemaless_reader(body, writer.parsed, None)
            else:
                record = schemaless_reader(body, writer.parsed, reader.parsed)
        except SchemaResolutionError as exc:
            raise DecodeError(
                DeadLetterStage.SCHEMA, f"writer schema {writer.name} cannot be read as {reader.name}: {exc}"
            ) from exc
        except Exception as exc:  # fastavro raises EOFError, ValueError, UnicodeDecodeError, SchemaResolutionError...
            raise DecodeError(
                DeadLetterStage.DECODE, f"body does not match writer schema {writer.name}: {exc!r}"
            ) from exc
        return reader_name, self._whole(record, body.tell(), data, writer)

    def _read_generated(self, writer: AvroSchema, data: bytes) -> tuple[Any, int]:
        """(record, end) from the schema's generated reader, or (None, 0) where fastavro must read it: no reader for
        the schema, or bytes it does not vouch for (fastavro then decodes them or names the error)."""
        try:
            read = self._readers[writer.fingerprint]
        except KeyError:
            read = self._readers[writer.fingerprint] = _compiled_reader(writer, self.native)
        if read is None:
            return None, 0
        try:
            return read(data, HEADER.size)
        except Exception:
            return None, 0

    @staticmethod
    def _whole(record: dict[str, Any], end: int, data: bytes, writer: AvroSchema) -> dict[str, Any]:
        if end != len(data):
            raise DecodeError(DeadLetterStage.DECODE, f"{len(data) - end} trailing bytes after a {writer.name} record")
        return record


def _record_dict(schema: Any, value: Any) -> Any:
    """`value` with each record given as a tuple (at a record type defined in place) turned into a dict."""
    if type(value) is tuple and isinstance(schema, dict) and schema.get("type") == "record":
        fields = schema["fields"]
        if len(value) != len(fields):
            raise ValueError(f"{schema.get('name')} has {len(fields)} fields, the tuple given {len(value)} values")
        return {field["name"]: _record_dict(field["type"], v) for field, v in zip(fields, value, strict=True)}
    if type(value) is tuple and isinstance(schema, list):  # a union: its record branch, if it has one
        for branch in schema:
            if isinstance(branch, dict) and branch.get("type") == "record":
                return _record_dict(branch, value)
    return value


def _compiled_reader(schema: AvroSchema, native_allowed: bool) -> RecordReader | None:
    """The native reader (topics/native_codec.py), else the generated one, else None (fastavro only)."""
    native = native_codec.record_codec(schema.json) if native_allowed else None
    if native is not None:
        return native.decode  # type: ignore[no-any-return]
    try:
        return compile_reader(schema.json)
    except UnsupportedSchema:
        return None
