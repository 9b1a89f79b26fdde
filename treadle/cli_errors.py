"""How every `treadle` command reports a user mistake or an unreachable service: one `error:` line, exit status 1.

One home for the list of such errors, so a sub-command (contracts, plan) answers exactly like the top-level ones.
The errors are looked up by module and name when a command fails, not imported with the CLI: a module that needs
an extra this install lacks (the CEL engine, chDB) is skipped, and `treadle --help` stays fast.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

F = TypeVar("F", bound=Callable[..., Any])

err = Console(stderr=True)


class UserError(Exception):
    """A problem the user can fix; printed as one line."""


ONE_LINE_ERRORS: tuple[tuple[str, str], ...] = (
    ("aiokafka.errors", "KafkaConnectionError"),
    ("processors.steps.policy", "PolicyError"),
    ("sinks.clickhouse", "ClickHouseUnavailableError"),
    ("sinks.sql_auth", "SqlExposureError"),
    ("sinks.sql_client", "QueryFailedError"),
    ("sinks.sql_guard", "ReadOnlyQueryError"),
    ("sinks.sql_params", "QueryParameterError"),
    ("sinks.variants", "VariantError"),
    ("streams.runtime.plugins", "PluginError"),
    ("streams.runtime.processes", "StackError"),
    ("topics.admin", "TopicMismatchError"),
    ("topics.registry", "IncompatibleSchemaError"),
    ("topics.settings", "InvalidSettingError"),
    ("topics.tool_schemas", "InvalidParamsError"),
    ("treadle.contracts_command", "ProvenanceError"),
    ("treadle.export_command", "ExportOptionError"),
    ("treadle.reports.eval_report", "ReportError"),
    ("treadle.reports.plan_graph", "PlanGraphError"),
    ("treadle.reports.plan_view", "PlanNotFoundError"),
    ("treadle.reweave", "ReweaveError"),
    ("treadle.state.history", "StateNotFoundError"),
)


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception classes printed as one line: UserError, OSError (a file the user named) and those of
    ONE_LINE_ERRORS whose module this install can import."""
    found: list[type[BaseException]] = [UserError, OSError]
    for module, name in ONE_LINE_ERRORS:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except ModuleNotFoundError:
            continue
    return tuple(found)


def fail(message: str) -> None:
    """Print `error: message` on stderr and exit 1."""
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def friendly(fn: F) -> F:
    """Run a command; a user mistake prints its first line, a missing extra says what to install."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ModuleNotFoundError as exc:
            if "pip install" in str(exc):
                fail(str(exc))
            fail(f"this command needs the module {exc.name!r}: pip install 'treadle[all]'")
        except user_errors() as exc:
            text = str(exc).strip()
            fail(text.splitlines()[0] if text else type(exc).__name__)

    return wrapper  # type: ignore[return-value]
