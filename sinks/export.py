"""Replay export: rows of a shape streamed out of ClickHouse as Arrow record batches, into a file and a manifest.

Memory stays flat for any size because the export reads a range of sessions at a time (keyset pagination on the
tables' sort key: no OFFSET over the data, no cursor held open): each page is the shape's query for sessions
(lo, hi], where hi is the session about `batch_rows` raw rows after lo. The next page's boundary is found while a
page is read (ArrowBatchRunner runs two statements at once). A page holds whole sessions (a trajectory is never
cut in two), so the one limit is that a single session must fit in memory. Pages are short reads, so through the
sink's SQL service (when the worker owns embedded chDB) the sink keeps inserting between them.

Reading and writing overlap: a thread fetches the next page while the current one is written (at most three
pages in memory: one written, one waiting, one being read), so an export costs about max(read, write).

Columns come out with fixed types: ClickHouse's LowCardinality columns arrive as Arrow dictionaries whose index
width depends on each page's dictionary, so they are decoded to their values, and every page is cast to the
schema of the first (an empty read of the query gives it, so an empty export still has its columns).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from sinks.export_manifest import (
    ExportManifest,
    avro_fingerprints,
    columns_of,
    manifest_path_for,
    treadle_version,
)
from sinks.export_sql import PAGE_TABLE, ExportFilters, Shape, page_end_sql, shape_sql
from sinks.export_writers import ExportFormat, open_writer
from sinks.migrations import load_migrations
from sinks.sql_client import ArrowBatchRunner, arrow_batches
from topics.settings import Settings

log = logging.getLogger(__name__)

DEFAULT_BATCH_ROWS = {Shape.TRANSITIONS: 50_000, Shape.TRAJECTORIES: 50_000, Shape.TRIPLETS: 5_000}
# (rows written so far, raw rows scanned so far, raw rows in the shape's table) after each page
Progress = Callable[[int, int, int], None]
_REVISION_COLUMN = {Shape.TRANSITIONS: "revision", Shape.TRAJECTORIES: "steps", Shape.TRIPLETS: "reward_revision"}


class ExportError(ValueError):
    """An export cannot run as asked (an existing output, a manifest that does not parse...)."""


def export(
    settings: Settings,
    shape: Shape | str,
    output: Path,
    *,
    filters: ExportFilters | None = None,
    fmt: ExportFormat | str = ExportFormat.PARQUET,
    batch_rows: int | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    runner: ArrowBatchRunner | None = None,
) -> ExportManifest:
    """Write the shape's rows to `output` and its manifest beside it (`<output>.manifest.json`); the manifest."""
    shape, fmt = Shape(shape), ExportFormat(fmt)
    output = Path(output)
    if output.exists() and not overwrite:
        raise ExportError(f"{output} exists: choose another path or pass overwrite (--force)")
    as_of = datetime.now(UTC)
    filters = filters or ExportFilters()
    if filters.until is None:  # bound the set, so a re-run from the manifest reads the same steps
        filters = filters.model_copy(update={"until": as_of})
    rows = _batch_rows(shape, batch_rows)
    with _runner(settings, runner) as run:
        schema, dictionaries = output_schema(run, shape, filters)
        writer = open_writer(fmt, output, schema, dictionaries)
        written = revision_sum = 0
        policies: set[str] = set()
        try:
            for page in _prefetched(_pages(run, shape, filters, rows, schema, progress)):
                writer.write(page)
                written += page.num_rows
                revision_sum += int(pc.sum(page.column(_REVISION_COLUMN[shape])).as_py() or 0)
                policies.update(v for v in pc.unique(page.column("policy_version")).to_pylist() if v is not None)
        finally:
            writer.close()
    columns, fingerprint = columns_of(schema)
    manifest = ExportManifest(
        shape=shape,
        format=fmt,
        output=str(output),
        filters=filters,
        query=shape_sql(shape, filters),
        as_of=as_of,
        rows=written,
        revision_sum=revision_sum,
        policy_versions=sorted(policies),
        treadle_version=treadle_version(),
        migration=load_migrations()[-1].version,
        avro_fingerprints=avro_fingerprints(shape),
        columns=columns,
        columns_fingerprint=fingerprint,
        batch_rows=rows,
    )
    manifest.write(manifest_path_for(output))
    log.info("exported %d %s rows to %s", written, shape.value, output)
    return manifest


def rerun(
    settings: Settings,
    manifest: Path | ExportManifest,
    output: Path | None = None,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
    runner: ArrowBatchRunner | None = None,
) -> ExportManifest:
    """Export again what a manifest describes (to `output`, default its own path); compare with `same_rows_as`."""
    if not isinstance(manifest, ExportManifest):
        try:
            manifest = ExportManifest.read(Path(manifest))
        except (OSError, ValueError) as exc:
            raise ExportError(f"cannot read the manifest {manifest}: {str(exc).splitlines()[0]}") from None
    return export(
        settings,
        manifest.shape,
        Path(output or manifest.output),
        filters=manifest.filters,
        fmt=manifest.format,
        batch_rows=manifest.batch_rows,
        overwrite=overwrite,
        progress=progress,
        runner=runner,
    )


def read_batches(
    settings: Settings,
    shape: Shape | str,
    filters: ExportFilters | None = None,
    *,
    batch_rows: int | None = None,
    runner: ArrowBatchRunner | None = None,
) -> Iterator[pa.RecordBatch]:
    """The shape's rows as Arrow record batches of at most `batch_rows` rows, in the query's order."""
    shape = Shape(shape)
    filters = filters or ExportFilters()
    rows = _batch_rows(shape, batch_rows)
    with _runner(settings, runner) as run:
        schema, _ = output_schema(run, shape, filters)
        for page in _prefetched(_pages(run, shape, filters, rows, schema, None)):
            yield from page.to_batches(max_chunksize=rows)


def output_schema(run: ArrowBatchRunner, shape: Shape, filters: ExportFilters) -> tuple[pa.Schema, list[str]]:
    """The export's column types (the query's, with dictionaries decoded to their values), and the columns that
    were dictionaries (LowCardinality: few distinct values, worth dictionary-encoding in Parquet)."""
    empty = run([f"SELECT * FROM ({shape_sql(shape, filters, ('', ''))}) LIMIT 0"])[0]
    schema = pa.schema([pa.field(f.name, _plain(f.type), f.nullable) for f in empty.schema])
    return schema, [f.name for f in empty.schema if _has_dictionary(f.type)]


def _has_dictionary(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):
        return True
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and _has_dictionary(kind.value_type)


def _plain(kind: pa.DataType) -> pa.DataType:
    if pa.types.is_dictionary(kind):
        return _plain(kind.value_type)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return pa.list_(_plain(kind.value_type))
    return kind


def _pages(
    run: ArrowBatchRunner,
    shape: Shape,
    filters: ExportFilters,
    batch_rows: int,
    schema: pa.Schema,
    progress: Progress | None,
) -> Iterator[pa.Table]:
    """The shape's rows a session range at a time, cast to `schema`."""
    total = _raw_rows(run, shape) if progress is not None else 0
    scanned = written = 0
    (boundary,) = run([page_end_sql(shape, None, batch_rows)])
    after: str | None = None
    while True:
        end = boundary.column(0)[0].as_py() if boundary.num_rows else None
        statements = [shape_sql(shape, filters, (after, end))]
        if end is not None:
            statements.append(page_end_sql(shape, end, batch_rows))  # the next boundary, read beside this page
        tables = run(statements)
        page = tables[0]
        if page.num_rows:
            yield page.cast(schema)
            written += page.num_rows
        scanned = min(total, scanned + batch_rows) if end is not None else total
        if progress is not None:
            progress(written, scanned, total)
        if end is None:
            return
        after, boundary = end, tables[1]


def _prefetched(pages: Iterator[pa.Table]) -> Iterator[pa.Table]:
    """`pages`, read one ahead in a thread of their own while the caller works on the current one."""
    ready: queue.Queue[tuple[pa.Table | None, BaseException | None]] = queue.Queue(maxsize=1)
    stop = threading.Event()

    def produce() -> None:
        try:
            for page in pages:
                while not stop.is_set():
                    try:
                        ready.put((page, None), timeout=0.2)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            ready.put((None, None))
        except BaseException as exc:  # handed to the caller's thread
            ready.put((None, exc))

    reader = threading.Thread(target=produce, name="treadle-export-reader", daemon=True)
    reader.start()
    try:
        while True:
            page, error = ready.get()
            if error is not None:
                raise error
            if page is None:
                return
            yield page
    finally:
        stop.set()
        with contextlib.suppress(queue.Empty):
            ready.get_nowait()  # let a reader blocked on a full queue see `stop`
        reader.join()


def _raw_rows(run: ArrowBatchRunner, shape: Shape) -> int:
    (table,) = run([f"SELECT count() FROM {PAGE_TABLE[shape]}"])
    return int(table.column(0)[0].as_py())


def _batch_rows(shape: Shape, batch_rows: int | None) -> int:
    rows = DEFAULT_BATCH_ROWS[shape] if batch_rows is None else int(batch_rows)
    if rows < 1:
        raise ExportError(f"batch_rows must be at least 1, got {rows}")
    return rows


@contextmanager
def _runner(settings: Settings, runner: ArrowBatchRunner | None) -> Iterator[ArrowBatchRunner]:
    if runner is not None:
        yield runner
        return
    with arrow_batches(settings, timeout=600.0) as run:
        yield run
