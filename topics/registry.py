"""Schema registry on a compacted Kafka topic: no extra service, same durability as the data.

Each record is keyed `<subject>/<fingerprint>` and holds {subject, version, fingerprint, schema}.
The subject is the record's full name. Registering a new version is refused, with the reasons,
when it is incompatible with the latest one under the configured mode (BACKWARD by default), or
when the schema treadle ships for that record cannot read data written with it: the worker and
the sink read every input as the shipped schema, so such a writer's events would all be dead
letters (a new enum symbol, a field the shipped schema requires removed).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from aiokafka import AIOKafkaProducer

from topics.compacted import read_to_end
from topics.compatibility import Compatibility, compatibility_errors, read_errors
from topics.schemas import AvroSchema, SchemaSet

log = logging.getLogger(__name__)

RELOAD_INTERVAL_S = 1.0  # unknown fingerprints reload the registry at most this often


class IncompatibleSchemaError(Exception):
    """A schema change that would break readers or writers; `reasons` lists each violation."""

    def __init__(self, subject: str, mode: Compatibility, reasons: list[str]) -> None:
        self.subject, self.mode, self.reasons = subject, mode, reasons
        super().__init__(f"{subject}: incompatible change under {mode}: " + "; ".join(reasons))


@dataclass(frozen=True)
class RegisteredSchema:
    subject: str
    version: int
    schema: AvroSchema

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "subject": self.subject,
                "version": self.version,
                "fingerprint": f"{self.schema.fingerprint:016x}",
                "schema": self.schema.json,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RegisteredSchema:
        doc = json.loads(data)
        return cls(subject=doc["subject"], version=int(doc["version"]), schema=AvroSchema.from_json(doc["schema"]))


class SchemaVersions:
    """The registry's contents in memory; the compatibility rules live here, apart from Kafka."""

    def __init__(self, mode: Compatibility = Compatibility.BACKWARD, readers: SchemaSet | None = None) -> None:
        self.mode = mode
        self.readers = readers  # the schemas this treadle reads inputs as; a writer they cannot read is refused
        self._subjects: dict[str, list[RegisteredSchema]] = {}
        self._by_fingerprint: dict[int, RegisteredSchema] = {}

    def add(self, registered: RegisteredSchema) -> None:
        if registered.schema.fingerprint in self._by_fingerprint:
            return
        self._subjects.setdefault(registered.subject, []).append(registered)
        self._subjects[registered.subject].sort(key=lambda r: r.version)
        self._by_fingerprint[registered.schema.fingerprint] = registered

    def latest(self, subject: str) -> RegisteredSchema | None:
        versions = self._subjects.get(subject)
        return versions[-1] if versions else None

    def versions(self, subject: str) -> list[RegisteredSchema]:
        return list(self._subjects.get(subject, []))

    def subjects(self) -> list[str]:
        return sorted(self._subjects)

    def lookup(self, fingerprint: int) -> AvroSchema | None:
        registered = self._by_fingerprint.get(fingerprint)
        return registered.schema if registered else None

    def next_version(self, schema: AvroSchema) -> RegisteredSchema | None:
        """The record to publish for `schema`, None if already registered; raises if incompatible."""
        if schema.fingerprint in self._by_fingerprint:
            return None
        latest = self.latest(schema.name)
        if latest is not None and self.mode is not Compatibility.NONE:
            reasons = compatibility_errors(schema.json, latest.schema.json, self.mode)
            if reasons:
                raise IncompatibleSchemaError(schema.name, self.mode, reasons)
        if self.readers is not None and schema.name in self.readers and self.mode is not Compatibility.NONE:
            errors = read_errors(self.readers[schema.name].json, schema.json)
            reasons = [f"treadle's own {schema.name} cannot read it: {e}" for e in errors]
            if reasons:
                raise IncompatibleSchemaError(schema.name, self.mode, reasons)
        return RegisteredSchema(subject=schema.name, version=(latest.version + 1) if latest else 1, schema=schema)


class SchemaRegistry:
    """SchemaVersions persisted in, and loaded from, the compacted schemas topic."""

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        mode: Compatibility = Compatibility.BACKWARD,
        readers: SchemaSet | None = None,
    ) -> None:
        """`readers`: the schemas a registered writer must be readable as; default the ones treadle ships."""
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.versions = SchemaVersions(mode, SchemaSet.load() if readers is None else readers)
        self._loaded_at: float | None = None  # time.monotonic() when the last load started

    def lookup(self, fingerprint: int) -> AvroSchema | None:
        return self.versions.lookup(fingerprint)

    async def load(self) -> None:
        """Read the whole topic (it is compacted and small) into memory."""
        self._loaded_at = time.monotonic()
        for _, value in await read_to_end(self.bootstrap_servers, self.topic):
            self.versions.add(RegisteredSchema.from_bytes(value))

    async def load_if_due(self, min_interval_s: float = RELOAD_INTERVAL_S) -> bool:
        """Load again, unless the last load started under `min_interval_s` ago; True if it loaded.

        For a record whose writer schema is unknown: a producer may have registered it since the last load. The
        interval keeps a stream of unreadable fingerprints from rereading the topic for every record."""
        if self._loaded_at is not None and time.monotonic() - self._loaded_at < min_interval_s:
            return False
        await self.load()
        return True

    async def register(self, schemas: list[AvroSchema], load: bool = True) -> list[RegisteredSchema]:
        """Register each schema not yet known; all are checked before any is published.

        `load=False` skips reading the topic first: only for a topic just created (so empty), whose
        partition may not serve reads yet (aiokafka would log NotLeaderForPartitionError at ERROR).
        """
        if load:
            await self.load()
        pending: list[RegisteredSchema] = []
        for schema in schemas:
            record = self.versions.next_version(schema)
            if record is not None:
                pending.append(record)
        if pending:
            producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap_servers, acks="all")
            await producer.start()
            try:
                for record in pending:
                    key = f"{record.subject}/{record.schema.fingerprint:016x}".encode()
                    await producer.send_and_wait(self.topic, record.to_bytes(), key=key)
                    self.versions.add(record)
                    log.info("registered %s version %d", record.subject, record.version)
            finally:
                await producer.stop()
        return pending

    async def register_set(self, schema_set: SchemaSet, load: bool = True) -> list[RegisteredSchema]:
        return await self.register(list(schema_set), load=load)
