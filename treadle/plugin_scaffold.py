"""`treadle plugin new`: a complete, installable processor-plugin package from the templates (package data).

The package is laid out so the traps a first plugin meets cannot happen: a pyproject with a build system, a name and
a version; the module under src/ so the folder commands run from never shadows the installed one; an entry point
named as the class's `name`; and a unit test that runs against `treadle.testing` without Kafka.
"""

from __future__ import annotations

import importlib.util
import keyword
import re
from dataclasses import dataclass
from enum import StrEnum
from importlib.resources import files
from pathlib import Path

NAME = re.compile(r"[a-z][a-z0-9_]{0,62}")


class PluginKind(StrEnum):
    REWARD_SOURCE = "reward-source"
    EVALUATOR = "evaluator"
    PROCESSOR = "processor"


SUMMARIES = {
    PluginKind.REWARD_SOURCE: "Rewards each tool call: +1 when it succeeded, -1 otherwise.",
    PluginKind.EVALUATOR: "Measures each tool output's length (the output_chars metric).",
    PluginKind.PROCESSOR: "Counts failed tool calls per episode and reports the count when the episode ends.",
}
TEMPLATES = {
    PluginKind.REWARD_SOURCE: "reward_source",
    PluginKind.EVALUATOR: "evaluator",
    PluginKind.PROCESSOR: "processor",
}


class ScaffoldError(ValueError):
    """A name or folder `treadle plugin new` cannot use; the message says why."""


@dataclass(frozen=True)
class Scaffold:
    """What was written, and the commands that install it, enable it and show its rows."""

    folder: Path
    files: list[Path]
    commands: list[str]


def check_name(name: str) -> None:
    if not NAME.fullmatch(name) or keyword.iskeyword(name):
        raise ScaffoldError(
            f"plugin name {name!r} must be a lowercase Python identifier (letters, digits, _), e.g. my_source: it "
            "names the module, the entry point and the TREADLE_PROCESSORS entry"
        )
    if importlib.util.find_spec(name) is not None:
        raise ScaffoldError(f"a module named {name!r} is already importable here; pick another name so the plugin's "
                            "module is not shadowed by it (or does not shadow it)")  # fmt: skip


def class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_") if part) or "Plugin"


def rows_sql(name: str, kind: PluginKind) -> str:
    """A query that shows what the plugin wrote, once the worker runs it."""
    if kind is PluginKind.REWARD_SOURCE:
        return ("SELECT logical_event_id, reward, reward_components.value FROM transitions_latest "
                f"WHERE has(reward_components.source, '{name}') LIMIT 10")  # fmt: skip
    return f"SELECT logical_event_id, metric, value FROM evaluation_metrics_latest WHERE evaluator = '{name}' LIMIT 10"


def render(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", value)
    return text


def new_plugin(name: str, kind: PluginKind, folder: Path, enabled: tuple[str, ...] = ("steps",)) -> Scaffold:
    """Write the plugin package `name` into `folder` (which must not exist, or be empty)."""
    check_name(name)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ScaffoldError(f"{folder} already exists and is not an empty folder; pass another --dir")
    enable = ",".join([*(p for p in enabled if p != name), name])
    values = {
        "name": name,
        "module": name,
        "dist": name.replace("_", "-"),
        "cls": class_name(name),
        "kind": str(kind),
        "summary": SUMMARIES[kind],
        "enable": enable,
        "rows_sql": rows_sql(name, kind),
    }
    templates = files("treadle") / "plugin_template"
    stem = TEMPLATES[kind]
    layout = {
        "pyproject.toml": "pyproject.toml.tmpl",
        "README.md": "README.md.tmpl",
        f"src/{name}/__init__.py": f"{stem}.py.tmpl",
        f"tests/test_{name}.py": f"test_{stem}.py.tmpl",
    }
    written = []
    for target, template in layout.items():
        path = folder / target
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render((templates / template).read_text(), values))
        written.append(path)
    commands = [
        f"pip install -e {_shown(folder)}",
        f"TREADLE_PROCESSORS={enable} treadle worker",
        f'treadle sql "{values["rows_sql"]}"',
    ]
    return Scaffold(folder, written, commands)


def _shown(folder: Path) -> str:
    """The folder as the user would type it: relative to the current directory when it is below it."""
    try:
        relative = folder.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return str(folder)
    return f"./{relative}" if str(relative) != "." else "."
