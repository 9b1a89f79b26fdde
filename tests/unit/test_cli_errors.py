"""The one-line error contract every `treadle` command shares (treadle.cli_errors)."""

from __future__ import annotations

import importlib

import pytest
import typer
from typer.testing import CliRunner

from treadle.cli_errors import ONE_LINE_ERRORS, UserError, friendly, user_errors


@pytest.mark.parametrize(("module", "name"), ONE_LINE_ERRORS)
def test_every_listed_error_exists_and_is_an_exception(module: str, name: str) -> None:
    found = getattr(importlib.import_module(module), name)
    assert issubclass(found, BaseException)
    assert found in user_errors()


def _app(raised: BaseException) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @friendly
    def go() -> None:
        raise raised

    return app


@pytest.mark.parametrize(
    ("raised", "line"),
    [
        (UserError("no such session 's1'\nsecond line"), "error: no such session 's1'"),
        (FileNotFoundError(2, "No such file or directory", "plan.png"), "error: [Errno 2] No such file or directory"),
        (ModuleNotFoundError("no", name="chdb"), "error: this command needs the module 'chdb'"),
        (UserError("a [bracketed] name"), "error: a [bracketed] name"),
    ],
)
def test_a_user_mistake_is_one_line_and_exit_1(raised: BaseException, line: str) -> None:
    result = CliRunner().invoke(_app(raised), [])
    assert result.exit_code == 1
    assert result.output.strip().startswith(line)
    assert len(result.output.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_a_bug_is_not_hidden() -> None:
    result = CliRunner().invoke(_app(ValueError("a bug")), [])
    assert isinstance(result.exception, ValueError)
