"""`treadle demo`: simulated agents and reward sources through the whole pipeline.

Agents call tools with latency jitter, failures and timeouts; an LLM judge answers in
milliseconds, a business metric in seconds, a human reviewer later and only sometimes. The demo
starts a worker if none runs, waits until every step's transition and every reward have landed in
ClickHouse, prints counts and replay rows, and stops the worker it started.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from sinks.sql_client import run_sql
from streams.runtime.processes import StackError
from streams.runtime.run_info import WorkerInfo
from streams.runtime.worker import prepare_cluster
from streams.sdk.producer import create_producer
from topics.ids import uuid7
from topics.settings import Settings
from topics.tool_schemas import ToolSchemas
from treadle import AgentStream, RewardEmitter, StepRef
from treadle.devstack.stack import LocalStack
from treadle.devstack.worker_process import WorkerProcess

TOOLS: dict[str, dict] = {
    "search": {
        "type": "object",
        "properties": {"q": {"type": "string", "minLength": 1}, "k": {"type": "integer", "minimum": 1}},
        "required": ["q"],
        "additionalProperties": False,
    },
    "calculator": {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
        "additionalProperties": False,
    },
    "fetch_page": {
        "type": "object",
        "properties": {"url": {"type": "string", "pattern": "^https?://"}},
        "required": ["url"],
        "additionalProperties": False,
    },
}
QUERIES = ["red shoes", "weather in Oslo", "kafka grace period", "clickhouse final", "cheap flights"]


@dataclass
class DemoCounts:
    events: Counter[str] = field(default_factory=Counter)
    steps: int = 0
    rewards: int = 0


def _params(rng: random.Random, tool: str) -> dict:
    if tool == "search":
        return {"q": rng.choice(QUERIES), "k": rng.randint(1, 10)}
    if tool == "calculator":
        return {"expression": f"{rng.randint(1, 99)} * {rng.randint(1, 99)}"}
    return {"url": f"https://example.org/{rng.randint(1, 500)}"}


async def _run_tool(rng: random.Random, tool: str) -> str:
    await asyncio.sleep(rng.uniform(0.005, 0.05))  # latency jitter
    roll = rng.random()
    if roll < 0.05:
        raise TimeoutError(f"{tool} timed out")
    if roll < 0.15:
        raise RuntimeError(f"{tool} failed: upstream 503")
    return json.dumps({"tool": tool, "ok": True, "n": rng.randint(0, 100)})


class RewardSources:
    """Three reward sources answering after their own delays; tasks are awaited before the demo ends."""

    def __init__(self, producer, rng: random.Random, counts: DemoCounts) -> None:
        self.rng = rng
        self.counts = counts
        self.judge = RewardEmitter(source="llm_judge", annotator="LLM", producer=producer)
        self.metric = RewardEmitter(source="outcome_metric", annotator="CODE", producer=producer)
        self.human = RewardEmitter(source="human_review", annotator="HUMAN", producer=producer)
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        for emitter in (self.judge, self.metric, self.human):
            await emitter.start()

    def judge_step(self, step: StepRef, ok: bool) -> None:
        base = 0.6 if ok else -0.4
        self._later(self.judge, step, self.rng.uniform(0.01, 0.3), base + self.rng.uniform(-0.3, 0.3), 0.8)
        if self.rng.random() < 0.5:
            self._later(self.metric, step, self.rng.uniform(0.5, 2.0), 1.0 if ok else 0.0, 1.0)
        if self.rng.random() < 0.1:
            self._later(self.human, step, self.rng.uniform(1.0, 3.0), self.rng.choice([-1.0, 1.0]), 0.9)

    def _later(self, emitter: RewardEmitter, step: StepRef, delay: float, value: float, confidence: float) -> None:
        async def emit() -> None:
            await asyncio.sleep(delay)
            await emitter.reward(step, round(value, 3), name="quality", confidence=confidence)
            self.counts.rewards += 1
            self.counts.events["reward"] += 1

        self.tasks.append(asyncio.create_task(emit()))

    async def close(self) -> None:
        await asyncio.gather(*self.tasks)
        for emitter in (self.judge, self.metric, self.human):
            await emitter.close()


async def _session(
    settings: Settings,
    producer,
    schemas: ToolSchemas,
    sources: RewardSources,
    session_id: str,
    steps: int,
    rng: random.Random,
    counts: DemoCounts,
) -> None:
    stream = AgentStream(
        settings, agent_id="demo-agent", session_id=session_id, policy_version="demo-v1",
        tool_schemas=schemas, producer=producer,
    )  # fmt: skip
    await stream.start()
    await stream.lifecycle("SESSION_CREATED")
    await stream.lifecycle("EPISODE_STARTED")
    counts.events["lifecycle"] += 2
    for _ in range(steps):
        tool = rng.choice(list(TOOLS))
        step = await stream.dispatch(tool, _params(rng, tool))
        counts.events["dispatch"] += 1
        ok = True
        try:
            async with stream.tool_call(step) as call:
                call.output = await _run_tool(rng, tool)
                call.cost_usd = round(rng.uniform(0.0001, 0.01), 5)
                call.tokens_in, call.tokens_out = rng.randint(10, 500), rng.randint(5, 200)
        except (TimeoutError, RuntimeError):
            ok = False
        counts.events["tool_result"] += 1
        await stream.delta(node_upserts=[{"id": f"obs-{step.step}", "type": "observation"}], step_ref=step)
        counts.events["state_delta"] += 1
        sources.judge_step(step, ok)
        counts.steps += 1
    await stream.lifecycle("EPISODE_ENDED", done=True)
    counts.events["lifecycle"] += 1
    await stream.close()


async def _simulate(
    settings: Settings, run_id: str, sessions: int, steps: int, seed: int, console: Console
) -> DemoCounts:
    rng = random.Random(seed)
    counts = DemoCounts()
    producer = create_producer(settings)
    await producer.start()
    try:
        schemas = ToolSchemas(TOOLS)
        sources = RewardSources(producer, rng, counts)
        await sources.start()
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("agents acting", total=sessions * steps)

            async def tick() -> None:
                while counts.steps < sessions * steps:
                    progress.update(task, completed=counts.steps)
                    await asyncio.sleep(0.1)

            ticker = asyncio.create_task(tick())
            await asyncio.gather(
                *[
                    _session(settings, producer, schemas, sources, f"demo-{run_id}-{i:03d}", steps, rng, counts)
                    for i in range(sessions)
                ]
            )
            progress.update(task, completed=counts.steps, description="reward sources answering")
            await sources.close()
            ticker.cancel()
        await producer.flush()
    finally:
        await producer.stop()
    return counts


class DemoWorker:
    """Starts `treadle worker` in the background unless one already runs; stops only what it started."""

    def __init__(self, settings: Settings, tool_schemas: Path) -> None:
        self.settings = settings
        self.worker: WorkerProcess | None = None
        self.tool_schemas = tool_schemas

    def __enter__(self) -> DemoWorker:
        if WorkerInfo.read(self.settings) is None:
            self.worker = WorkerProcess(self.settings, env={"TREADLE_TOOL_SCHEMAS": str(self.tool_schemas)})
            self.worker.start().wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.worker is not None:
            self.worker.stop()


def _wait_for_pipeline(settings: Settings, run_id: str, counts: DemoCounts, timeout: float, console: Console) -> None:
    query = (
        "SELECT count(), sum(reward_revision), countIf(tool_status IS NOT NULL) FROM transitions_latest "
        f"WHERE session_id LIKE 'demo-{run_id}-%'"
    )
    deadline = time.monotonic() + timeout
    with console.status("waiting for transitions and rewards to land in ClickHouse…") as status:
        while time.monotonic() < deadline:
            _, rows = run_sql(settings, query)
            steps, rewards, results = rows[0]
            status.update(f"in ClickHouse: {steps}/{counts.steps} steps, {rewards}/{counts.rewards} rewards")
            if steps == counts.steps and rewards == counts.rewards and results == counts.steps:
                return
            time.sleep(0.5)
    raise StackError(f"pipeline did not catch up within {timeout:.0f} s; see {settings.logs_dir / 'worker.log'}")


def _print_results(settings: Settings, run_id: str, counts: DemoCounts, console: Console) -> None:
    where = f"WHERE session_id LIKE 'demo-{run_id}-%'"
    console.print(
        "[bold]events sent:[/bold] " + ", ".join(f"{k}={v}" for k, v in sorted(counts.events.items()))
        + f" (total {sum(counts.events.values())})"
    )  # fmt: skip
    by_status = (
        "SELECT tool_status, count() AS steps, round(avg(latency_ms), 1) AS avg_latency_ms, "
        f"round(avg(reward), 3) AS avg_reward FROM transitions_latest {where} "
        "GROUP BY tool_status ORDER BY steps DESC"
    )
    by_source = (
        "SELECT source, annotator, count() AS components, round(avg(value), 3) AS avg_value "
        f"FROM reward_components_latest {where} GROUP BY source, annotator ORDER BY components DESC"
    )
    by_type = f"SELECT kind, count() AS events FROM raw_events_latest {where} GROUP BY kind ORDER BY events DESC"
    replay = (
        "SELECT session_id, step, tool, tool_status, round(latency_ms, 1) AS latency_ms, "
        f"round(reward, 3) AS reward, reward_revision, revision FROM transitions_latest {where} "
        "ORDER BY session_id, step LIMIT 8"
    )
    summaries = [
        ("transitions by tool status", by_status),
        ("reward components by source", by_source),
        ("raw events by kind", by_type),
        ("dead letters (all runs)", "SELECT stage, count() AS n FROM dead_letters_latest GROUP BY stage"),
        ("replay rows (first 8)", replay),
    ]
    for title, query in summaries:
        columns, rows = run_sql(settings, query)
        table = Table(title=title, show_header=True, header_style="bold")
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*["NULL" if v is None else str(v) for v in row])
        console.print(table)
    console.print(f'query it yourself: treadle sql "SELECT * FROM transitions_latest {where} LIMIT 5"')


def run_demo(settings: Settings, *, sessions: int, steps: int, seed: int, timeout: float, console: Console) -> None:
    with console.status("starting the local stack…"):
        LocalStack(settings).up()
        asyncio.run(prepare_cluster(settings))
    tools_path = settings.home / "demo" / "tools.json"
    tools_path.parent.mkdir(parents=True, exist_ok=True)
    tools_path.write_text(json.dumps(TOOLS, indent=2))
    run_id = uuid7()[-8:]  # the random tail: the head is a timestamp shared by runs in the same minute
    console.print("starting a worker (unless one runs)…")
    with DemoWorker(settings, tools_path):
        started = time.monotonic()
        counts = asyncio.run(_simulate(settings, run_id, sessions, steps, seed, console))
        console.print(f"{sessions} agents took {counts.steps} steps in {time.monotonic() - started:.1f} s")
        _wait_for_pipeline(settings, run_id, counts, timeout, console)
        _print_results(settings, run_id, counts, console)
