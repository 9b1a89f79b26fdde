"""The weaving bench's peer: bench.quix_peer (a minimal Quix Streams app) on the same backlog as the treadle worker.

Quix Streams is no dependency of treadle: the peer runs in the bench's own environment, PEER_ENV, made on demand
from the pinned bench/peer_requirements.txt (pip downloads cached in .cache/pip, as the Makefile does). The peer is
pinned to the worker's core and timed like the worker: from its first record (its mark file) until every step's
joined record is on its output topic; CPU per event from its process CPU at that mark.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from bench.common import REPO_ROOT, Measurement, cpu_seconds, pinned
from topics.catalog import TopicCatalog
from topics.schemas import SchemaSet
from topics.settings import Settings

PEER_ENV = REPO_ROOT / ".treadle" / "bench-env"
REQUIREMENTS = REPO_ROOT / "bench" / "peer_requirements.txt"
PEER_NAME = "Quix Streams peer"


def peer_python() -> tuple[Path | None, str]:
    """The bench environment's interpreter, made or brought up to date with REQUIREMENTS; None and why if it can't."""
    python, stamp = PEER_ENV / "bin" / "python", PEER_ENV / ".requirements"
    wanted = REQUIREMENTS.read_text()
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python, f"bench environment {PEER_ENV.relative_to(REPO_ROOT)} (up to date)"
    env = {**os.environ, "PIP_CACHE_DIR": os.environ.get("PIP_CACHE_DIR", str(REPO_ROOT / ".cache" / "pip"))}
    started = time.perf_counter()
    steps = [
        [sys.executable, "-m", "venv", str(PEER_ENV)],
        [str(python), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)],
    ]
    for argv in steps:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            return None, f"could not make the bench environment ({' '.join(argv[-3:])}): {last[0]}"
    stamp.write_text(wanted)
    return python, f"bench environment {PEER_ENV.relative_to(REPO_ROOT)} made in {time.perf_counter() - started:.0f}s"


@dataclass
class PeerRun:
    """What the peer did: seconds and CPU seconds from its first record to the last joined step read back."""

    elapsed_s: float | None
    cpu_s: float | None
    joined: int
    note: str


def quix_catch_up(
    settings: Settings, python: Path, expected: set[str], *, pin: bool, timeout: float, home: Path
) -> PeerRun:
    """Run the peer over the input topics of `settings` (already holding the backlog) until every step in `expected`
    has its joined record on the peer's output topic, or `timeout`."""
    home.mkdir(parents=True, exist_ok=True)
    catalog, schemas = TopicCatalog(settings), SchemaSet.load()
    inputs = {spec.name: schemas[spec.value_schema].json for spec in catalog.inputs}
    (home / "schemas.json").write_text(json.dumps(inputs))
    output, mark = f"{settings.topic_prefix}.quix_joined", home / "first-record.json"
    asyncio.run(_create_topic(settings, output))
    argv = [
        str(python), "-m", "bench.quix_peer", "--bootstrap", settings.kafka_bootstrap_servers,
        "--group", f"{settings.app_id}-quix", "--schemas", str(home / "schemas.json"), "--output", output,
        "--mark", str(mark), "--state-dir", str(home / "state"),
    ]  # fmt: skip
    with (home / "quix.log").open("wb") as log:
        proc = subprocess.Popen(pinned(argv, pin), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        started_at, done_s, joined = asyncio.run(_read_joined(settings, output, expected, timeout, proc))
        cpu_after = cpu_seconds(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    if not mark.exists():
        tail = (home / "quix.log").read_text(errors="replace").strip().splitlines()[-3:]
        return PeerRun(None, None, joined, f"the peer never handled a record (exit {proc.returncode}): {tail}")
    first = json.loads(mark.read_text())
    elapsed = None if done_s is None else started_at + done_s - first["read_at"]
    cpu = cpu_after - first["cpu_s"] if cpu_after is not None else None
    return PeerRun(elapsed, cpu, joined, f"log {home / 'quix.log'}")


async def _create_topic(settings: Settings, name: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, settings.partitions, 1)])
    finally:
        await admin.close()


async def _read_joined(
    settings: Settings, topic: str, expected: set[str], timeout: float, proc: subprocess.Popen[bytes]
) -> tuple[float, float | None, int]:
    """(Unix time of the clock start, seconds until every expected step was read back or None, steps read back)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap_servers, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in range(settings.partitions)]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        started, started_at, pending = time.perf_counter(), time.time(), set(expected)
        while pending and time.perf_counter() - started < timeout and proc.poll() is None:
            batches = await consumer.getmany(timeout_ms=100, max_records=5000)
            for messages in batches.values():
                for message in messages:
                    pending.discard(json.loads(message.value)["logical_event_id"])
        done = None if pending else time.perf_counter() - started
        return started_at, done, len(expected) - len(pending)
    finally:
        await consumer.stop()


def peer_measurement(section: str, run: PeerRun, n: int, expected: int, pin_words: str, timeout: float) -> Measurement:
    notes = [f"joined {run.joined:,}/{expected:,} steps", run.note]
    if run.cpu_s is not None and n > 0:
        notes.append(f"peer CPU {run.cpu_s:.1f}s = {1e6 * run.cpu_s / n:.0f} us of CPU per input event")
    return Measurement(
        section, PEER_NAME,
        f"`python -m bench.quix_peer` (quixstreams, bench/peer_requirements.txt) {pin_words}, same backlog: from its "
        "first record until every step's joined record is on its output topic (one join per step: no windows, "
        "revisions, late table or dead letters)",
        n, "events", run.elapsed_s if run.elapsed_s is not None else timeout, baseline="raw consume+decode",
        complete=run.elapsed_s is not None, notes=notes,
    )  # fmt: skip


def versus_line(treadle_rate: float, treadle_cpu_us: float | None, peer: Measurement, peer_cpu_us: float | None) -> str:
    """treadle against the peer: the events/s and CPU/event ratios beside the issue's targets (>= 2x, <= 0.5x)."""
    rate = treadle_rate / peer.rate if peer.rate > 0 else float("nan")
    words = f"treadle vs {PEER_NAME}: events/s {rate:.2f}x (target >= 2x)"
    if treadle_cpu_us is not None and peer_cpu_us:
        words += f", CPU per event {treadle_cpu_us / peer_cpu_us:.2f}x (target <= 0.5x)"
    return words
