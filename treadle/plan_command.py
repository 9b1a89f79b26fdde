"""`treadle plan show PLAN [--session S] [--png FILE]`: a plan's DAG with states, attempts and the critical path,
read from the ClickHouse tables of migration 0019 (treadle.reports.plan_view)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial, wraps
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from topics.settings import Settings

console = Console()
err = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])

plan_app = typer.Typer(help="Plans (docs/plans.md): what the scheduler decided and where the time went.",
                       no_args_is_help=True)  # fmt: skip

_ONE_LINE_ERRORS = (
    ("aiokafka.errors", "KafkaConnectionError"),
    ("sinks.clickhouse", "ClickHouseUnavailableError"),
    ("sinks.sql_client", "QueryFailedError"),
    ("sinks.sql_params", "QueryParameterError"),
    ("treadle.reports.plan_view", "PlanNotFoundError"),
    ("treadle.reports.plan_graph", "PlanGraphError"),
)


def _one_line_errors() -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = [OSError]
    for module, name in _ONE_LINE_ERRORS:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except ModuleNotFoundError:
            continue
    return tuple(found)


def _one_line(fn: F) -> F:
    """A user mistake or an unreachable service prints one `error:` line and exits 1 (as treadle.cli does)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ModuleNotFoundError as exc:
            _fail(str(exc) if "pip install" in str(exc) else f"this command needs the module {exc.name!r}: "
                  "pip install 'treadle[all]'")  # fmt: skip
        except _one_line_errors() as exc:
            _fail(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)

    return wrapper  # type: ignore[return-value]


def _fail(message: str) -> None:
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


@plan_app.command("show")
@_one_line
def show(
    plan: str = typer.Argument(..., help="Plan id."),
    session: str = typer.Option(None, "--session", help="Session of the plan (needed if the id is in several)."),
    png: str = typer.Option(None, "--png", help="Also draw the DAG into this PNG file (needs the reports extra)."),
) -> None:
    """Draw a plan's DAG by dependency depth: each subgoal's state, attempts and durations, the critical path (*)."""
    from sinks.sql_client import run_sql
    from treadle.reports.plan_graph import render_text
    from treadle.reports.plan_view import draw_png, load_plan

    view = load_plan(partial(run_sql, Settings.from_env()), plan, session)
    for line in render_text(view):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    if png is not None:
        draw_png(view, Path(png))
        console.print(f"wrote {png}", highlight=False, markup=False)
