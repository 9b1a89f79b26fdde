"""The export manifest: it round-trips through JSON and records what a re-run needs (no servers)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa

from sinks.export_manifest import ExportManifest, avro_fingerprints, columns_of, manifest_path_for
from sinks.export_sql import ExportFilters, Shape, shape_sql
from sinks.export_writers import ExportFormat
from topics.schemas import SchemaSet


def manifest(**changes) -> ExportManifest:
    filters = ExportFilters(until=datetime(2026, 12, 1, tzinfo=UTC), policy_versions=("v'1",), settled=True)
    columns, fingerprint = columns_of(pa.schema([("session_id", pa.string()), ("revision", pa.uint32())]))
    fields = dict(
        shape=Shape.TRANSITIONS,
        format=ExportFormat.PARQUET,
        output="out.parquet",
        filters=filters,
        query=shape_sql(Shape.TRANSITIONS, filters),
        as_of=filters.until,
        rows=10,
        revision_sum=31,
        policy_versions=["v'1"],
        treadle_version="0.1.0",
        migration=16,
        avro_fingerprints=avro_fingerprints(Shape.TRANSITIONS),
        columns=columns,
        columns_fingerprint=fingerprint,
        batch_rows=100,
    )
    return ExportManifest(**{**fields, **changes})


def test_round_trips_through_json(tmp_path: Path) -> None:
    original = manifest()
    path = manifest_path_for(tmp_path / "out.parquet")
    assert path.name == "out.parquet.manifest.json"
    original.write(path)
    read = ExportManifest.read(path)
    assert read == original and read.filters == original.filters
    assert read.query == shape_sql(read.shape, read.filters), "the recorded query is the one the filters make"


def test_fingerprints_name_the_records_the_rows_came_from() -> None:
    schemas = SchemaSet.load()
    triplets = avro_fingerprints(Shape.TRIPLETS)
    assert triplets["treadle.events.LlmCall"] == f"{schemas['treadle.events.LlmCall'].fingerprint:016x}"
    assert set(avro_fingerprints(Shape.TRANSITIONS)) == {"treadle.derived.Transition", "treadle.derived.WovenReward"}


def test_columns_fingerprint_changes_with_a_type() -> None:
    _, one = columns_of(pa.schema([("a", pa.int32())]))
    _, two = columns_of(pa.schema([("a", pa.int64())]))
    assert one != two and len(one) == 64


def test_same_rows_compares_counts_revisions_and_columns() -> None:
    assert manifest().same_rows_as(manifest(output="elsewhere.parquet", as_of=datetime.now(UTC)))
    assert not manifest().same_rows_as(manifest(revision_sum=32))
    assert not manifest().same_rows_as(manifest(rows=11))
