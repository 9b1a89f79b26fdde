"""The manifest written next to an export: what was read, from what, when, so the set can be made again.

A re-run (`treadle export --manifest FILE`) runs the recorded shape under the recorded filters, whose `until`
is the first run's as-of time when none was given, so steps dispatched later are not in it. What can still
differ is a step's final revision (a late reward arrives after the export): `rows` and `revision_sum` say
whether the re-run read the same rows at the same revisions.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from importlib import metadata
from pathlib import Path

import pyarrow as pa
from pydantic import BaseModel, Field

from sinks.export_sql import ExportFilters, Shape
from sinks.export_writers import ExportFormat
from topics.names import LLM_CALL, TRANSITION, WOVEN_REWARD
from topics.schemas import SchemaSet

MANIFEST_VERSION = 1
_AVRO_SOURCES = {
    Shape.TRANSITIONS: (TRANSITION, WOVEN_REWARD),
    Shape.TRAJECTORIES: (TRANSITION, WOVEN_REWARD),
    Shape.TRIPLETS: (LLM_CALL, TRANSITION, WOVEN_REWARD),
}


class ExportManifest(BaseModel):
    """Everything needed to make an export again and to tell whether a re-run read the same rows."""

    manifest_version: int = MANIFEST_VERSION
    shape: Shape
    format: ExportFormat
    output: str = Field(description="The export's file, as given.")
    filters: ExportFilters = Field(description="The filters as applied; `until` defaults to as_of.")
    query: str = Field(description="The shape's whole query (the export reads it a session range at a time).")
    as_of: datetime = Field(description="When the export started (UTC); the default `until`.")
    rows: int
    revision_sum: int = Field(description="Sum of the rows' step revisions: changes when a step got a new revision.")
    policy_versions: list[str] = Field(description="Distinct policy versions in the rows.")
    treadle_version: str
    migration: int = Field(description="The newest ClickHouse migration this treadle has (the tables' version).")
    avro_fingerprints: dict[str, str] = Field(description="Rabin fingerprints (hex) of the records the rows came from.")
    columns: dict[str, str] = Field(description="Column name -> Arrow type of the export.")
    columns_fingerprint: str = Field(description="SHA-256 of the Arrow schema's text.")
    batch_rows: int

    def write(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=2) + "\n")

    @classmethod
    def read(cls, path: Path) -> ExportManifest:
        return cls.model_validate_json(path.read_text())

    def same_rows_as(self, other: ExportManifest) -> bool:
        return (self.rows, self.revision_sum, self.columns_fingerprint) == (
            other.rows,
            other.revision_sum,
            other.columns_fingerprint,
        )


def manifest_path_for(output: Path) -> Path:
    """`out.parquet` -> `out.parquet.manifest.json`, beside it."""
    return output.with_name(output.name + ".manifest.json")


def treadle_version() -> str:
    try:
        return metadata.version("treadle")
    except metadata.PackageNotFoundError:
        return "unknown"


def avro_fingerprints(shape: Shape) -> dict[str, str]:
    schemas = SchemaSet.load()
    return {name: f"{schemas[name].fingerprint:016x}" for name in _AVRO_SOURCES[shape]}


def columns_of(schema: pa.Schema) -> tuple[dict[str, str], str]:
    """(name -> type, SHA-256 of the schema's text) of an export's Arrow schema."""
    text = schema.to_string(show_schema_metadata=False)
    return {f.name: str(f.type) for f in schema}, hashlib.sha256(text.encode()).hexdigest()
