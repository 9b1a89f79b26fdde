"""`treadle plugin new`: each kind renders a complete package whose own unit test passes, in under a second, using
only the public testing module (issue 30)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.paths import REPO_ROOT
from treadle.cli import app
from treadle.plugin_scaffold import PluginKind, ScaffoldError, new_plugin

KINDS = {
    PluginKind.REWARD_SOURCE: "reward_source",
    PluginKind.EVALUATOR: "evaluator",
    PluginKind.PROCESSOR: "evaluator",  # a stateful skeleton; it declares the kind of what it emits
}


@pytest.mark.parametrize("kind", list(PluginKind))
def test_each_kind_is_an_installable_package_whose_test_passes_in_under_a_second(kind: PluginKind, tmp_path) -> None:
    name = f"tmpl_{kind.name.lower()}"
    made = new_plugin(name, kind, tmp_path / name)
    root = made.folder
    assert sorted(p.relative_to(root).as_posix() for p in made.files) == [
        "README.md",
        "pyproject.toml",
        f"src/{name}/__init__.py",
        f"tests/test_{name}.py",
    ]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert project["build-system"]["build-backend"] == "setuptools.build_meta"
    assert project["project"]["name"] == name.replace("_", "-") and project["project"]["version"]
    [(entry, target)] = project["project"]["entry-points"]["treadle.processors"].items()
    cls = "".join(part.capitalize() for part in name.split("_"))
    assert (entry, target) == (name, f"{name}:{cls}")
    assert project["tool"]["setuptools"]["packages"]["find"]["where"] == ["src"], "src layout: nothing shadows it"
    assert not (root / name).exists()

    test_file = root / "tests" / f"test_{name}.py"
    imported = {
        node.module
        for node in ast.walk(ast.parse(test_file.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert imported == {"treadle.testing", name}, "the plugin's test uses only the public testing module"

    report = tmp_path / "report.xml"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", str(root)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},  # this checkout's treadle, as an installed one would be
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    cases = ET.parse(report).getroot().iter("testcase")
    times = {case.get("name"): float(case.get("time", "0")) for case in cases}
    assert times and all(seconds < 1.0 for seconds in times.values()), times

    sys.path.insert(0, str(root / "src"))
    try:
        module = __import__(name)
        assert getattr(module, cls).kind == KINDS[kind]
    finally:
        sys.path.remove(str(root / "src"))
        sys.modules.pop(name, None)


def test_the_command_prints_the_three_commands_and_refuses_bad_names(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    done = runner.invoke(app, ["plugin", "new", "my_judge", "--kind", "evaluator"], env={"TREADLE_PROCESSORS": ""})
    assert done.exit_code == 0, done.output
    commands = [line.strip() for line in done.stdout.splitlines() if line.startswith("  ")]
    assert commands == [
        "pip install -e ./my_judge",
        "TREADLE_PROCESSORS=steps,my_judge treadle worker",
        'treadle sql "SELECT logical_event_id, metric, value FROM evaluation_metrics_latest '
        "WHERE evaluator = 'my_judge' LIMIT 10\"",
    ]
    assert (tmp_path / "my_judge" / "src" / "my_judge" / "__init__.py").is_file()

    again = runner.invoke(app, ["plugin", "new", "my_judge"])
    assert again.exit_code == 1 and again.stderr.startswith("error: my_judge already exists")
    for bad, message in [
        (["plugin", "new", "My-Judge"], "error: plugin name 'My-Judge' must be a lowercase Python identifier"),
        (["plugin", "new", "json"], "error: a module named 'json' is already importable here"),
        (["plugin", "new", "x1", "--kind", "judge"], "error: --kind 'judge': expected one of reward-source"),
    ]:
        refused = runner.invoke(app, bad)
        assert refused.exit_code == 1 and refused.stderr.startswith(message), refused.output
        assert "Traceback" not in refused.output


def test_enabled_processors_are_kept_in_the_enable_command(tmp_path) -> None:
    made = new_plugin("my_src", PluginKind.REWARD_SOURCE, tmp_path / "x", enabled=("steps", "safety"))
    assert made.commands[1] == "TREADLE_PROCESSORS=steps,safety,my_src treadle worker"
    with pytest.raises(ScaffoldError, match="lowercase Python identifier"):
        new_plugin("class", PluginKind.EVALUATOR, tmp_path / "y")


def test_the_templates_are_package_data() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["package-data"]["treadle"]
    templates = Path(REPO_ROOT / "treadle" / "plugin_template")
    assert all(any(p.match(pattern.split("/", 1)[1]) for pattern in patterns) for p in templates.iterdir())
