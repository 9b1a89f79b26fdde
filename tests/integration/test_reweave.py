"""Re-weaving history and backfill on the real stack: a worker (steps + the tutorial's reward source) weaves past
events, and re-weaves are compared with its rows: while it runs (its sink owns the embedded chDB, so the re-weave
reads through its SQL service and writes through its /variant endpoint), and once it stopped (directly).

- re-weaving with the live policy gives exactly the live final rows (transitions, woven rewards, late rewards);
- a changed policy changes the reward of exactly the steps it affects, and no live row changes;
- a backfill of the reward source over the past events gives the rows it gave when it ran live;
- `treadle export --variant` exports a variant's rows.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from processors.steps.policy import RewardPolicy
from sinks.export_sql import ExportFilters, Shape, shape_sql
from sinks.sql_client import QueryFailedError, post_json, run_sql, run_sql_arrow
from streams.runtime.plugins import ProcessorRegistry
from streams.runtime.run_info import SqlEndpoint
from streams.runtime.worker import prepare_cluster
from tests.conftest import PORT_BASE
from tests.factories import RawProducer, dispatch, result, reward, treadle, wait_for
from topics.ids import uuid7
from topics.settings import Settings
from treadle.devstack.worker_process import WorkerProcess
from treadle.reweave import backfill, reweave_history

S = 1_000_000
DISPATCH, RESULT, REWARD = "treadle.events.ActionDispatched", "treadle.events.ToolResult", "treadle.events.RewardSignal"
POLICY = {
    "version": "reweave-live-1",
    "default_window_s": 1000,
    "orphan_wait_s": 30,
    "specs": [
        {"source": "judge", "window_s": 10, "grace_s": 5, "required": True},
        {"source": "human", "window_s": 100, "required": True, "imputation": "default", "default_value": 0.0},
        {"source": "tool_success", "window_s": 60, "weight": 0.5},
    ],
}
DEADLINE_S = {"judge": 15, "human": 100, "tool_success": 60, "metric": 1000}
SOURCE_ENTRY = "tool_success = tests.plugin_example:ToolSuccess"


@dataclass
class History:
    settings: Settings
    steps: int  # dispatched steps
    results: int  # tool results (each gets a tool_success signal)
    worker: WorkerProcess


def plugin_site(root: Path) -> Path:
    """A folder whose dist-info declares the tutorial's reward source, as an installed plugin looks to
    importlib.metadata; the worker gets it on PYTHONPATH."""
    info = root / "site" / "tool_success-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tool-success\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[treadle.processors]\n{SOURCE_ENTRY}\n")
    return root / "site"


def workload(seed: int = 22) -> tuple[list[tuple[str, dict]], int, int, int, int]:
    """(events, dispatched steps, tool results, late rewards, the final revision sum of the transitions): steps of
    three sessions three days ago (the idle watermark passes every window), rewards early, in window, in grace and
    after it, some steps never dispatched (their rewards are orphans)."""
    rng = random.Random(seed)
    base = int(time.time() * S) - 3 * 86_400 * S
    events, steps, results, late, revisions = [], 0, 0, 0, 0
    for s in range(3):
        session, seq = f"rw{s}-{uuid7()[-10:]}", 0
        for k in range(6):
            lid, at = uuid7(), base + (s * 1000 + k * 30) * S
            dispatched = rng.random() > 0.12
            on_time = 0
            if dispatched:
                record = dispatch(session, lid, k, seq := seq + 1)
                record["envelope"]["event_time"] = at
                events.append((DISPATCH, record))
                steps += 1
                if rng.random() > 0.2:
                    record = result(session, lid, seq := seq + 1, rng.choice(["OK", "OK", "ERROR"]))
                    record["envelope"]["event_time"] = at + S
                    events.append((RESULT, record))
                    results += 1
                    on_time += 2  # the result, and its tool_success signal
            for source, delays in (("judge", [2, 9, 14, 16, 40]), ("human", [50, 99, 150]), ("metric", [5])):
                if rng.random() < (0.9 if source == "judge" else 0.5):
                    delay = rng.choice(delays)
                    value = rng.choice([-1.0, 0.0, 0.5, 1.0])
                    record = reward(session, lid, seq := seq + 1, value, source, rng.choice([0.5, 1.0]))
                    record["envelope"]["event_time"] = at + delay * S
                    events.append((REWARD, record))
                    in_time = dispatched and delay <= DEADLINE_S[source]
                    on_time += in_time
                    late += not in_time
            if dispatched:
                revisions += 1 + on_time + 2  # the dispatch, the rest in time, both required windows
    rng.shuffle(events)
    return events, steps, results, late, revisions


async def produce(settings: Settings, events: list[tuple[str, dict]]) -> None:
    async with RawProducer(settings) as producer:
        for name, record in events:
            await producer.send(name, record)
        await producer.flush()


@pytest.fixture(scope="module")
def history(stack: Settings, tmp_path_factory: pytest.TempPathFactory):
    """A worker that has woven the workload: its rows are final; it runs until the module's last test stops it."""
    home = tmp_path_factory.mktemp("reweave")
    policy = home / "policy.json"
    policy.write_text(json.dumps(POLICY))
    name = f"treweave{os.getpid()}"
    settings = stack.model_copy(
        update={
            "home": home / "home", "topic_prefix": name, "app_id": name, "processors": ("steps", "tool_success"),
            "reward_policy": policy, "idle_timeout_s": 2.0, "watermark_lag_s": 1.0, "window_tick_s": 0.5,
            "web_port": PORT_BASE - 1340, "sql_port": PORT_BASE - 1290, "sink_flush_seconds": 0.2,
        }
    )  # fmt: skip
    asyncio.run(prepare_cluster(settings))
    events, steps, results, late, revisions = workload()
    worker = WorkerProcess(settings, settings.home / "worker.log", env={"PYTHONPATH": str(plugin_site(home))})
    worker.start()
    try:
        worker.wait_ready()
        asyncio.run(produce(settings, events))
        want = [[steps, 0, revisions, late, results]]
        query = (
            "SELECT (SELECT count() FROM transitions_latest), "
            "(SELECT countIf(reward_status = 'pending') FROM transitions_latest), "
            "(SELECT sum(revision) FROM transitions_latest), (SELECT count() FROM late_rewards_latest), "
            "(SELECT count() FROM reward_components_latest WHERE source = 'tool_success')"
        )
        wait_for(lambda: run_sql(settings, query)[1] == want, 180, f"every step final: {want}",
                 explain=lambda: f"{run_sql(settings, query)[1]}\n{worker.log_tail(40)}")  # fmt: skip
        yield History(settings, steps, results, worker)
    finally:
        worker.stop()


def rows(settings: Settings, table: str, variant: str, order: str, where: str = "1") -> list[dict]:
    """A table's current rows of one variant (live: its *_latest view), without the variant column."""
    source = f"{table}_latest" if variant == "live" else f"{table}_variants"
    sql = f"SELECT * EXCEPT (variant) FROM {source} WHERE variant = '{variant}' AND {where} ORDER BY {order}"
    names, values = run_sql(settings, sql)
    return [dict(zip(names, row, strict=True)) for row in values]


TRANSITIONS = ("transitions", "session_id, step")
WOVEN = ("woven_rewards", "session_id, logical_event_id")
LATE = ("late_rewards", "event_id")


def live_snapshot(settings: Settings) -> dict:
    return {table: rows(settings, table, "live", order) for table, order in (TRANSITIONS, WOVEN, LATE)} | {
        "reward_components": rows(settings, "reward_components", "live", "event_id")
    }


def test_reweave_with_the_live_policy_gives_the_live_final_rows(history: History) -> None:
    settings = history.settings
    report = reweave_history(settings, RewardPolicy.model_validate(POLICY), "again")
    assert report.steps == history.steps and report.rows["transitions"] == history.steps
    for table, order in (TRANSITIONS, WOVEN):
        live = rows(settings, table, "live", order)
        assert live and rows(settings, table, "again", order) == live, table
    # late rewards: the same verdicts (ORPHAN_RESOLVED and its revision are arrival timing: processors.steps.reweave)
    unrevised = "event_id, reason, detail, lateness_ms, deadline, reward_policy_version, value"
    live_late = run_sql(settings, f"SELECT {unrevised} FROM late_rewards_latest WHERE reason != 'ORPHAN_RESOLVED' "
                                  "ORDER BY event_id")[1]  # fmt: skip
    again_late = run_sql(settings, f"SELECT {unrevised} FROM late_rewards_variants WHERE variant = 'again' "
                                   "ORDER BY event_id")[1]  # fmt: skip
    assert live_late and again_late == live_late


def fused(components: list[tuple[str, float, float]], judge_weight: float) -> float:
    """The confidence-weighted mean (docs/reward-weaving.md) of (source, value, confidence) components, with the
    policy's weights (a row's component weight is the normalized one)."""
    weight = {"judge": judge_weight, "tool_success": 0.5}
    weights = [weight.get(source, 1.0) * confidence for source, _, confidence in components]
    return sum(w * c[1] for w, c in zip(weights, components, strict=True)) / sum(weights)


def test_a_changed_policy_changes_exactly_the_affected_steps_and_no_live_row(history: History) -> None:
    settings = history.settings
    before = live_snapshot(settings)
    judge_x3 = json.loads(json.dumps(POLICY))
    judge_x3["version"] = "judge-x3"
    judge_x3["specs"][0]["weight"] = 3.0
    result = treadle(settings, "reweave", "--policy", _write(settings, judge_x3), "--as", "judge-x3")
    assert result.returncode == 0, result.stderr
    assert f"{history.steps} steps re-woven under reward policy 'judge-x3'" in result.stdout

    live = {r["logical_event_id"]: r for r in rows(settings, "transitions", "live", "session_id, step")}
    other = {r["logical_event_id"]: r for r in rows(settings, "transitions", "judge-x3", "session_id, step")}
    assert set(other) == set(live)
    changed = 0
    for lid, row in live.items():
        fields = ("source", "value", "confidence")
        parts = list(zip(*(row[f"reward_components.{f}"] for f in fields), strict=True))
        want = fused(parts, judge_weight=3.0) if parts else None
        if want is None:
            assert other[lid]["reward"] is None
        else:
            assert other[lid]["reward"] == pytest.approx(want), lid
        if want is None or abs(want - row["reward"]) < 1e-12:
            assert other[lid]["reward"] == row["reward"], f"{lid}: unaffected, unchanged"
        else:
            changed += 1
        same = {k: v for k, v in other[lid].items() if k not in ("reward", "reward_components.weight",
                                                                  "reward_components.contribution")}  # fmt: skip
        assert same == {k: v for k, v in row.items() if k in same}, lid
    assert 0 < changed < len(live), "some steps are affected and some are not"
    assert live_snapshot(settings) == before, "live rows untouched"


def _write(settings: Settings, policy: dict) -> str:
    path = settings.home / f"{policy['version']}.json"
    path.write_text(json.dumps(policy))
    return str(path)


def test_backfill_of_the_reward_source_gives_the_rows_it_gave_live(history: History, tmp_path: Path) -> None:
    settings = history.settings
    before = live_snapshot(settings)
    report = backfill(settings, "tool_success", "bf", registry=ProcessorRegistry(_entry_points()))
    assert report.signals == history.results and report.rows["reward_components"] == history.results
    for table, order in (TRANSITIONS, WOVEN):
        assert rows(settings, table, "bf", order) == before[table], table
    source = "source = 'tool_success'"
    assert rows(settings, "reward_components", "bf", "event_id", source) == [
        r for r in before["reward_components"] if r["source"] == "tool_success"
    ]
    assert live_snapshot(settings) == before, "live rows untouched"


def _entry_points():
    from importlib.metadata import EntryPoint

    name, value = (part.strip() for part in SOURCE_ENTRY.split("="))
    return [EntryPoint(name=name, value=value, group="treadle.processors")]


def test_export_variant_exports_the_variants_rows(history: History, tmp_path: Path) -> None:
    settings = history.settings
    reweave_history(settings, RewardPolicy.model_validate({**POLICY, "version": "exported"}), "exported")
    out = tmp_path / "variant.parquet"
    done = treadle(settings, "export", str(out), "--variant", "exported")
    assert done.returncode == 0, done.stderr
    table = pq.read_table(out)
    want = run_sql_arrow(settings, shape_sql(Shape.TRANSITIONS, ExportFilters(variant="exported")))
    assert table.num_rows == history.steps and table.to_pylist() == want.cast(table.schema).to_pylist()
    manifest = json.loads(Path(f"{out}.manifest.json").read_text())
    assert manifest["filters"]["variant"] == "exported"
    missing = treadle(settings, "export", str(tmp_path / "none.parquet"), "--variant", "nope")
    assert missing.returncode == 1 and "no variant 'nope' in transitions (there are: " in missing.stderr
    refused = treadle(settings, "reweave", "--policy", _write(settings, POLICY), "--as", "live")
    assert refused.returncode == 1 and "variant 'live' is the worker's own rows" in refused.stderr
    endpoint = SqlEndpoint.read(settings)
    assert endpoint is not None, "the worker's sink serves SQL"
    with pytest.raises(QueryFailedError, match="refused variant rows: variant 'live' is the worker's own rows"):
        post_json(endpoint, "/variant", {"variant": "live", "replace": True, "records": []}, timeout=30)


def test_with_the_worker_stopped_the_re_weave_opens_the_database_itself(history: History) -> None:
    history.worker.stop()
    settings = history.settings
    report = reweave_history(settings, RewardPolicy.model_validate(POLICY), "offline")
    assert report.rows["transitions"] == history.steps
    for table, order in (TRANSITIONS, WOVEN):
        assert rows(settings, table, "offline", order) == rows(settings, table, "live", order), table
