"""`treadle export`: options to filters, a progress bar on a terminal, one line per mistake, a summary."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from sinks.export import ExportError
from sinks.export import Progress as ProgressCallback
from sinks.export_manifest import ExportManifest, manifest_path_for
from sinks.export_sql import ExportFilters, Shape
from sinks.export_writers import ExportFormat
from topics.settings import Settings
from treadle import replay
from treadle.reports.eval_report import parse_time


class ExportOptionError(ValueError):
    """An option of `treadle export` the user has to fix; one line."""


def _choice(value: str, kind: type[Shape] | type[ExportFormat], option: str) -> str:
    known = [m.value for m in kind]
    if value.lower() not in known:
        raise ExportOptionError(f"unknown {option} {value!r}: use one of {', '.join(known)}")
    return value.lower()


def filters_from_options(
    since: str | None,
    until: str | None,
    policy_versions: Sequence[str],
    agents: Sequence[str],
    sessions: Sequence[str],
    episodes: Sequence[str],
    settled: bool,
    statuses: Sequence[str],
    min_confidence: float | None,
    now: datetime | None = None,
    variant: str = "live",
) -> ExportFilters:
    now = now or datetime.now(UTC)
    try:
        return ExportFilters(
            since=None if since is None else parse_time(since, "--since", now),
            until=None if until is None else parse_time(until, "--until", now),
            policy_versions=tuple(policy_versions),
            agents=tuple(agents),
            sessions=tuple(sessions),
            episodes=tuple(episodes),
            settled=settled,
            statuses=tuple(statuses),
            min_confidence=min_confidence,
            variant=variant,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ExportOptionError(str(first["msg"]).removeprefix("Value error, ")) from None


@contextmanager
def _progress_bar(console: Console, label: str) -> Iterator[ProgressCallback | None]:
    if not console.is_terminal:
        yield None
        return
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[rows]:,} rows"),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(label, total=None, rows=0)

        def update(written: int, scanned: int, total: int) -> None:
            bar.update(task, completed=scanned, total=total or None, rows=written)

        yield update


def run_export(
    settings: Settings,
    console: Console,
    *,
    output: Path | None,
    shape: str,
    fmt: str,
    since: str | None,
    until: str | None,
    policy_versions: Sequence[str],
    agents: Sequence[str],
    sessions: Sequence[str],
    episodes: Sequence[str],
    settled: bool,
    statuses: Sequence[str],
    min_confidence: float | None,
    batch_rows: int | None,
    variant: str = "live",
    manifest: Path | None,
    force: bool,
) -> ExportManifest:
    try:
        if manifest is not None:
            before = _read_manifest(manifest)
            with _progress_bar(console, f"re-exporting {before.shape.value}") as progress:
                after = replay.rerun(before, output, settings=settings, overwrite=force, progress=progress)
            _summary(console, after, Path(after.output))
            if not after.same_rows_as(before):
                console.print(
                    f"[yellow]differs from the manifest:[/yellow] {after.rows:,} rows (was {before.rows:,}), "
                    f"revision sum {after.revision_sum:,} (was {before.revision_sum:,}): steps got new revisions "
                    "since, or their rows left the tables",
                    highlight=False,
                )
            return after
        if output is None:
            raise ExportOptionError("give the file to write, e.g. `treadle export steps.parquet`")
        filters = filters_from_options(since, until, policy_versions, agents, sessions, episodes, settled,
                                       statuses, min_confidence, variant=variant)  # fmt: skip
        chosen, fmt = Shape(_choice(shape, Shape, "shape")), _choice(fmt, ExportFormat, "format")
        if filters.variant != "live":
            _check_variant(settings, filters.variant)
        with _progress_bar(console, f"exporting {chosen.value}") as progress:
            done = replay.export(chosen, output, format=fmt, settings=settings, filters=filters,
                                 batch_rows=batch_rows, overwrite=force, progress=progress)  # fmt: skip
    except ExportError as exc:
        raise ExportOptionError(str(exc)) from None
    _summary(console, done, output)
    return done


def _check_variant(settings: Settings, variant: str) -> None:
    """A variant name nothing was written under exports nothing: say so, with the names there are."""
    from sinks.sql_client import run_sql

    _, rows = run_sql(settings, "SELECT DISTINCT variant FROM transitions ORDER BY variant")
    known = [row[0] for row in rows]
    if variant not in known:
        names = ", ".join(known) or "none"
        raise ExportOptionError(f"no variant {variant!r} in transitions (there are: {names}); `treadle reweave --as "
                                "NAME` writes one")  # fmt: skip


def _read_manifest(path: Path) -> ExportManifest:
    try:
        return ExportManifest.read(path)
    except OSError as exc:
        raise ExportOptionError(f"cannot read the manifest {path}: {exc.strerror}") from None
    except ValueError:
        raise ExportOptionError(f"{path} is not an export manifest (written by `treadle export`)") from None


def _summary(console: Console, manifest: ExportManifest, output: Path) -> None:
    versions = ", ".join(manifest.policy_versions) or "none"
    console.print(
        f"wrote {manifest.rows:,} {manifest.shape.value} rows to {output} ({manifest.format.value}); "
        f"policy versions: {versions}; manifest: {manifest_path_for(output)}",
        highlight=False,
        soft_wrap=True,
    )
