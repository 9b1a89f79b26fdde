"""docs/plugins.md's tutorial, followed literally in a temporary folder on the real stack (issue 30's acceptance test):
`treadle plugin new`, `pip install -e`, enable, run a worker, send events with the SDK, and find the reward source's
components woven in transitions_latest and an evaluator's rows in evaluation_metrics_latest. The commands are read
from the page; only the plugin names are made unique, so the packages installed into this venv clash with nothing.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sinks.sql_client import run_sql
from tests.factories import step_components, treadle, wait_for
from tests.paths import REPO_ROOT
from tests.unit.test_reward_source_example import tutorial_commands
from topics.settings import Settings
from treadle import AgentStream


def shell(command: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run a documented command as a user would in `cwd`: `treadle` and `pip` are this interpreter's, and this
    checkout's treadle is the one imported (PYTHONPATH), as it would be once installed."""
    argv = shlex.split(command)
    assignments = dict(a.split("=", 1) for a in argv if re.fullmatch(r"[A-Z_]+=\S*", a))
    argv = [a for a in argv if not re.fullmatch(r"[A-Z_]+=\S*", a)]
    program = {
        "treadle": [sys.executable, "-m", "treadle.cli"],
        "pip": [sys.executable, "-m", "pip"],
        "pytest": [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
    }[argv[0]]
    full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "200", **(env or {}), **assignments}
    done = subprocess.run([*program, *argv[1:]], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"`{command}` failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture
def names(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Unique plugin names; their packages are uninstalled from the venv at the end."""
    unique = f"tut{os.getpid()}"
    made = {"my_source": f"{unique}_source", "my_evaluator": f"{unique}_evaluator"}
    try:
        yield made
    finally:
        for name in made.values():
            subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", name.replace("_", "-")],
                           capture_output=True, timeout=120)  # fmt: skip


async def agent_session(settings: Settings, session: str) -> list[str]:
    """Three steps, the middle one failing; returns their logical_event_ids."""
    steps = []
    async with AgentStream(settings, agent_id="tutorial-agent", session_id=session) as stream:
        for i, status in enumerate(["OK", "ERROR", "OK"]):
            ref = await stream.dispatch("search", {"q": f"question {i}"})
            error = "upstream timeout" if status == "ERROR" else None
            await stream.tool_result(ref, status, output=f"answer {i}", error=error, latency_ms=40.0 + i)
            steps.append(ref.logical_event_id)
        await stream.flush()
    return steps


def test_the_plugin_tutorial_works_as_written(deployment: Settings, worker_factory, tmp_path, names) -> None:
    new_command, printed = tutorial_commands()
    source, evaluator = names["my_source"], names["my_evaluator"]

    # 1. treadle plugin new: it prints the commands the page shows
    out = shell(new_command.replace("my_source", source), tmp_path, env={"TREADLE_PROCESSORS": "steps"})
    commands = [line.strip() for line in out.splitlines() if line.startswith("  ")]
    assert commands == [c.replace("my_source", source) for c in printed], "the page's commands are what it prints"
    install, enable, see_rows = commands
    out = shell(f"treadle plugin new {evaluator} --kind evaluator", tmp_path, env={"TREADLE_PROCESSORS": "steps"})
    install_evaluator, _, see_metrics = [line.strip() for line in out.splitlines() if line.startswith("  ")]

    # 2. pip install -e ./NAME, and the plugin's own test passes (README: `pytest my_source`)
    shell(install, tmp_path)
    shell(install_evaluator, tmp_path)
    assert "2 passed" in shell(f"pytest {source}", tmp_path)
    listed = shell("treadle processors --json", tmp_path)
    assert f'"name": "{source}"' in listed and f'"name": "{evaluator}"' in listed

    # 3. enable it: TREADLE_PROCESSORS as the printed command sets it, with the evaluator added
    [assignment] = [a for a in shlex.split(enable) if a.startswith("TREADLE_PROCESSORS=")]
    enabled = (*assignment.split("=", 1)[1].split(","), evaluator)
    assert enabled == ("steps", source, evaluator)
    settings = deployment.model_copy(update={"processors": enabled})
    worker = worker_factory(settings).start()
    worker.wait_ready()
    assert f"{source} (reward_source, {source.replace('_', '-')} 0.1.0)" in worker.log_tail(200)

    # 4. agents send events with the SDK; the source's rewards are woven into the steps, the evaluator's rows land
    session = f"tutorial-{os.getpid()}"
    steps = asyncio.run(agent_session(settings, session))

    def woven() -> dict:
        found = step_components(settings, session, source)
        return found if all(found.get(lid, {}).get("components") for lid in steps) else {}

    components = wait_for(woven, 90, f"{source}'s components in transitions_latest", explain=worker.log_tail)
    assert [[v for v, _, _ in components[lid]["components"].values()] for lid in steps] == [[1.0], [-1.0], [1.0]]
    assert [components[lid]["reward"] for lid in steps] == [1.0, -1.0, 1.0]

    def metrics() -> list:
        sql = f"SELECT logical_event_id, metric, value FROM evaluation_metrics_latest WHERE evaluator = '{evaluator}'"
        rows = run_sql(settings, sql)[1]
        return rows if len(rows) == 3 else []

    rows = wait_for(metrics, 60, f"{evaluator}'s rows in evaluation_metrics_latest", explain=worker.log_tail)
    expected = [(lid, "output_chars", float(len(f"answer {i}"))) for i, lid in enumerate(steps)]
    assert sorted(map(tuple, rows)) == sorted(expected)

    # 5. the printed query shows the rows
    for query_command, expected in ((see_rows, steps[0]), (see_metrics, "output_chars")):
        sql = shlex.split(query_command)[2]
        shown = treadle(settings, "sql", sql)
        assert shown.returncode == 0 and expected in shown.stdout, shown.stdout + shown.stderr
