"""docs/plugins.md's tutorial is what `treadle plugin new` writes and prints, and its reward source, run as written
through the public testing module, publishes valid signals. (tests/integration/test_plugin_tutorial.py runs the
tutorial's commands on the real stack.)"""

from __future__ import annotations

import re
import sys
import types

import pytest

from streams.runtime.plugins import ENTRY_POINT_GROUP, ProcessorKind, ProcessorRegistry
from tests.paths import REPO_ROOT
from topics.codec import AvroCodec
from treadle.plugin_scaffold import PluginKind, new_plugin
from treadle.testing import run, tool_result

PAGE = REPO_ROOT / "docs" / "plugins.md"
REWARD, RESULT = "treadle.events.RewardSignal", "treadle.events.ToolResult"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)


def tutorial_commands() -> tuple[str, list[str]]:
    """The tutorial's `treadle plugin new` line and the three commands it says are printed (comments dropped)."""
    new, printed = (
        [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()] for block in blocks("bash")[:2]
    )
    [command] = new
    return command, printed


def test_the_page_shows_what_the_command_writes_and_prints(tmp_path, monkeypatch) -> None:
    command, printed = tutorial_commands()
    assert command == "treadle plugin new my_source --kind reward-source"
    monkeypatch.chdir(tmp_path)
    made = new_plugin("my_source", PluginKind.REWARD_SOURCE, tmp_path / "my_source")
    assert printed == made.commands
    code, test = blocks("python")[:2]
    assert code == (made.folder / "src" / "my_source" / "__init__.py").read_text()
    assert test == (made.folder / "tests" / "test_my_source.py").read_text()


@pytest.fixture
def my_source(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("my_source")
    exec(compile(blocks("python")[0], "docs/plugins.md:my_source", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "my_source", module)
    return module


async def test_the_documented_reward_source_is_a_plugin_that_publishes_valid_signals(my_source) -> None:
    from importlib.metadata import EntryPoint

    plugins = ProcessorRegistry([EntryPoint("my_source", "my_source:MySource", ENTRY_POINT_GROUP)])
    [source] = plugins.create(["my_source"])
    [info] = plugins.describe()[0]
    assert (info.kind, info.inputs) == (ProcessorKind.REWARD_SOURCE, (RESULT,))
    ok, failed = tool_result(latency_ms=12.5), tool_result(status="ERROR", error="boom", latency_ms=2500.0)
    ctx = await run(source, ok, failed, ok)
    first, second, again = ctx.rewards
    assert [(r["envelope"]["logical_event_id"], r["value"], r["evidence"]) for r in (first, second)] == [
        (ok.record["envelope"]["logical_event_id"], 1.0, "search OK in 12 ms"),
        (failed.record["envelope"]["logical_event_id"], -1.0, "search ERROR in 2500 ms"),
    ]
    assert first["envelope"]["event_time"] == ok.record["envelope"]["event_time"]
    assert again == first, "the same judged event gives the same signal (event_id included)"
    assert first["envelope"]["event_id"] != ok.record["envelope"]["event_id"]
    assert {p.key for p in ctx.published} == {b"session-1"}
    codec = AvroCodec()
    for record in (first, second):
        assert codec.decode(codec.encode(REWARD, record), expect=REWARD)[1] == record
