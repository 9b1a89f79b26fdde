"""Records that arrived as Avro single-object encoding, framed as an Avro object container file for FORMAT Avro.

Why: decoding a Transition in Python (fastavro) and turning it into column values cost the sink ~25 us of its core;
ClickHouse's own Avro reader takes ~1.5 us (chDB read 20,000 Transitions in 30 ms and inserted them in ~150 ms). For
the tables whose columns are a record's fields by name (sinks.rows.AVRO_TABLES), the sink therefore passes the
bytes through: the 10-byte single-object header is dropped and each record becomes a block of its own. One record
per block means ClickHouse reads every record from exactly its own bytes, so a malformed one fails the insert
(the sink then decodes that batch in Python: sinks/writer.py) instead of shifting the records after it.

ClickHouse reads a long into a DateTime64(6) column as microseconds, which is what our timestamp-micros fields hold,
so the schema in the header needs no logical types (tests/test_sink_avro.py holds every column to the Python rows).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from topics.avro_writer import zigzag_long
from topics.codec import HEADER, single_object_header
from topics.schemas import AvroSchema

MAGIC = b"Obj\x01"
ONE_RECORD = zigzag_long(1)
# What precedes a record's body in its block (a count of 1, then the body's length), for bodies under 4 KiB: framing a
# Transition with a zigzag_long call per record took as long as decoding it.
_BLOCK_PREFIXES = tuple(ONE_RECORD + zigzag_long(n) for n in range(4096))


def _avro_bytes(data: bytes) -> bytes:
    return zigzag_long(len(data)) + data


class AvroContainer:
    """Single-object-encoded values of one writer schema, buffered until `to_bytes` frames them for ClickHouse."""

    __slots__ = ("_header", "_sync", "header", "schema", "sources", "values")

    def __init__(self, schema: AvroSchema) -> None:
        self.schema = schema
        self.header = single_object_header(schema)
        self.values: list[bytes] = []
        self.sources: list[Any] = []  # where each value came from (sinks.rejected_rows.RowSource), or None
        text = json.dumps(schema.json, separators=(",", ":")).encode()
        # Any 16 bytes do (block sizes are explicit); from the fingerprint, so equal input gives an equal file.
        self._sync = hashlib.blake2b(schema.fingerprint.to_bytes(8, "little"), digest_size=16).digest()
        metadata = zigzag_long(2) + _avro_bytes(b"avro.schema") + _avro_bytes(text)
        metadata += _avro_bytes(b"avro.codec") + _avro_bytes(b"null") + zigzag_long(0)
        self._header = MAGIC + metadata + self._sync

    def append(self, value: bytes, source: Any = None) -> None:
        """A whole single-object-encoded value (header included) written with this container's schema."""
        self.values.append(value)
        self.sources.append(source)

    @property
    def rows(self) -> int:
        return len(self.values)

    def extend_front(self, other: AvroContainer) -> None:
        """Put `other`'s values (an earlier batch whose insert failed) before this one's."""
        self.values = other.values + self.values
        self.sources = other.sources + self.sources

    def to_bytes(self) -> bytes:
        """The container file: the header, then per record its block (count, length, body) and the sync marker."""
        if not self.values:
            return self._header
        skip, prefixes, limit = HEADER.size, _BLOCK_PREFIXES, len(_BLOCK_PREFIXES)
        blocks = [
            (prefixes[n] if (n := len(value) - skip) < limit else ONE_RECORD + zigzag_long(n)) + value[skip:]
            for value in self.values
        ]
        return self._header + self._sync.join(blocks) + self._sync
