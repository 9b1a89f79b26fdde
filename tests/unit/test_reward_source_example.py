"""docs/plugins.md's "Attach a new reward source" example, run as written: a plugin that publishes valid signals."""

from __future__ import annotations

import re
import sys
import types

import pytest

from streams.runtime.plugins import ProcessorKind
from tests.factories import result
from tests.integration.test_plugins import Recorder, entry, input_event, registry
from tests.paths import REPO_ROOT
from topics.codec import AvroCodec

REWARD, RESULT = "treadle.events.RewardSignal", "treadle.events.ToolResult"


@pytest.fixture
def my_source(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    page = (REPO_ROOT / "docs" / "plugins.md").read_text()
    [code] = re.findall(r"```python\n(# my_source/__init__\.py\n.*?)```", page, flags=re.DOTALL)
    module = types.ModuleType("my_source")
    exec(compile(code, "docs/plugins.md:my_source", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "my_source", module)
    entry_point = re.search(r'fast_tools = "(my_source:FastTools)"', page)
    assert entry_point is not None, "the page's entry point"
    return module


async def test_the_documented_reward_source_is_a_plugin_that_publishes_valid_signals(my_source) -> None:
    plugins = registry(entry("fast_tools", "my_source:FastTools"))
    [source] = plugins.create(["fast_tools"])
    [info] = plugins.describe()[0]
    assert (info.kind, info.inputs) == (ProcessorKind.REWARD_SOURCE, (RESULT,))
    fast, slow = result("s-1", "l-1", 2, latency=12.5), result("s-1", "l-2", 4, latency=2500.0)
    ctx = Recorder()
    await source.process([input_event(RESULT, fast), input_event(RESULT, slow)], ctx)
    await source.process([input_event(RESULT, fast)], ctx)
    (s1, r1, k1), (s2, r2, _), (_, again, _) = ctx.published
    assert (s1, s2, k1) == (REWARD, REWARD, b"s-1")
    assert [(r["envelope"]["logical_event_id"], r["value"], r["evidence"]) for r in (r1, r2)] == [
        ("l-1", 1.0, "12 ms"),
        ("l-2", -1.0, "2500 ms"),
    ]
    assert r1["envelope"]["event_time"] == fast["envelope"]["event_time"]
    assert again == r1, "the same judged event gives the same signal (event_id included)"
    assert r1["envelope"]["event_id"] != fast["envelope"]["event_id"]
    codec = AvroCodec()
    for record in (r1, r2):
        assert codec.decode(codec.encode(REWARD, record), expect=REWARD)[1] == record
