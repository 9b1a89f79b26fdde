"""`treadle plan show PLAN [--session S] [--png FILE]`: a plan's DAG with states, attempts and the critical path,
read from the ClickHouse tables of migration 0019 (treadle.reports.plan_view)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import typer
from rich.console import Console

from topics.settings import Settings
from treadle.cli_errors import friendly

console = Console()
plan_app = typer.Typer(help="Plans (docs/plans.md): what the scheduler decided and where the time went.",
                       no_args_is_help=True)  # fmt: skip


@plan_app.command("show")
@friendly
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
