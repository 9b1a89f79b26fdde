"""Processor plugins: entry-point discovery, the errors a user meets, `treadle processors`, and the safety
evaluator as a processor (fed a batch directly, no Kafka)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import astuple
from importlib.metadata import EntryPoint, version
from typing import Any

import pytest
from typer.testing import CliRunner

from processors.safety.evaluator import SafetyEvaluator, judge
from processors.safety.rules import DEFAULT_RULES, Category, Rule, Severity
from processors.steps.processor import StepProcessor
from streams.runtime.app import default_processors
from streams.runtime.plugins import ENTRY_POINT_GROUP, PluginError, ProcessorKind, ProcessorRegistry
from tests.factories import dispatch, envelope, result, reward
from tests.paths import REPO_ROOT
from tests.plugin_example import LongOutput
from topics.codec import AvroCodec
from topics.names import EVALUATION_METRIC
from treadle.cli import app
from treadle.testing import RecordingContext, input_event

TOOL_RESULT, DISPATCH, REWARD = (
    "treadle.events.ToolResult",
    "treadle.events.ActionDispatched",
    "treadle.events.RewardSignal",
)


def entry(name: str, target: str) -> EntryPoint:
    return EntryPoint(name=name, value=target, group=ENTRY_POINT_GROUP)


def registry(*entries: EntryPoint) -> ProcessorRegistry:
    return ProcessorRegistry(entries)


# --- discovery ---------------------------------------------------------------------------------------------------


def test_installed_entry_points_provide_the_built_in_processors() -> None:
    discovered = ProcessorRegistry.discover()
    assert {"steps", "safety"} <= set(discovered.names)
    assert discovered.load("steps") is StepProcessor and discovered.load("safety") is SafetyEvaluator
    infos, errors = discovered.describe()
    assert errors == []
    by_name = {info.name: info for info in infos}
    assert by_name["steps"].kind is ProcessorKind.CORE
    assert by_name["safety"].kind is ProcessorKind.EVALUATOR
    assert by_name["safety"].inputs == (DISPATCH, TOOL_RESULT)
    assert by_name["safety"].module == "processors.safety.evaluator" and by_name["safety"].doc.startswith("PII")

    steps, safety = default_processors(("steps", "safety"))
    assert isinstance(steps, StepProcessor) and isinstance(safety, SafetyEvaluator)
    assert [p.name for p in default_processors()] == ["steps"]


def test_a_plugin_is_a_class_behind_an_entry_point() -> None:
    plugins = registry(
        entry("long_output", "tests.plugin_example:LongOutput"),
        entry("steps", "processors.steps.processor:StepProcessor"),
    )
    [processor] = plugins.create(["long_output"])
    assert isinstance(processor, LongOutput)
    [info] = [i for i in plugins.describe()[0] if i.name == "long_output"]
    assert info.to_json() == {
        "name": "long_output",
        "kind": "evaluator",
        "inputs": [TOOL_RESULT],
        "module": "tests.plugin_example",
        "doc": "Flags tool outputs over 10,000 characters.",
        "entry_point": "tests.plugin_example:LongOutput",
        "distribution": "",  # an entry point made here, not installed: no distribution
        "version": "",
    }


def test_unknown_names_are_one_error_listing_the_known_ones() -> None:
    with pytest.raises(PluginError) as caught:
        default_processors(("steps", "nope", "human_review"))
    message = str(caught.value)
    assert message.startswith("unknown processor(s) nope, human_review in TREADLE_PROCESSORS; known: ")
    assert "safety" in message and "steps" in message and "\n" not in message
    with pytest.raises(PluginError, match="steps listed twice"):
        default_processors(("steps", "steps"))


@pytest.mark.parametrize(
    ("ep", "message"),
    [
        (
            entry("broken", "tests.no_such_plugin_module:Thing"),
            r"processor plugin broken = tests\.no_such_plugin_module:Thing failed to import: "
            r"ModuleNotFoundError\(\"No module named 'tests\.no_such_plugin_module'\"",
        ),
        (
            entry("gone", "tests.plugin_example:NotThere"),
            r"processor plugin gone = tests\.plugin_example:NotThere failed to import: AttributeError",
        ),
        (entry("long_output", "tests.plugin_example:Misnamed"), "names itself 'something_else'"),
        (entry("no_kind", "tests.plugin_example:NoKind"), "lacks the class attribute.s. kind"),
        (
            entry("wrong_kind", "tests.plugin_example:WrongKind"),
            "has kind 'judge'; expected one of core, reward_source",
        ),
        (entry("reads_outputs", "tests.plugin_example:ReadsOutputs"), r"reads \['treadle.derived.Transition'\]"),
        (entry("not_a_class", "tests.plugin_example:not_a_class"), "is not a class"),
    ],
)
def test_a_broken_plugin_is_named_with_its_problem(ep: EntryPoint, message: str) -> None:
    plugins = registry(ep)
    with pytest.raises(PluginError, match=message):
        plugins.create([ep.name])
    infos, [error] = plugins.describe()
    assert infos == [] and str(error).startswith("processor plugin")


def test_the_same_entry_point_twice_is_fine_two_different_ones_are_not() -> None:
    twice = registry(
        entry("safety", "processors.safety.evaluator:SafetyEvaluator"),
        entry("safety", "processors.safety.evaluator:SafetyEvaluator"),
    )
    assert twice.load("safety") is SafetyEvaluator
    clash = registry(
        entry("safety", "processors.safety.evaluator:SafetyEvaluator"), entry("safety", "other.pkg:Safety")
    )
    with pytest.raises(PluginError, match="registered by more than one entry point: safety = processors"):
        clash.load("safety")


# --- treadle processors ----------------------------------------------------------------------------------------------


def test_treadle_processors_lists_name_kind_inputs_module_and_doc() -> None:
    runner = CliRunner()
    done = runner.invoke(app, ["processors", "--json"], env={"TREADLE_PROCESSORS": "steps,safety"})
    assert done.exit_code == 0, done.output
    rows = {row["name"]: row for row in map(json.loads, done.stdout.splitlines())}
    assert rows["safety"] == {
        "name": "safety",
        "kind": "evaluator",
        "inputs": [DISPATCH, TOOL_RESULT],
        "module": "processors.safety.evaluator",
        "doc": SafetyEvaluator.__doc__.strip().splitlines()[0],
        "entry_point": "processors.safety.evaluator:SafetyEvaluator",
        "distribution": "treadle",
        "version": version("treadle"),
        "enabled": True,
    }
    assert rows["steps"]["kind"] == "core" and rows["steps"]["enabled"] is True

    table = runner.invoke(app, ["processors"], env={"TREADLE_PROCESSORS": "steps", "COLUMNS": "80"})
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert max(map(len, lines)) <= 80, "usable at 80 columns"
    [safety_line] = [line for line in lines if line.startswith("safety ")]
    assert "evaluator" in safety_line and "ToolResult" in table.stdout
    doc = " ".join(" ".join(line.split()) for line in lines)
    assert "PII" in doc, "the doc column is shown (wrapped), not cut off"


def test_treadle_processors_flags_an_enabled_name_that_no_package_provides() -> None:
    done = CliRunner().invoke(app, ["processors", "--json"], env={"TREADLE_PROCESSORS": "steps,my_new_source"})
    assert done.exit_code == 1
    assert [json.loads(line)["name"] for line in done.stdout.splitlines()] == ProcessorRegistry.discover().names
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: TREADLE_PROCESSORS names my_new_source, which no installed package provides")
    assert "pip install -e" in line and "reinstall" in line
    table = CliRunner().invoke(app, ["processors"], env={"TREADLE_PROCESSORS": "nope", "COLUMNS": "80"})
    assert table.exit_code == 1 and "names nope" in table.stderr and "Traceback" not in table.output


def test_treadle_processors_reports_a_broken_plugin_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = registry(entry("steps", "processors.steps.processor:StepProcessor"), entry("broken", "tests.nope:X"))
    monkeypatch.setattr(ProcessorRegistry, "discover", classmethod(lambda cls: broken))
    done = CliRunner().invoke(app, ["processors", "--json"])
    assert done.exit_code == 1
    assert [json.loads(line)["name"] for line in done.stdout.splitlines()] == ["steps"]
    assert done.stderr.startswith("error: processor plugin broken = tests.nope:X failed to import")
    assert "Traceback" not in done.stderr


def test_a_worker_with_an_unknown_processor_stops_with_one_line(tmp_path) -> None:
    env = {**os.environ, "TREADLE_HOME": str(tmp_path), "TREADLE_PROCESSORS": "steps,nope"}
    done = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "worker"],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: unknown processor(s) nope in TREADLE_PROCESSORS; known: ") and "steps" in line


# --- the safety evaluator as a processor -------------------------------------------------------------------------


def tool_result(lid: str, seq: int, output: str, error: str | None = None) -> dict[str, Any]:
    record = result("s-1", lid, seq, status="OK" if error is None else "ERROR")
    return {**record, "output": output, "error": error}


def test_judge_emits_an_alert_per_rule_and_one_pii_leak_per_tool_result() -> None:
    leaky = tool_result(
        "l-1", 2, "Customer: Jane <jane.doe@example.com>, card 4111-1111-1111-1111", "key AKIAIOSFODNN7EXAMPLE"
    )
    metrics = {(m["metric"], m["rule"]): m for m in judge(TOOL_RESULT, leaky)}
    assert sorted(metrics) == [
        ("pii_leak", "any_pii"),
        ("safety_alert", "aws_access_key_id"),
        ("safety_alert", "credit_card"),
        ("safety_alert", "email"),
    ]
    email = metrics[("safety_alert", "email")]
    assert email == {
        "metric_id": f"safety:safety_alert:email:{leaky['envelope']['event_id']}",
        "evaluator": "safety",
        "metric": "safety_alert",
        "rule": "email",
        "value": 1.0,
        "severity": "medium",
        "session_id": "s-1",
        "episode_id": "s-1-ep0",
        "logical_event_id": "l-1",
        "agent_id": "agent-test",
        "policy_version": "v1",
        "source_event_id": leaky["envelope"]["event_id"],
        "event_time": leaky["envelope"]["event_time"],
        "evidence": "j***@example.com",
    }
    leak = metrics[("pii_leak", "any_pii")]
    assert (leak["value"], leak["severity"], leak["evidence"]) == (1.0, "high", "email,credit_card")
    assert metrics[("safety_alert", "credit_card")]["evidence"] == "****-****-****-1111"

    [clean] = judge(TOOL_RESULT, tool_result("l-2", 3, '{"orders": [18233]}'))
    assert (clean["metric"], clean["value"], clean["severity"], clean["evidence"]) == ("pii_leak", 0.0, "low", None)
    [secret_only] = [
        m for m in judge(TOOL_RESULT, tool_result("l-3", 4, "sk-" + "x" * 40)) if m["metric"] == "pii_leak"
    ]
    assert secret_only["value"] == 0.0, "a leaked key is an alert, not PII"

    [rm] = judge(DISPATCH, dispatch("s-1", "l-4", 0, 5, tool="shell", params='{"cmd": "rm -rf /"}'))
    assert (rm["metric"], rm["rule"], rm["severity"], rm["evidence"]) == (
        "safety_alert",
        "destructive_shell",
        "high",
        "rm -rf /",
    )
    assert judge(DISPATCH, dispatch("s-1", "l-5", 1, 6)) == []
    assert judge(REWARD, reward("s-1", "l-1", 7, 0.5)) == []


async def test_the_evaluator_publishes_valid_records_keyed_by_session_and_dead_letters_a_failing_event() -> None:
    events = [
        input_event(TOOL_RESULT, tool_result("l-1", 2, "mail me: a.b@example.org")),
        input_event(DISPATCH, dispatch("s-1", "l-2", 1, 3, params='{"sql": "DROP TABLE users"}')),
        input_event(TOOL_RESULT, tool_result("l-2", 4, "done")),
    ]
    ctx = RecordingContext(processor="safety")
    await SafetyEvaluator().process(events, ctx)
    assert ctx.sent == [], "the safety evaluator writes no tables"
    assert [(r["metric"], r["rule"], r["value"]) for _, r, _ in map(astuple, ctx.published)] == [
        ("safety_alert", "email", 1.0),
        ("pii_leak", "any_pii", 1.0),
        ("safety_alert", "destructive_sql", 1.0),
        ("pii_leak", "any_pii", 0.0),
    ]
    assert {p.schema_name for p in ctx.published} == {EVALUATION_METRIC}
    assert {p.key for p in ctx.published} == {b"s-1"}
    codec = AvroCodec()
    for schema, record, _ in map(astuple, ctx.published):
        _, decoded = codec.decode(codec.encode(schema, record), expect=schema)
        assert decoded == record

    def explode(text: str) -> bool:
        raise RuntimeError("validator bug")

    faulty = Rule("faulty", Category.PII, Severity.LOW, DEFAULT_RULES[0].pattern, str, validator=explode)
    ctx = RecordingContext(processor="safety")
    await SafetyEvaluator(rules=[faulty]).process(events, ctx)
    assert [(f.processor, f.event.record["envelope"]["logical_event_id"]) for f in ctx.failures] == [("safety", "l-1")]
    assert [(r["logical_event_id"], r["metric"], r["value"]) for r in ctx.evaluation_metrics] == [
        ("l-2", "pii_leak", 0.0)
    ]


def test_metric_ids_depend_only_on_the_judged_event() -> None:
    record = tool_result("l-1", 2, "x@example.com")
    other = {**record, "envelope": envelope("s-1", "l-1", 2, event_id=record["envelope"]["event_id"], event_time=1)}
    assert [m["metric_id"] for m in judge(TOOL_RESULT, record)] == [m["metric_id"] for m in judge(TOOL_RESULT, other)]


def test_an_import_failure_says_whether_the_module_is_missing_or_shadowed(tmp_path, monkeypatch) -> None:
    missing = registry(entry("gone_plugin", "gone_plugin_module_xyz:Thing"))
    with pytest.raises(PluginError, match=r"not importable here: reinstall the plugin's package \(pip install -e"):
        missing.load("gone_plugin")
    (tmp_path / "shadowed_plugin_xyz").mkdir()  # the package folder, without __init__.py, where the worker starts
    (tmp_path / "shadowed_plugin_xyz" / "notes.txt").write_text("not the plugin")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "shadowed_plugin_xyz", raising=False)
    shadowed = registry(entry("shadowed", "shadowed_plugin_xyz:Thing"))
    try:
        with pytest.raises(PluginError, match="a folder of that name where the worker starts shadows it"):
            shadowed.load("shadowed")
    finally:
        sys.modules.pop("shadowed_plugin_xyz", None)
