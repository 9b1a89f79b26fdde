"""Evaluation tables and `treadle eval`, end to end on the real broker, worker and chDB.

A demo-sized workload (10 sessions, 2 policy versions, 2 agents, OK/ERROR/TIMEOUT/REJECTED tool results with
retries, rewards, EPISODE_ENDED with every done/truncated mix, open episodes, pairwise preferences, safety metric
rows, and re-sent duplicates of all of them, over 6 hours of event time) goes through Kafka, the worker and the
sink. Every number of the eval_* views and of `treadle eval --json` is then compared with the same number computed
here, in plain Python, from the records the test produced. Counts and percentiles must be equal; float sums are
built from binary fractions (k/8 rewards, k/1024 dollars) so they are exact in any order, and floats are compared
to 1e-12 relative only because ClickHouse may add in another order. Percentiles follow ClickHouse's quantileExact:
the element at 0-based index floor(q * n) of the sorted values.

Safety rows are produced as EvaluationMetric records onto the evaluation_metrics topic (the sink path), so these
numbers do not depend on the safety evaluator's rules; the worker runs the step processor only.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import random
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from sinks.sql_client import run_sql
from streams.runtime.worker import prepare_cluster
from tests.conftest import PORT_BASE
from tests.factories import treadle, wait_for
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.ids import uuid7
from topics.settings import Settings
from treadle.devstack.worker_process import WorkerProcess
from treadle.reports.eval_report import ReportFilters, bucket_seconds, build_report

DISPATCH = "treadle.events.ActionDispatched"
RESULT = "treadle.events.ToolResult"
REWARD = "treadle.events.RewardSignal"
LIFECYCLE = "treadle.events.LifecycleEvent"
METRIC = "treadle.derived.EvaluationMetric"
KIND = {DISPATCH: "actions", RESULT: "tool_results", REWARD: "rewards", LIFECYCLE: "lifecycle"}
KIND[METRIC] = "evaluation_metrics"

T0 = 1_759_968_000_000_000  # 2025-10-09T00:00:00Z, micros
MINUTE = 60_000_000
HOUR = 60 * MINUTE
POLICIES = ("pv-a", "pv-b")
AGENTS = ("agent-1", "agent-2")
TOOLS = ("search", "calculator", "fetch_page")
RULE_SEVERITY = {"email": "medium", "phone": "medium", "destructive_command": "high"}
ENDINGS = [(True, False), (True, False), (False, True), (True, True), (False, False), None]  # None: still open


# --- the workload -------------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """Distinct records by schema, plus everything in send order (duplicates included)."""

    records: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    sends: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def add(self, schema: str, record: dict[str, Any]) -> dict[str, Any]:
        self.records[schema].append(record)
        return record

    def of(self, schema: str) -> list[dict[str, Any]]:
        return self.records[schema]


def envelope(session: str, episode: str, lid: str, seq: int, at: int, policy: str, agent: str, **attrs: str):
    return {
        "event_id": uuid7(),
        "session_id": session,
        "agent_id": agent,
        "episode_id": episode,
        "logical_event_id": lid,
        "seq": seq,
        "event_time": at,
        "policy_version": policy,
        "trace_id": lid.replace("-", ""),
        "attributes": dict(attrs),
    }


def metric(metric_name: str, rule: str, value: float, judged: dict[str, Any]) -> dict[str, Any]:
    env = judged["envelope"]
    return {
        "metric_id": f"safety:{metric_name}:{rule}:{env['event_id']}",
        "evaluator": "safety",
        "metric": metric_name,
        "rule": rule,
        "value": value,
        "severity": RULE_SEVERITY.get(rule, "low"),
        "session_id": env["session_id"],
        "episode_id": env["episode_id"],
        "logical_event_id": env["logical_event_id"],
        "agent_id": env["agent_id"],
        "policy_version": env["policy_version"],
        "source_event_id": env["event_id"],
        "event_time": env["event_time"],
        "evidence": None,
    }


def make_workload(rng: random.Random) -> Workload:
    w = Workload()
    endings = itertools.cycle(ENDINGS)  # every kind of ending, whatever the random draws
    for s in range(10):
        session, policy, agent = f"eval-s{s}", POLICIES[s % 2], AGENTS[(s // 2) % 2]
        seq, steps = itertools.count(), itertools.count()
        at = T0 + s * 35 * MINUTE  # sessions start 35 min apart: about 6 hours in all
        for e in range(2 if s % 3 == 0 else 1):
            episode = f"{session}-ep{e}"

            def env(lid: str, when: int, episode: str = episode, **attrs: str) -> dict[str, Any]:
                return envelope(session, episode, lid, next(seq), when, policy, agent, **attrs)  # noqa: B023

            start_id = uuid7()
            w.add(
                LIFECYCLE,
                {
                    "envelope": env(start_id, at),
                    "kind": "EPISODE_STARTED",
                    "done": False,
                    "truncated": False,
                    "reason": None,
                },
            )
            at += MINUTE
            for _ in range(rng.randint(2, 5)):
                _step(w, rng, env, next(steps), at)
                at += rng.randint(2, 9) * MINUTE
            ending = next(endings)
            if ending is not None:
                end_id = uuid7()
                w.add(
                    LIFECYCLE,
                    {
                        "envelope": env(end_id, at),
                        "kind": "EPISODE_ENDED",
                        "done": ending[0],
                        "truncated": ending[1],
                        "reason": "test",
                    },
                )
                opponent = "pv-b" if policy == "pv-a" else "baseline"
                judgment = env(uuid7(), at + MINUTE, opponent_policy_version=opponent)
                w.add(REWARD, _preference(judgment, rng.choice([0.0, 0.5, 1.0, 1.0])))
            at += 3 * MINUTE
    # Judgments the win rate must leave out (value not 0/0.5/1; no opponent), though eval_preferences keeps them.
    w.add(
        REWARD,
        _preference(
            envelope(
                "eval-s0", "eval-s0-ep0", uuid7(), 999, T0 + 5 * MINUTE, "pv-a", "judge", opponent_policy_version="pv-b"
            ),
            0.7,
        ),
    )
    w.add(REWARD, _preference(envelope("eval-s1", "eval-s1-ep0", uuid7(), 999, T0 + HOUR, "pv-b", "judge"), 1.0))
    # Sent in event-time order, as agents and judges emit them; about one in eight is re-sent right after (a producer
    # retry: same event_id / metric_id), so the sink inserts it twice and every view must still count it once.
    everything = [(schema, record) for schema, records in w.records.items() for record in records]
    for schema, record in sorted(everything, key=lambda sent: (sent[1].get("envelope") or sent[1])["event_time"]):
        w.sends.append((schema, record))
        if rng.random() < 0.12:
            w.sends.append((schema, record))
    return w


def _step(w: Workload, rng: random.Random, env: Callable[..., dict], step: int, at: int) -> None:
    lid = uuid7()
    tool = rng.choice(TOOLS)
    dispatch = w.add(
        DISPATCH,
        {
            "envelope": env(lid, at),
            "step": step,
            "tool": tool,
            "params_json": json.dumps({"q": f"x{step}"}),
            "deadline": None,
        },
    )
    if rng.random() < 0.1:
        w.add(METRIC, metric("safety_alert", "destructive_command", 1.0, dispatch))
    retry = rng.random() < 0.2
    for attempt in range(2 if retry else 1):
        status = (
            "ERROR" if retry and attempt == 0 else rng.choices(["OK", "ERROR", "TIMEOUT", "REJECTED"], [6, 2, 2, 1])[0]
        )
        latency = round(rng.uniform(5, 900), 1)
        at += int(latency * 1000) + 1
        result = w.add(
            RESULT,
            {
                "envelope": env(lid, at),
                "tool": tool,
                "status": status,
                "output": "{}",
                "error": None if status == "OK" else "boom",
                "latency_ms": latency,
                "cost_usd": rng.randint(1, 64) / 1024,
                "tokens_in": rng.randint(10, 500),
                "tokens_out": rng.randint(0, 200),
                "retries": attempt,
            },
        )
        leaked = rng.random() < 0.3
        w.add(METRIC, metric("pii_leak", "any_pii", 1.0 if leaked else 0.0, result))
        if leaked:
            w.add(METRIC, metric("safety_alert", rng.choice(["email", "phone"]), 1.0, result))
    for r in range(rng.choice([0, 1, 1, 2])):
        at += MINUTE // 4
        w.add(
            REWARD,
            {
                "envelope": env(lid, at),
                "source": f"judge-{r}",
                "name": "quality",
                "value": rng.randint(-8, 8) / 8,
                "confidence": 1.0,
                "annotator": "LLM",
                "evidence": None,
            },
        )


def _preference(env: dict[str, Any], value: float) -> dict[str, Any]:
    return {
        "envelope": env,
        "source": "human_pref",
        "name": "preference",
        "value": value,
        "confidence": 1.0,
        "annotator": "HUMAN",
        "evidence": None,
    }


async def produce(settings: Settings, sends: Iterable[tuple[str, dict[str, Any]]]) -> None:
    catalog, codec = TopicCatalog(settings), AvroCodec()
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap_servers, acks="all")
    await producer.start()
    try:
        for schema, record in sends:
            session = (record.get("envelope") or record)["session_id"]
            await producer.send(catalog[KIND[schema]].name, codec.encode(schema, record), key=session.encode())
        await producer.flush()
    finally:
        await producer.stop()


# --- the oracle: the same numbers in plain Python ---------------------------------------------------------------


def quantile_exact(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def iso(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def micros(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp()) * 1_000_000 + moment.microsecond


@dataclass
class Oracle:
    w: Workload

    def pref_facts(self) -> list[dict[str, Any]]:
        return [r for r in self.w.of(REWARD) if r["name"] == "preference"]

    def step_rewards(self) -> dict[str, list[float]]:
        rewards: dict[str, list[float]] = defaultdict(list)
        for r in self.w.of(REWARD):
            if r["name"] != "preference":
                rewards[r["envelope"]["logical_event_id"]].append(r["value"])
        return rewards

    def episodes(self) -> dict[tuple[str, str], dict[str, Any]]:
        """eval_episodes, row by row."""
        rewards = self.step_rewards()
        out: dict[tuple[str, str], dict[str, Any]] = {}

        def episode(env: dict[str, Any]) -> dict[str, Any]:
            key = (env["session_id"], env["episode_id"])
            return out.setdefault(
                key,
                {
                    "policy_version": env["policy_version"],
                    "agent_id": env["agent_id"],
                    "times": [],
                    "ended": False,
                    "done": False,
                    "truncated": False,
                    "ended_at": None,
                    "steps": 0,
                    "rewarded_steps": 0,
                    "episode_return": 0.0,
                    "tool_calls": 0,
                    "cost_usd": 0.0,
                    "tokens_in": 0,
                    "tokens_out": 0,
                },
            )

        for d in self.w.of(DISPATCH):
            ep = episode(d["envelope"])
            ep["times"].append(d["envelope"]["event_time"])
            ep["steps"] += 1
            values = rewards.get(d["envelope"]["logical_event_id"], [])
            ep["rewarded_steps"] += bool(values)
            ep["episode_return"] += sum(values) / len(values) if values else 0.0
        for r in self.w.of(RESULT):
            ep = episode(r["envelope"])
            ep["times"].append(r["envelope"]["event_time"])
            ep["tool_calls"] += 1
            ep["cost_usd"] += r["cost_usd"]
            ep["tokens_in"] += r["tokens_in"]
            ep["tokens_out"] += r["tokens_out"]
        for event in self.w.of(LIFECYCLE):
            ep = episode(event["envelope"])
            ep["times"].append(event["envelope"]["event_time"])
            if event["kind"] == "EPISODE_ENDED":
                ep.update(ended=True, done=event["done"], truncated=event["truncated"])
                ep["ended_at"] = event["envelope"]["event_time"]
        for ep in out.values():
            ep["started_at"] = min(ep.pop("times"))
            ep["success"] = ep["done"] and not ep["truncated"]
        return out

    def report(self, f: ReportFilters) -> dict[str, Any]:
        """The sections of `treadle eval --json` for filters `f`."""
        lo, hi = micros(f.since), micros(f.until)

        def keep(at: int, policy: str) -> bool:
            in_time = (lo is None or at >= lo) and (hi is None or at < hi)
            return in_time and (not f.policy_versions or policy in f.policy_versions)

        results = [r for r in self.w.of(RESULT) if keep(r["envelope"]["event_time"], r["envelope"]["policy_version"])]
        episodes = [e for e in self.episodes().values() if keep(e["started_at"], e["policy_version"])]
        ended = [e for e in episodes if e["ended"]]
        times = [e["started_at"] for e in ended] + [r["envelope"]["event_time"] for r in results]
        size = bucket_seconds(max(times) // 10**6 - min(times) // 10**6) if times else 60
        prefs = [p for p in self.pref_facts() if keep(p["envelope"]["event_time"], p["envelope"]["policy_version"])]
        valid = [p for p in prefs if _valid_preference(p)]
        return {
            "tools": self.tools(results),
            "episodes": self.episode_summary(episodes),
            "safety": {"alerts_by_rule": self.alerts(keep), "pii": self.pii(keep)},
            "preferences": {"win_rates": win_rates(valid, lambda p: ()), "invalid_judgments": len(prefs) - len(valid)},
            "series": {
                "bucket_seconds": size,
                "episodes": self.episode_series(ended, size),
                "tool_latency": latency_series(results, size),
            },
        }

    @staticmethod
    def tools(results: list[dict[str, Any]], extra: Callable[[dict], tuple] = lambda r: ()) -> list[dict[str, Any]]:
        groups: dict[tuple, list[dict]] = defaultdict(list)
        for r in results:
            env = r["envelope"]
            groups[(*extra(r), env["policy_version"], r["tool"], env["agent_id"])].append(r)
        rows = []
        for key in sorted(groups):
            calls = groups[key]
            latencies = [c["latency_ms"] for c in calls]
            count = {s: sum(c["status"] == s for c in calls) for s in ("OK", "ERROR", "TIMEOUT", "REJECTED")}
            *head, policy, tool, agent = key
            rows.append(
                {
                    **({"hour": head[0]} if head else {}),
                    "tool": tool,
                    "agent_id": agent,
                    "policy_version": policy,
                    "calls": len(calls),
                    "ok": count["OK"],
                    "errors": count["ERROR"],
                    "timeouts": count["TIMEOUT"],
                    "rejected": count["REJECTED"],
                    "success_rate": count["OK"] / len(calls),
                    **{f"latency_p{round(q * 100)}_ms": quantile_exact(latencies, q) for q in (0.5, 0.95, 0.99)},
                }
            )
        return rows

    @staticmethod
    def episode_summary(episodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
        rows = []
        for policy in sorted({e["policy_version"] for e in episodes}):
            mine = [e for e in episodes if e["policy_version"] == policy]
            done = [e for e in mine if e["ended"]]
            n = len(done)

            def mean(column: str, done: list[dict] = done, n: int = n) -> float | None:
                return sum(e[column] for e in done) / n if n else None

            rows.append(
                {
                    "policy_version": policy,
                    "episodes": n,
                    "open_episodes": len(mine) - n,
                    "successes": sum(e["success"] for e in done),
                    "success_rate": sum(e["success"] for e in done) / n if n else None,
                    "mean_return": mean("episode_return"),
                    "mean_steps": mean("steps"),
                    "total_cost_usd": sum(e["cost_usd"] for e in done),
                    "mean_cost_usd": mean("cost_usd"),
                    "total_tokens_in": sum(e["tokens_in"] for e in done),
                    "total_tokens_out": sum(e["tokens_out"] for e in done),
                    "mean_tokens_in": mean("tokens_in"),
                    "mean_tokens_out": mean("tokens_out"),
                }
            )
        return rows

    def alerts(self, keep: Callable[[int, str], bool]) -> list[dict[str, Any]]:
        groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
        for m in self.w.of(METRIC):
            if m["metric"] == "safety_alert" and keep(m["event_time"], m["policy_version"]):
                groups[(m["rule"], m["severity"], m["policy_version"])].append(m)
        rows = [
            {
                "rule": rule,
                "severity": severity,
                "policy_version": policy,
                "alerts": len(ms),
                "episodes": len({(m["session_id"], m["episode_id"]) for m in ms}),
            }
            for (rule, severity, policy), ms in groups.items()
        ]
        return sorted(rows, key=lambda r: (-r["alerts"], r["rule"], r["policy_version"]))

    def safety_episodes(self) -> dict[tuple[str, str], dict[str, Any]]:
        """eval_safety_episodes, row by row."""
        by_episode: dict[tuple[str, str], list[dict]] = defaultdict(list)
        for m in self.w.of(METRIC):
            by_episode[(m["session_id"], m["episode_id"])].append(m)
        out = {}
        for key, ms in by_episode.items():
            first = min(ms, key=lambda m: (m["event_time"], m["metric_id"]))
            checks = [m for m in ms if m["metric"] == "pii_leak"]
            leaks = sum(m["value"] > 0 for m in checks)
            out[key] = {
                "policy_version": first["policy_version"],
                "agent_id": first["agent_id"],
                "first_event_at": first["event_time"],
                "last_event_at": max(m["event_time"] for m in ms),
                "pii_checks": len(checks),
                "pii_leaks": leaks,
                "pii_leak_rate": leaks / len(checks) if checks else None,
                "alerts": sum(m["metric"] == "safety_alert" for m in ms),
            }
        return out

    def pii(self, keep: Callable[[int, str], bool]) -> list[dict[str, Any]]:
        episodes = [
            e
            for e in self.safety_episodes().values()
            if e["pii_checks"] and keep(e["first_event_at"], e["policy_version"])
        ]
        rows = []
        for policy in sorted({e["policy_version"] for e in episodes}):
            mine = [e for e in episodes if e["policy_version"] == policy]
            checks, leaks = sum(e["pii_checks"] for e in mine), sum(e["pii_leaks"] for e in mine)
            rows.append(
                {
                    "policy_version": policy,
                    "episodes": len(mine),
                    "checks": checks,
                    "leaks": leaks,
                    "leak_rate": leaks / checks,
                    "mean_episode_leak_rate": sum(e["pii_leak_rate"] for e in mine) / len(mine),
                    "episodes_with_leaks": sum(e["pii_leaks"] > 0 for e in mine),
                }
            )
        return rows

    @staticmethod
    def episode_series(ended: list[dict[str, Any]], size: int) -> list[dict[str, Any]]:
        groups: dict[tuple[int, str], list[dict]] = defaultdict(list)
        for e in ended:
            groups[(e["started_at"] // 10**6 // size * size, e["policy_version"])].append(e)
        rows = []
        for (bucket, policy), es in sorted(groups.items()):
            successes = sum(e["success"] for e in es)
            rows.append(
                {
                    "bucket": iso(bucket),
                    "policy_version": policy,
                    "episodes": len(es),
                    "successes": successes,
                    "success_rate": successes / len(es),
                    "mean_return": sum(e["episode_return"] for e in es) / len(es),
                    "mean_cost_usd": sum(e["cost_usd"] for e in es) / len(es),
                }
            )
        return rows


def latency_series(results: list[dict[str, Any]], size: int) -> list[dict[str, Any]]:
    groups: dict[tuple[int, str], list[float]] = defaultdict(list)
    for r in results:
        env = r["envelope"]
        groups[(env["event_time"] // 10**6 // size * size, env["policy_version"])].append(r["latency_ms"])
    return [
        {
            "bucket": iso(bucket),
            "policy_version": policy,
            "calls": len(ls),
            "latency_p50_ms": quantile_exact(ls, 0.5),
            "latency_p95_ms": quantile_exact(ls, 0.95),
        }
        for (bucket, policy), ls in sorted(groups.items())
    ]


def _valid_preference(p: dict[str, Any]) -> bool:
    env = p["envelope"]
    return p["value"] in (0.0, 0.5, 1.0) and bool(env["attributes"].get("opponent_policy_version"))


def win_rates(prefs: list[dict[str, Any]], extra: Callable[[dict], tuple]) -> list[dict[str, Any]]:
    groups: dict[tuple, list[float]] = defaultdict(list)
    for p in prefs:
        env = p["envelope"]
        groups[(*extra(p), env["policy_version"], env["attributes"]["opponent_policy_version"])].append(p["value"])
    rows = []
    for key in sorted(groups):
        *head, policy, opponent = key
        values = groups[key]
        wins, losses, ties = values.count(1.0), values.count(0.0), values.count(0.5)
        rows.append(
            {
                **({"hour": head[0]} if head else {}),
                "policy_version": policy,
                "opponent_policy_version": opponent,
                "judgments": len(values),
                "wins": wins,
                "losses": losses,
                "ties": ties,
                "win_rate": (wins + 0.5 * ties) / len(values),
            }
        )
    return rows


def hour_of(at: int) -> int:
    return at // HOUR * HOUR // 10**6


# --- comparing --------------------------------------------------------------------------------------------------


def assert_same(actual: Any, expected: Any, where: str = "report") -> None:
    """Equal, except that floats may differ by 1e-12 relative (ClickHouse adds floats in its own order)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), f"{where}: {actual!r} != {expected!r}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), f"{where}: {actual!r} != {expected!r}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, float) and not isinstance(actual, bool):
        assert isinstance(actual, int | float) and math.isclose(actual, expected, rel_tol=1e-12, abs_tol=1e-12), (
            f"{where}: {actual!r} != {expected!r}"
        )
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def records(settings: Settings, sql: str) -> list[dict[str, Any]]:
    columns, rows = run_sql(settings, sql)
    return [dict(zip(columns, row, strict=True)) for row in rows]


# --- the run ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalRun:
    settings: Settings
    workload: Workload
    oracle: Oracle


@pytest.fixture(scope="module")
def run(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EvalRun]:
    """One deployment (ports clear of conftest's per-test ones), the workload produced, and everything landed."""
    name = f"ev{os.getpid()}"
    settings = stack.model_copy(
        update={
            "home": tmp_path_factory.mktemp("eval-home"),
            "topic_prefix": name,
            "app_id": name,
            "web_port": PORT_BASE - 600 + os.getpid() % 100,
            "sql_port": PORT_BASE - 100 + os.getpid() % 50,
            "sink_flush_seconds": 0.2,
            "processors": ("steps",),
        }
    )
    asyncio.run(prepare_cluster(settings))
    workload = make_workload(random.Random(20251009))
    worker = WorkerProcess(settings, settings.home / "worker.log").start()
    try:
        worker.wait_ready()
        asyncio.run(produce(settings, workload.sends))
        wait_for(
            landed(settings, workload),
            240,
            "every event, step revision and metric in ClickHouse",
            explain=lambda: f"{counts(settings)}\n{worker.log_tail(30)}",
        )
        yield EvalRun(settings, workload, Oracle(workload))
    finally:
        worker.stop()


def counts(settings: Settings) -> dict[str, Any]:
    [row] = records(
        settings,
        "SELECT (SELECT count() FROM raw_events_latest) AS raw, (SELECT count() FROM transitions_latest) AS steps, "
        "(SELECT sum(revision) FROM transitions_latest) AS revisions, "
        "(SELECT count() FROM evaluation_metrics_latest) AS metrics",
    )
    return row


def landed(settings: Settings, w: Workload) -> Callable[[], bool]:
    inputs = sum(len(w.of(schema)) for schema in (DISPATCH, RESULT, REWARD, LIFECYCLE))
    by_step: dict[str, int] = defaultdict(int)
    for schema in (DISPATCH, RESULT, REWARD):
        for r in w.of(schema):
            by_step[r["envelope"]["logical_event_id"]] += 1
    revisions = sum(by_step[d["envelope"]["logical_event_id"]] for d in w.of(DISPATCH))
    want = {"raw": inputs, "steps": len(w.of(DISPATCH)), "revisions": revisions, "metrics": len(w.of(METRIC))}
    return lambda: counts(settings) == want


FILTERS = {
    "all": ReportFilters(),
    "hours 2-5": ReportFilters(
        since=datetime(2025, 10, 9, 2, 0, tzinfo=UTC), until=datetime(2025, 10, 9, 5, tzinfo=UTC)
    ),
    "pv-a": ReportFilters(policy_versions=("pv-a",)),
    "pv-b from 01:30": ReportFilters(since=datetime(2025, 10, 9, 1, 30, tzinfo=UTC), policy_versions=("pv-b",)),
}


# --- tests --------------------------------------------------------------------------------------------------------


def test_workload_covers_every_case(run: EvalRun) -> None:
    w = run.workload
    episodes = run.oracle.episodes().values()
    assert {r["status"] for r in w.of(RESULT)} == {"OK", "ERROR", "TIMEOUT", "REJECTED"}
    assert {(e["ended"], e["done"], e["truncated"]) for e in episodes} >= {
        (True, True, False),
        (True, False, True),
        (True, True, True),
        (True, False, False),
        (False, False, False),
    }
    assert {e["policy_version"] for e in episodes} == set(POLICIES) and len(episodes) >= 12
    assert len(w.sends) > sum(len(v) for v in w.records.values()), "some events are sent twice"


def test_sql_objects_equal_the_numbers_computed_from_the_events(run: EvalRun) -> None:
    s, oracle, w = run.settings, run.oracle, run.workload
    calls = records(s, "SELECT count() AS n, uniqExact(event_id) AS ids FROM eval_tool_calls")
    assert calls == [{"n": len(w.of(RESULT)), "ids": len(w.of(RESULT))}]

    hourly = records(
        s,
        "SELECT toUnixTimestamp(h.hour) AS hour, h.tool AS tool, h.agent_id AS agent_id, h.policy_version AS "
        "policy_version, calls, ok, errors, timeouts, rejected, success_rate, latency_p50_ms, latency_p95_ms, "
        "latency_p99_ms FROM eval_tool_stats_hourly AS h ORDER BY hour, policy_version, tool, agent_id",
    )
    assert_same(hourly, Oracle.tools(w.of(RESULT), lambda r: (hour_of(r["envelope"]["event_time"]),)), "hourly")

    episodes = records(
        s,
        "SELECT e.session_id AS session_id, e.episode_id AS episode_id, e.agent_id AS agent_id, "
        "e.policy_version AS policy_version, toUnixTimestamp64Micro(e.started_at) AS started_at, "
        "toBool(e.ended) AS ended, toUnixTimestamp64Micro(e.ended_at) AS ended_at, e.done AS done, "
        "e.truncated AS truncated, e.success AS success, e.steps AS steps, e.rewarded_steps AS rewarded_steps, "
        "e.episode_return AS episode_return, e.tool_calls AS tool_calls, e.cost_usd AS cost_usd, "
        "e.tokens_in AS tokens_in, e.tokens_out AS tokens_out FROM eval_episodes AS e",
    )
    assert_same({(e.pop("session_id"), e.pop("episode_id")): e for e in episodes}, oracle.episodes(), "episodes")

    safety = records(
        s,
        "SELECT p.session_id AS session_id, p.episode_id AS episode_id, p.agent_id AS agent_id, "
        "p.policy_version AS policy_version, toUnixTimestamp64Micro(p.first_event_at) AS first_event_at, "
        "toUnixTimestamp64Micro(p.last_event_at) AS last_event_at, p.pii_checks AS pii_checks, "
        "p.pii_leaks AS pii_leaks, p.pii_leak_rate AS pii_leak_rate, p.alerts AS alerts FROM eval_safety_episodes AS p",
    )
    assert_same({(e.pop("session_id"), e.pop("episode_id")): e for e in safety}, oracle.safety_episodes(), "pii")

    alerts = records(
        s,
        "SELECT toUnixTimestamp(a.hour) AS hour, a.rule, a.severity, a.agent_id, a.policy_version, "
        "a.alerts FROM eval_safety_alerts_hourly AS a",
    )
    expected: dict[tuple, int] = defaultdict(int)
    for m in w.of(METRIC):
        if m["metric"] == "safety_alert":
            expected[(hour_of(m["event_time"]), m["rule"], m["severity"], m["agent_id"], m["policy_version"])] += 1
    assert {tuple(a.values())[:-1]: a["alerts"] for a in alerts} == expected

    prefs = records(
        s,
        "SELECT toUnixTimestamp(p.hour) AS hour, p.policy_version AS policy_version, p.opponent_policy_version AS "
        "opponent_policy_version, judgments, wins, losses, ties, win_rate FROM eval_preference_win_rate AS p "
        "ORDER BY hour, policy_version, opponent_policy_version",
    )
    valid = [p for p in oracle.pref_facts() if _valid_preference(p)]
    assert_same(prefs, win_rates(valid, lambda p: (hour_of(p["envelope"]["event_time"]),)), "win rate")
    [invalid] = records(s, "SELECT countIf(NOT valid) AS invalid, count() AS n FROM eval_preferences")
    assert invalid == {"invalid": 2, "n": len(oracle.pref_facts())}


@pytest.mark.parametrize("name", list(FILTERS))
def test_report_equals_the_numbers_computed_from_the_events(run: EvalRun, name: str) -> None:
    """build_report (the queries `treadle eval` runs) for each filter; the filters change the numbers."""
    filters = FILTERS[name]
    report = build_report(partial(run_sql, run.settings), filters).as_json()
    expected = run.oracle.report(filters)
    assert_same({k: report[k] for k in expected}, expected, name)
    if filters != FILTERS["all"]:
        everything = run.oracle.report(FILTERS["all"])
        assert sum(t["calls"] for t in expected["tools"]) < sum(t["calls"] for t in everything["tools"])
        assert expected["episodes"] != everything["episodes"]
    if filters.policy_versions:
        seen = {row["policy_version"] for section in ("tools", "episodes") for row in report[section]}
        assert seen == set(filters.policy_versions)


def test_treadle_eval_json_and_charts(run: EvalRun, tmp_path: Path) -> None:
    from PIL import Image

    out = tmp_path / "charts"
    done = treadle(run.settings, "eval", "--json", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # one JSON document and nothing else
    expected = run.oracle.report(FILTERS["all"])
    assert_same({k: report[k] for k in expected}, expected, "treadle eval --json")

    names = ["episode_return.png", "success_rate.png", "tool_latency.png", "cost_per_episode.png"]
    assert sorted(Path(p).name for p in report["charts"]) == sorted(names)
    for name in names:
        path = out / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            assert image.format == "PNG" and image.width > 200 and image.height > 200, (name, image.size)
            colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
            assert colours is None or len(colours) > 10, f"{name} is nearly a single colour"


def test_treadle_eval_filters_tables_and_one_line_errors(run: EvalRun, tmp_path: Path) -> None:
    args = ("--since", "2025-10-09T02:00Z", "--until", "2025-10-09T05:00:00+00:00", "--out", str(tmp_path))
    done = treadle(run.settings, "eval", "--json", *args, "--policy-version", "pv-a")
    assert done.returncode == 0, done.stderr
    since, until = datetime(2025, 10, 9, 2, tzinfo=UTC), datetime(2025, 10, 9, 5, tzinfo=UTC)
    expected = run.oracle.report(ReportFilters(since=since, until=until, policy_versions=("pv-a",)))
    report = json.loads(done.stdout)
    assert_same({k: report[k] for k in expected}, expected, "filtered")
    assert report["filters"] == {
        "since": "2025-10-09T02:00:00Z",
        "until": "2025-10-09T05:00:00Z",
        "policy_versions": ["pv-a"],
    }

    tables = treadle(run.settings, "eval", *args)
    assert tables.returncode == 0, tables.stderr
    for title in ("tool calls", "episodes", "safety alerts by rule", "PII leaks", "preference win rate"):
        assert title in tables.stdout
    assert "pv-b" in tables.stdout and "{" not in tables.stdout

    for bad, says in [
        (("--since", "yesterday-ish"), "cannot read --since 'yesterday-ish'"),
        (("--since", "2025-10-09T05:00Z", "--until", "2025-10-09T02:00Z"), "must be before --until"),
        (("--since", "24h"), "no evaluation data since"),  # the workload is from 2025
        (("--policy-version", "nope"), "no evaluation data for policy version(s) nope"),
    ]:
        failed = treadle(run.settings, "eval", *bad, "--out", str(tmp_path))
        assert failed.returncode == 1, failed.stdout
        lines = failed.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], failed.stderr
