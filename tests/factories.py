"""Builders for input records, a raw producer, and polling helpers shared by the integration tests."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from tests.paths import REPO_ROOT
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.ids import uuid7
from topics.names import STATE_VERSION
from topics.settings import Settings

BASE_TIME = 1_760_000_000_000_000  # micros


def envelope(session: str, lid: str, seq: int, *, event_time: int | None = None, event_id: str | None = None) -> dict:
    return {
        "event_id": event_id or uuid7(),
        "session_id": session,
        "agent_id": "agent-test",
        "episode_id": f"{session}-ep0",
        "logical_event_id": lid,
        "seq": seq,
        "event_time": event_time if event_time is not None else BASE_TIME + seq * 1000,
        "policy_version": "v1",
        "trace_id": f"trace-{lid}",
        "attributes": {},
    }


def dispatch(session: str, lid: str, step: int, seq: int, tool: str = "search", params: str = '{"q": "x"}') -> dict:
    return {
        "envelope": envelope(session, lid, seq),
        "step": step,
        "tool": tool,
        "params_json": params,
        "deadline": None,
    }


def result(session: str, lid: str, seq: int, status: str = "OK", latency: float = 12.5) -> dict:
    return {
        "envelope": envelope(session, lid, seq),
        "tool": "search",
        "status": status,
        "output": f"out-{lid}",
        "error": None if status == "OK" else "boom",
        "latency_ms": latency,
        "cost_usd": 0.01,
        "tokens_in": 10,
        "tokens_out": 5,
        "retries": 0,
    }


def reward(session: str, lid: str, seq: int, value: float, source: str = "judge", confidence: float = 1.0) -> dict:
    return {
        "envelope": envelope(session, lid, seq),
        "source": source,
        "name": "quality",
        "value": value,
        "confidence": confidence,
        "annotator": "LLM",
        "evidence": None,
    }


KIND_OF = {
    "treadle.events.ActionDispatched": "actions",
    "treadle.events.ToolResult": "tool_results",
    "treadle.events.RewardSignal": "rewards",
    "treadle.events.LifecycleEvent": "lifecycle",
    "treadle.events.LlmCall": "llm_calls",
    "treadle.events.StateDelta": "state_deltas",
}


class RawProducer:
    """Sends encoded records (or arbitrary bytes) straight to the catalog's topics."""

    def __init__(self, settings: Settings, codec: AvroCodec | None = None) -> None:
        self.settings = settings
        self.catalog = TopicCatalog(settings)
        self.codec = codec or AvroCodec()
        self.producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap_servers, acks="all")

    async def __aenter__(self) -> RawProducer:
        await self.producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.stop()

    async def send(self, schema_name: str, record: dict[str, Any]) -> None:
        topic = self.catalog[KIND_OF[schema_name]].name
        key = record["envelope"]["session_id"].encode()
        await self.producer.send(topic, self.codec.encode(schema_name, record), key=key)

    async def send_bytes(self, kind: str, value: bytes | None, key: bytes | None = b"s-bad") -> None:
        await self.producer.send(self.catalog[kind].name, value, key=key)

    async def flush(self) -> None:
        await self.producer.flush()


def isolated_deployment(base: Settings, home: Path, name: str, web_port: int, sql_port: int) -> Settings:
    """Settings for one deployment on a running stack: its own topics (created here), app id, home and ports."""
    from streams.runtime.worker import prepare_cluster

    settings = base.model_copy(
        update={
            "home": home,
            "topic_prefix": name,
            "app_id": name,
            "web_port": web_port,
            "sql_port": sql_port,
            "sink_flush_seconds": 0.2,
        }
    )
    asyncio.run(prepare_cluster(settings))
    return settings


async def send_records(settings: Settings, events: list[tuple[str, dict[str, Any]]]) -> None:
    """Send (schema name, record) pairs in order, keyed by session, and wait for the broker's acknowledgements."""
    async with RawProducer(settings) as producer:
        for schema_name, record in events:
            await producer.send(schema_name, record)
        await producer.flush()


def wait_for(
    check: Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = 0.5,
    explain: Callable[[], str] | None = None,
) -> Any:
    """Poll `check` until truthy; on timeout, `explain` says what was still wrong."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    detail = explain() if explain is not None else f"last value: {last!r}"
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; {detail}")


def treadle(settings: Settings, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`treadle ARGS` in a subprocess against `settings`, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "treadle.cli", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **settings.to_env(), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def step_components(settings: Settings, session: str, source: str) -> dict[str, dict[str, Any]]:
    """Per step of `session`: transition revision, reward, and `source`'s components {event_id: (value, confidence,
    evidence)}, from transitions_latest."""
    from sinks.sql_client import run_sql

    _, rows = run_sql(
        settings,
        "SELECT logical_event_id, revision, reward, reward_components.event_id, reward_components.source, "
        "reward_components.value, reward_components.confidence, reward_components.evidence "
        f"FROM transitions_latest WHERE session_id = '{session}'",
    )
    out = {}
    for lid, revision, reward, ids, sources, values, confidences, evidence in rows:
        parts = zip(ids, sources, values, confidences, evidence, strict=True)
        out[lid] = {"revision": revision, "reward": reward,
                    "components": {i: (v, c, e) for i, s, v, c, e in parts if s == source}}  # fmt: skip
    return out


def scrape(settings: Settings) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the worker's /metrics, keyed by (sample name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{settings.web_port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


async def published_versions(settings: Settings, sessions: list[str]) -> dict[str, list[dict]]:
    """Each session's StateVersion records as the state processor published them on `state_versions` (what the
    contracts processor folds), one per ordinal, in ordinal order. A replay after a crash or a rebalance publishes a
    commit's versions again: each must be the one published before (versions are published only once committed)."""
    topic, codec = TopicCatalog(settings)["state_versions"].name, AvroCodec()
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, enable_auto_commit=False)
    await consumer.start()
    chains: dict[str, dict[int, dict]] = {session: {} for session in sessions}
    try:
        tps = [TopicPartition(topic, p) for p in range(settings.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        remaining = {tp for tp in tps if end[tp] > 0}
        deadline = time.monotonic() + 60
        while remaining and time.monotonic() < deadline:
            for tp, messages in (await consumer.getmany(*remaining, timeout_ms=500)).items():
                for message in messages:
                    if message.offset >= end[tp]:
                        break
                    _, version = codec.decode(message.value, STATE_VERSION)
                    chain = chains.get(version["session_id"])
                    if chain is not None:
                        first = chain.setdefault(version["ordinal"], version)
                        assert first == version, f"two versions published as one ordinal: {first} and {version}"
                    if message.offset + 1 >= end[tp]:
                        remaining.discard(tp)
        assert not remaining, f"did not read {topic} to its end: {remaining}"
    finally:
        await consumer.stop()
    return {session: [chain[o] for o in sorted(chain)] for session, chain in chains.items()}
