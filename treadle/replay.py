"""Training data out of treadle: replay rows as Parquet, Arrow IPC or JSON lines, or as Arrow record batches.

    from treadle import replay

    manifest = replay.export("transitions", "steps.parquet", settled=True, policy_versions=["v8"])
    for batch in replay.read_batches("triplets", min_confidence=0.5):
        ...
    replay.rerun("steps.parquet.manifest.json", "steps-again.parquet")

Shapes: `transitions` (one row per step, its final revision, reward components and credit-assigned reward),
`trajectories` (one row per episode, steps as lists, return and success) and `triplets` (one row per LLM call:
prompt, completion, token ids, logprobs and its step's reward). Filters are the fields of `ExportFilters`, given
as keyword arguments or as one `filters=`. Reads go through the worker's SQL service while it owns the embedded
database, else straight to ClickHouse; memory stays flat for any size (pages of whole sessions).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from sinks import export as _export
from sinks.export import ExportError, Progress
from sinks.export_manifest import ExportManifest, manifest_path_for
from sinks.export_sql import ExportFilters, Shape
from sinks.export_writers import ExportFormat
from topics.settings import Settings

__all__ = [
    "ExportError",
    "ExportFilters",
    "ExportFormat",
    "ExportManifest",
    "Shape",
    "export",
    "manifest_path_for",
    "read_batches",
    "rerun",
]


def _filters(filters: ExportFilters | None, fields: dict[str, Any]) -> ExportFilters:
    if filters is not None and fields:
        raise TypeError("pass filters= or filter keyword arguments, not both")
    return filters if filters is not None else ExportFilters(**fields)


def export(
    shape: Shape | str,
    output: Path | str,
    *,
    format: ExportFormat | str = ExportFormat.PARQUET,
    settings: Settings | None = None,
    filters: ExportFilters | None = None,
    batch_rows: int | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    **filter_fields: Any,
) -> ExportManifest:
    """Write the shape's rows to `output` and `<output>.manifest.json` beside it; returns the manifest."""
    return _export.export(
        settings or Settings.from_env(),
        shape,
        Path(output),
        filters=_filters(filters, filter_fields),
        fmt=format,
        batch_rows=batch_rows,
        overwrite=overwrite,
        progress=progress,
    )


def read_batches(
    shape: Shape | str,
    *,
    settings: Settings | None = None,
    filters: ExportFilters | None = None,
    batch_rows: int | None = None,
    **filter_fields: Any,
) -> Iterator[pa.RecordBatch]:
    """The shape's rows as Arrow record batches, in order (session, then step / episode / call)."""
    return _export.read_batches(
        settings or Settings.from_env(), shape, _filters(filters, filter_fields), batch_rows=batch_rows
    )


def rerun(
    manifest: Path | str | ExportManifest,
    output: Path | str | None = None,
    *,
    settings: Settings | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ExportManifest:
    """Export again what a manifest describes; `new.same_rows_as(old)` tells whether the rows are the same."""
    source = manifest if isinstance(manifest, ExportManifest) else Path(manifest)
    return _export.rerun(
        settings or Settings.from_env(),
        source,
        None if output is None else Path(output),
        overwrite=overwrite,
        progress=progress,
    )
