"""`treadle explain` on real chDB rows: woven rewards written by the sink writer, read back and rendered.

The rows are what the step assembler will publish: components and explanation fields from processors.steps.fusion.
One chDB path for the module (chDB allows one per process), in the default database, so the CLI, run in this
process through typer's CliRunner, reads the same rows through run_sql as a user's `treadle explain` would.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from functools import partial
from typing import Any

import orjson
import pytest
from rich.console import Console
from typer.testing import CliRunner

from processors.steps.fusion import Component, Fused, FusionPolicy, FusionRule, fuse
from sinks import migrations
from sinks.clickhouse import ClickHouseStore
from sinks.sql_client import run_sql
from sinks.writer import ClickHouseSink
from topics.settings import Settings
from treadle.cli import app
from treadle.reports.explain import ExplainError, explain_query, fetch_explanation, render, sql_literal

T0 = 1_760_000_000_000_000
LID = "0199c9a0-0000-7000-8000-00000000e1e1"
POLICY = FusionPolicy(
    rules=[
        FusionRule.model_validate(
            {
                "name": "compliance_high_negative",
                "kind": "scale",
                "match": {"source": "compliance", "attributes": {"priority": "high"}, "value_below": 0},
                "factor": 5,
                "override": True,
            }
        ),
        FusionRule(name="floor", kind="cap", min=-1.0),
    ],
    conflict_threshold=0.5,
)
JUDGE = Component("e-1", "llm_judge", "helpfulness", 0.8, 0.9, annotator="LLM", evidence="judge run 7",
                  event_time=T0 + 1_000_000)  # fmt: skip
COMPLIANCE = Component("e-2", "compliance", "policy", -0.4, 1.0, attributes={"priority": "high"},
                       evidence="ticket 12", lateness_ms=1500, event_time=T0 + 2_000_000)  # fmt: skip
LABEL = Component("e-3", "human_label", "overall", 0.5, 1.0, annotator="HUMAN", imputed=True,
                  event_time=T0 + 3_000_000)  # fmt: skip


def woven_record(lid: str, revision: int, fused: Fused, components: list[Component]) -> dict[str, Any]:
    return {
        "logical_event_id": lid,
        "session_id": "s-explain",
        "episode_id": "s-explain-ep1",
        "step": 3,
        "revision": revision,
        "value": fused.value,
        "status": "imputed" if fused.imputed else "complete",
        "fusion": fused.policy,
        "policy_version": "pi-7",
        "components": fused.component_records(),
        "woven_at": max(c.event_time for c in components),
        "reward_policy_version": f"rp-{revision}",
        **fused.explanation(),
    }


def transition_record(lid: str, reward: float) -> dict[str, Any]:
    return {
        "session_id": "s-explain", "step": 3, "logical_event_id": lid, "revision": 5, "agent_id": "support-bot",
        "episode_id": "s-explain-ep1", "trace_id": "", "policy_version": "pi-7", "tool": "refund",
        "params_json": "{}", "dispatched_at": T0, "tool_status": "OK", "output": "done", "error": None,
        "latency_ms": 12.0, "cost_usd": 0.0, "tokens_in": 0, "tokens_out": 0, "result_at": T0 + 12_000,
        "reward": reward, "reward_status": "imputed", "reward_revision": 2, "reward_components": [],
        "updated_at": T0 + 3_000_000,
    }  # fmt: skip


def legacy_record() -> dict[str, Any]:
    """A woven reward as written before the explanation fields existed (no contribution, no rules)."""
    components = [
        {"event_id": "x-1", "source": "judge", "name": "r", "value": 1.0, "confidence": 1.0, "weight": 0.25,
         "annotator": "LLM", "event_time": T0},
        {"event_id": "x-2", "source": "metric", "name": "r", "value": 0.2, "confidence": 1.0, "weight": 0.75,
         "annotator": "CODE", "event_time": T0},
    ]  # fmt: skip
    return {
        "logical_event_id": "legacy", "session_id": "s-old", "episode_id": "e", "step": 0, "revision": 2,
        "value": 0.4, "status": "complete", "fusion": "confidence_weighted_mean", "policy_version": "",
        "components": components, "woven_at": T0,
    }  # fmt: skip


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """Settings whose default database holds two revisions of LID's reward, its transition and a legacy row."""
    settings = Settings(home=tmp_path_factory.mktemp("explain-home"))
    first = fuse([JUDGE], POLICY)
    second = fuse([JUDGE, COMPLIANCE, LABEL], POLICY)
    assert first is not None and second is not None
    with ClickHouseStore.open(settings) as store:
        migrations.apply_migrations(store)
        sink = ClickHouseSink(store)
        sink.add("woven_rewards", woven_record(LID, 1, first, [JUDGE]))
        sink.add("woven_rewards", woven_record(LID, 2, second, [JUDGE, COMPLIANCE, LABEL]))
        sink.add("transitions", transition_record(LID, second.value))
        sink.add("woven_rewards", legacy_record())
        asyncio.run(sink.flush())
        yield settings


def test_explanation_reads_back_what_fusion_decided(home: Settings) -> None:
    second = fuse([JUDGE, COMPLIANCE, LABEL], POLICY)
    assert second is not None and second.value == -1.0  # -0.4 x 5 overrides the rest, then the floor caps it
    e = fetch_explanation(partial(run_sql, home), LID)

    assert (e.revision, e.revisions, e.value, e.status) == (2, [1, 2], -1.0, "imputed")
    assert (e.reward_policy_version, e.policy_version, e.step) == ("rp-2", "pi-7", 3)
    assert [c.event_id for c in e.components] == ["e-1", "e-2", "e-3"]
    assert [c.contribution for c in e.components] == [c.contribution for c in second.contributions]
    assert [c.adjusted_value for c in e.components] == [0.8, pytest.approx(-2.0), 0.5]
    assert [c.weight for c in e.components] == [0.0, 1.0, 0.0]
    assert [(c.lateness_ms, c.evidence, c.imputed) for c in e.components] == [
        (0, "judge run 7", False),
        (1500, "ticket 12", False),
        (0, None, True),
    ]
    assert e.rules_fired == ["compliance_high_negative", "floor"]
    assert e.rule_adjustment == pytest.approx(1.0)  # the cap lifted -2.0 to -1.0
    assert [(k.a_event_id, k.b_event_id) for k in e.conflicts] == [("e-1", "e-2"), ("e-2", "e-3")]
    assert e.conflicts[0].difference == pytest.approx(2.8)
    assert e.imputed == ["human_label"]
    assert e.transition is not None and e.transition["revision"] == 5 and e.transition["tool"] == "refund"

    older = fetch_explanation(partial(run_sql, home), LID, revision=1)
    # The cap matches every component, but it changed nothing: it is not listed, and there is no adjustment.
    assert (older.revision, older.value, older.rules_fired, older.conflicts) == (1, 0.8, [], [])
    assert older.components[0].contribution == 0.8 and older.rule_adjustment == 0.0


def test_the_sink_endpoints_json_rows_give_the_same_explanation(home: Settings) -> None:
    """While a worker runs, run_sql goes through the sink's HTTP endpoint, which sends rows as orjson does."""

    def via_endpoint(sql: str) -> tuple[list[str], list[list[Any]]]:
        columns, rows = run_sql(home, sql)
        return columns, json.loads(orjson.dumps(rows, default=str))

    for revision in (None, 1):
        direct = fetch_explanation(partial(run_sql, home), LID, revision)
        assert fetch_explanation(via_endpoint, LID, revision) == direct
    assert direct.woven_at == "2025-10-09T08:53:21"


def test_rows_written_before_the_explanation_columns_read_as_defaults(home: Settings) -> None:
    e = fetch_explanation(partial(run_sql, home), "legacy")
    assert [c.contribution for c in e.components] == [0.25, pytest.approx(0.15)]
    assert [c.adjusted_value for c in e.components] == [1.0, 0.2]
    assert e.rule_adjustment == 0.0 and e.rules_fired == [] and e.reward_policy_version == ""
    assert e.transition is None


def test_unknown_ids_and_revisions_are_one_line_errors(home: Settings) -> None:
    with pytest.raises(ExplainError, match=r"^no woven reward for logical_event_id nope$"):
        fetch_explanation(partial(run_sql, home), "nope")
    with pytest.raises(ExplainError, match="at revision 9"):
        fetch_explanation(partial(run_sql, home), LID, revision=9)
    # Quotes in an id stay inside the literal.
    assert sql_literal("a'b\\") == "'a\\'b\\\\'"
    assert "'x\\' OR 1=1 --'" in explain_query("x' OR 1=1 --")
    with pytest.raises(ExplainError):
        fetch_explanation(partial(run_sql, home), "x' OR 1=1 --")


def test_render_shows_every_part(home: Settings) -> None:
    console = Console(record=True, width=220, file=io.StringIO())
    render(fetch_explanation(partial(run_sql, home), LID), console)
    text = console.export_text()
    for part in ("reward -1", "status imputed", "revision 2", "reward policy rp-2", "transition revision 5",
                 "compliance", "ticket 12", "1500 ms", "(rules)", "total", "1. compliance_high_negative",
                 "2. floor", "conflicts", "llm_judge/helpfulness (e-1)", "imputed: human_label"):  # fmt: skip
        assert part in text, part
    older = Console(record=True, width=220, file=io.StringIO())
    render(fetch_explanation(partial(run_sql, home), LID, revision=1), older)
    text = older.export_text()
    assert "revision 1 of 1, 2" in text and "rules fired: none" in text


def test_the_cli_prints_tables_json_and_one_line_errors(home: Settings) -> None:
    runner = CliRunner()
    env = {**home.to_env(), "COLUMNS": "220"}
    shown = runner.invoke(app, ["explain", LID], env=env)
    assert shown.exit_code == 0, shown.output
    assert "compliance_high_negative" in shown.stdout and "components" in shown.stdout

    as_json = runner.invoke(app, ["explain", LID, "--revision", "1", "--json"], env=env)
    assert as_json.exit_code == 0, as_json.output
    doc = json.loads(as_json.stdout)
    assert doc["revision"] == 1 and doc["revisions"] == [1, 2] and doc["value"] == 0.8
    assert doc["components"][0]["evidence"] == "judge run 7" and doc["transition"]["tool"] == "refund"

    missing = runner.invoke(app, ["explain", "nope"], env=env)
    assert missing.exit_code == 1
    assert missing.stderr.strip() == "error: no woven reward for logical_event_id nope"
