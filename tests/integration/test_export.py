"""Replay export on the real stack: each shape's file equals its SQL query row for row; the manifest reproduces it.

The worker owns the embedded chDB here, so every read goes through its sink's SQL service, as a user's would.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from sinks.export_sql import ExportFilters, Shape, shape_sql
from sinks.sql_client import run_sql, run_sql_arrow
from streams.runtime.worker import prepare_cluster
from tests.conftest import PORT_BASE
from tests.factories import treadle, wait_for
from topics.settings import Settings
from treadle import AgentStream, LifecycleKind, replay
from treadle.devstack.worker_process import WorkerProcess

SESSIONS, EPISODES, STEPS = 4, 2, 3


async def agents(settings: Settings) -> int:
    """Sessions of two policy versions, each step with one or two LLM calls; the last step of each episode
    gets no reward of its own, and each episode ends with a return the credit processor spreads."""
    calls = 0
    for s in range(SESSIONS):
        async with AgentStream(settings, agent_id=f"agent-{s % 2}", policy_version=f"v{s % 2 + 1}") as stream:
            for e in range(EPISODES):
                await stream.lifecycle(LifecycleKind.EPISODE_STARTED, episode_id=f"ep-{s}-{e}")
                for k in range(STEPS):
                    step = await stream.dispatch("search", {"q": f"{s}/{e}/{k}"})
                    for c in range(1 + k % 2):
                        await stream.llm_call(
                            step, model="m", prompt_text=f"prompt {k}", completion_text=f"answer {c}",
                            prompt_token_ids=[1, 2, k], completion_token_ids=[3, c], completion_logprobs=[-0.5, -0.1],
                        )  # fmt: skip
                        calls += 1
                    await stream.tool_result(step, "OK" if k else "ERROR", output=f"out {k}")
                    if k < STEPS - 1:
                        await stream.reward(step, 0.25 * (k + 1), source="judge", confidence=0.5 + 0.25 * k)
                await stream.lifecycle(LifecycleKind.EPISODE_ENDED, done=True, truncated=e == 1, reward=1.0)
    return calls


@pytest.fixture(scope="module")
def exported(stack: Settings, tmp_path_factory: pytest.TempPathFactory):
    """A worker (steps + credit) that has woven the sessions above; its settings."""

    home = tmp_path_factory.mktemp("export")
    name = f"texport{os.getpid()}"
    settings = stack.model_copy(
        update={
            "home": home / "home", "topic_prefix": name, "app_id": name, "processors": ("steps", "credit"),
            "web_port": PORT_BASE - 1300, "sql_port": PORT_BASE - 1250, "sink_flush_seconds": 0.2,
        }
    )  # fmt: skip
    asyncio.run(prepare_cluster(settings))
    worker = WorkerProcess(settings, settings.home / "worker.log").start()
    try:
        worker.wait_ready()
        calls = asyncio.run(agents(settings))
        steps = SESSIONS * EPISODES * STEPS

        def woven() -> bool:
            _, rows = run_sql(
                settings,
                "SELECT count(), countIf(has(reward_components.source, 'credit')) FROM transitions_latest",
            )
            _, llm = run_sql(settings, "SELECT count() FROM llm_calls_latest")
            _, ends = run_sql(  # the trajectories read the episode ends, which sink on their own
                settings,
                "SELECT count() FROM raw_events_latest WHERE kind = 'lifecycle' "
                "AND JSONExtractString(payload_json, 'kind') = 'EPISODE_ENDED'",
            )
            return rows == [[steps, steps]] and llm == [[calls]] and ends == [[SESSIONS * EPISODES]]

        wait_for(woven, 120, "every step woven with its credit share, every LLM call and episode end sunk")
        yield settings
    finally:
        worker.stop()


def sql_rows(settings: Settings, shape: Shape, filters: ExportFilters, schema: pa.Schema) -> list[dict]:
    return run_sql_arrow(settings, shape_sql(shape, filters)).cast(schema).to_pylist()


@pytest.mark.parametrize("shape", list(Shape))
def test_each_shape_in_parquet_equals_its_sql_query_row_for_row(exported: Settings, tmp_path: Path, shape) -> None:
    out = tmp_path / f"{shape}.parquet"
    manifest = replay.export(shape, out, settings=exported, batch_rows=5)  # several pages
    table = pq.read_table(out)
    assert table.num_rows == manifest.rows > 0
    assert table.to_pylist() == sql_rows(exported, shape, manifest.filters, table.schema)
    expected = {Shape.TRANSITIONS: 24, Shape.TRAJECTORIES: 8, Shape.TRIPLETS: 32}[shape]
    assert manifest.rows == expected
    assert manifest.policy_versions == ["v1", "v2"]
    assert manifest.query == shape_sql(shape, manifest.filters)
    assert manifest.filters.until == manifest.as_of, "an open-ended export is bounded by its as-of time"


def test_shape_contents(exported: Settings, tmp_path: Path) -> None:
    steps = pq.read_table(replay.export("transitions", tmp_path / "t.parquet", settings=exported).output).to_pylist()
    first = next(r for r in steps if r["step"] == 0)
    assert first["component_sources"].count("credit") == 1 and first["credit_reward"] is not None
    assert first["reward_status"] == "complete" and first["revision"] >= 3

    episodes = pq.read_table(replay.export("trajectories", tmp_path / "e.parquet", settings=exported).output)
    episodes = episodes.to_pylist()
    assert len(episodes) == SESSIONS * EPISODES
    for episode in episodes:
        assert episode["steps"] == STEPS and episode["step"] == sorted(episode["step"])
        assert episode["success"] == (episode["done"] and not episode["truncated"]) and episode["ended"]
        assert episode["episode_return"] == pytest.approx(sum(r for r in episode["reward"] if r is not None))
    assert {e["success"] for e in episodes} == {True, False}

    triplets = pq.read_table(replay.export("triplets", tmp_path / "x.parquet", settings=exported).output)
    row = triplets.to_pylist()[0]
    assert row["completion_token_ids"] == [3, 0] and row["completion_logprobs"] == pytest.approx([-0.5, -0.1])
    assert row["calls_in_step"] in (1, 2) and row["credit_reward"] is not None and row["prompt_text"].startswith("p")


def test_filters_select_the_same_rows_as_sql(exported: Settings, tmp_path: Path) -> None:
    filters = ExportFilters(policy_versions=("v1",), settled=True, min_confidence=0.6, agents=("agent-0", "x'y"))
    manifest = replay.export("transitions", tmp_path / "f.parquet", settings=exported, filters=filters)
    table = pq.read_table(tmp_path / "f.parquet")
    rows = table.to_pylist()
    assert rows == sql_rows(exported, Shape.TRANSITIONS, manifest.filters, table.schema)
    assert rows and {r["policy_version"] for r in rows} == {"v1"}
    assert all(r["reward_status"] != "pending" and min(r["component_confidences"]) >= 0.6 for r in rows)
    assert len(rows) < 24


def test_arrow_and_jsonl_hold_the_same_rows(exported: Settings, tmp_path: Path) -> None:
    parquet = pq.read_table(replay.export("triplets", tmp_path / "a.parquet", settings=exported).output)
    arrow = feather.read_table(
        replay.export("triplets", tmp_path / "a.arrow", format="arrow", settings=exported).output
    )
    assert arrow.to_pylist() == parquet.to_pylist()
    replay.export("triplets", tmp_path / "a.jsonl", format="jsonl", settings=exported)
    lines = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [r["llm_call_id"] for r in lines] == parquet.column("llm_call_id").to_pylist()
    assert lines[0]["completion_token_ids"] == parquet.column("completion_token_ids")[0].as_py()


def test_the_manifest_reproduces_the_export(exported: Settings, tmp_path: Path) -> None:
    first = replay.export("trajectories", tmp_path / "one.parquet", settings=exported, policy_versions=["v2"])
    again = replay.rerun(
        replay.manifest_path_for(tmp_path / "one.parquet"), tmp_path / "two.parquet", settings=exported
    )
    assert again.same_rows_as(first) and again.filters == first.filters and again.query == first.query
    assert pq.read_table(tmp_path / "two.parquet").equals(pq.read_table(tmp_path / "one.parquet"))


def test_the_cli_exports_reruns_and_says_what_is_wrong_in_one_line(exported: Settings, tmp_path: Path) -> None:
    out = tmp_path / "cli.parquet"
    done = treadle(exported, "export", str(out), "--shape", "triplets", "--policy-version", "v1")
    assert done.returncode == 0, done.stderr
    assert "wrote 16 triplets rows" in done.stdout
    again = treadle(exported, "export", str(tmp_path / "cli2.parquet"), "--manifest", f"{out}.manifest.json")
    assert again.returncode == 0, again.stderr
    assert "differs" not in again.stdout
    assert pq.read_table(tmp_path / "cli2.parquet").equals(pq.read_table(out))

    for args, message in [
        (["--shape", "episodes"], "error: unknown shape 'episodes': use one of transitions, trajectories, triplets"),
        (["--since", "last tuesday"], "error: cannot read --since 'last tuesday'"),
        (["--status", "done"], "error: unknown reward status 'done'"),
        (["--format", "csv"], "error: unknown format 'csv'"),
    ]:
        failed = treadle(exported, "export", str(tmp_path / "bad.parquet"), *args)
        assert failed.returncode == 1 and failed.stderr.startswith(message), (args, failed.stderr)
        assert len(failed.stderr.strip().splitlines()) == 1, failed.stderr
    exists = treadle(exported, "export", str(out))
    assert exists.returncode == 1 and "exists" in exists.stderr
