"""Plans release latency on the real stack: `python -m bench.plans_latency_bench [--plans 200] [--nodes 5] [--rate 10]`.

A private stack (Kafka + Valkey on the bench ports, moved by TREADLE_BENCH_PORT_SHIFT), one `treadle worker` running
the `plans` processor (under `taskset -c 1` when taskset exists; no sink), and in this process three
`treadle.Executor`s (two of class `cpu`, one of class `gpu`, budgets far above what the plans hold at once, so
admission never makes work wait) whose handlers return at once. `--plans` plans of `--nodes` subgoals (every other
one a chain, the rest random DAGs where a subgoal depends on one or two of the three before it; 30% of the subgoals
in class `gpu`) are submitted with `AgentStream.submit_plan` at a steady `--rate` plans/s from 8 sessions; the first
`--warmup` plans are not measured.

- release latency: for each subgoal with dependencies, the time its executor read the release from its work topic
  (`SubgoalWork.received_at`) minus the latest time a handler of one of its dependencies returned (the executor
  sends that attempt's SUCCEEDED right after). One process, one clock. What it spans: the SUCCEEDED's produce, the
  worker's fetch, the fold, the release's produce to the work topic and the executor's fetch.
- baseline, same run, same broker: a raw produce -> consume round trip (the SDK's producer settings, an
  AIOKafkaConsumer reading every partition like an executor, a topic made like a work topic), paced at the offered
  release rate, half before and half after the plans; one hop, where a release is two plus the worker.

Prints p50/p99/max of both, their ratio, the releases/s achieved beside the offered rate, the load average before and
after and the machine. Exits 1 when a subgoal did not run exactly once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.common import (
    WORKER_CORE,
    bench_settings,
    keep_off_worker_core,
    loadavg,
    local_stack,
    machine_facts,
    taskset_available,
)
from topics.settings import Settings

if TYPE_CHECKING:
    from treadle import AttemptContext, SubgoalWork

SESSIONS = 8
BUDGET = {"gpu_memory_mb": 10**7, "gpus": 10_000, "cpu": 10_000}  # never the bottleneck
EXECUTORS = (("cpu", 0), ("cpu", 1), ("gpu", 0))
PAYLOAD = 300  # bytes of a round-trip record, about a SubgoalReleased's

Node = tuple[str, str, str]  # session, plan, subgoal


def now_us() -> int:
    return time.time_ns() // 1000


def plan_shapes(count: int, nodes: int, seed: int) -> list[list[tuple[str, str, list[str]]]]:
    """Per plan, its subgoals as (id, resource class, depends_on): chains and random DAGs alternately."""
    rng, out = random.Random(seed), []
    for p in range(count):
        subgoals = []
        for i in range(nodes):
            if p % 2 == 0:
                deps = [f"n{i - 1}"] if i else []
            else:
                earlier = list(range(max(0, i - 3), i))
                deps = [f"n{j}" for j in sorted(rng.sample(earlier, min(len(earlier), rng.randint(1, 2))))]
            subgoals.append((f"n{i}", "gpu" if rng.random() < 0.3 else "cpu", deps))
        out.append(subgoals)
    return out


@dataclass
class Probe:
    """What the executors saw, per subgoal (first attempts only: nothing here fails)."""

    received: dict[Node, int] = field(default_factory=dict)  # the executor read the release (UTC micros)
    called: dict[Node, int] = field(default_factory=dict)  # the handler was called (after RUNNING was acked)
    returned: dict[Node, int] = field(default_factory=dict)  # the handler returned
    released_at: dict[Node, int] = field(default_factory=dict)  # the scheduler's event time of the release
    runs: Counter[Node] = field(default_factory=Counter)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    expected: int = 0

    async def handle(self, work: SubgoalWork, ctx: AttemptContext) -> str:
        node = (work.session_id, work.plan_id, work.subgoal_id)
        self.called[node] = now_us()
        self.received[node] = work.received_at
        self.released_at[node] = work.released_at
        self.runs[node] += 1
        self.returned[node] = now_us()
        if len(self.returned) >= self.expected:
            self.done.set()
        return "ok"


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (q in [0, 1]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def summary(values_ms: list[float]) -> str:
    if not values_ms:
        return "no samples"
    return (f"p50 {quantile(values_ms, 0.5):7.1f} ms  p99 {quantile(values_ms, 0.99):7.1f} ms  "
            f"max {max(values_ms):7.1f} ms  ({len(values_ms):,} samples)")  # fmt: skip


async def round_trips(settings: Settings, topic: str, n: int, rate: float) -> list[float]:
    """`n` records produced at `rate`/s with the SDK's producer settings; ms from each send to its consumption."""
    from streams.sdk.producer import create_producer

    producer = create_producer(settings, client_id="bench-roundtrip")
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, enable_auto_commit=False,
                                client_id="bench-roundtrip")  # fmt: skip
    await producer.start()
    await consumer.start()
    latencies: list[float] = []
    try:
        partitions = [TopicPartition(topic, p) for p in sorted(await producer.partitions_for(topic))]
        consumer.assign(partitions)
        await consumer.seek_to_end(*partitions)
        for tp in partitions:
            await consumer.position(tp)

        async def consume() -> None:
            while len(latencies) < n:
                batches = await consumer.getmany(timeout_ms=500)
                received = now_us()
                for messages in batches.values():
                    latencies.extend((received - int.from_bytes(m.value[:8], "big")) / 1000 for m in messages)

        reader = asyncio.get_running_loop().create_task(consume())
        started = time.monotonic()
        for i in range(n):
            await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
            value = now_us().to_bytes(8, "big") + bytes(PAYLOAD - 8)
            await producer.send(topic, value, key=f"session-{i % SESSIONS}".encode())
        await asyncio.wait_for(reader, 60)
    finally:
        await consumer.stop()
        await producer.stop()
    return latencies


async def log_times(settings: Settings, topics: list[str], schema: str) -> dict[tuple[Node, str], int]:
    """{((session, plan, subgoal), state or ""): Kafka timestamp in UTC micros} of the `schema` records on `topics`
    (SubgoalStatus: per state; SubgoalReleased: ""); the timestamp is the producer's, when it took the record."""
    from topics.codec import AvroCodec

    codec, found = AvroCodec(), {}
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = [TopicPartition(t, p) for t in topics for p in sorted(consumer.partitions_for_topic(t) or
                      await _partitions(settings, t))]  # fmt: skip
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        remaining = {tp for tp in partitions if ends[tp] > 0}
        while remaining:
            for tp, messages in (await consumer.getmany(*remaining, timeout_ms=1000)).items():
                for m in messages:
                    name, record = codec.decode(m.value)
                    if name == schema:
                        session = record["envelope"]["session_id"] if "envelope" in record else record["session_id"]
                        node = (session, record["plan_id"], record["subgoal_id"])
                        found[(node, record.get("state", ""))] = m.timestamp * 1000
                    if m.offset + 1 >= ends[tp]:
                        remaining.discard(tp)
    finally:
        await consumer.stop()
    return found


async def _partitions(settings: Settings, topic: str) -> set[int]:
    from streams.sdk.producer import create_producer

    producer = create_producer(settings)
    await producer.start()
    try:
        return await producer.partitions_for(topic)
    finally:
        await producer.stop()


async def run_plans(settings: Settings, args: argparse.Namespace, probe: Probe) -> tuple[dict[Node, list[str]], float]:
    """Start the executors, submit the plans at a steady rate, wait for every subgoal to run; (deps, seconds)."""
    from streams.sdk.plans import Subgoal
    from treadle import AgentStream, Executor

    shapes = plan_shapes(args.warmup + args.plans, args.nodes, args.seed)
    probe.expected = len(shapes) * args.nodes
    deps: dict[Node, list[str]] = {}
    async with AsyncExitStack() as stack:
        for cls, i in EXECUTORS:
            executor = Executor(resource_class=cls, handler=probe.handle, settings=settings,
                                executor_id=f"{settings.topic_prefix}-{cls}-{i}", gpu_free_mb=lambda: None,
                                **BUDGET)  # fmt: skip
            await stack.enter_async_context(executor)
        streams = [await stack.enter_async_context(AgentStream(settings, agent_id="planner"))
                   for _ in range(SESSIONS)]  # fmt: skip
        started = time.monotonic()
        for p, shape in enumerate(shapes):
            await asyncio.sleep(max(0.0, started + p / args.rate - time.monotonic()))
            stream, plan_id = streams[p % SESSIONS], f"plan{p}"
            subgoals = [Subgoal(id=sid, tool="echo", resource_class=cls, depends_on=d, deadline_s=120,
                                profile={"gpu_memory_mb": 100 if cls == "gpu" else 0, "gpus": int(cls == "gpu"),
                                         "cpu": 1})
                        for sid, cls, d in shape]  # fmt: skip
            for sid, _, d in shape:
                deps[(stream.session_id, plan_id, sid)] = d
            await stream.submit_plan(plan_id, subgoals, goal="latency bench")
        try:
            await asyncio.wait_for(probe.done.wait(), args.timeout)
        except TimeoutError:
            pass  # reported as missing subgoals
        elapsed = time.monotonic() - started
    return deps, elapsed


async def measure(settings: Settings, args: argparse.Namespace) -> int:
    from topics.admin import ensure_topics
    from topics.catalog import work_topic_spec

    # made like a work topic (partitions, replication, config), but not named like one: the plans processor's recovery
    # reads every `<prefix>.work.*` topic and expects SubgoalReleased records there
    work = work_topic_spec(settings, "roundtrip")
    spec = replace(work, kind="bench.roundtrip", name=f"{settings.topic_prefix}.bench.roundtrip")
    await ensure_topics([spec], settings.kafka_bootstrap_servers)
    offered = args.rate * args.nodes
    half = max(1, args.round_trips // 2)
    await round_trips(settings, spec.name, min(half, 50), offered)  # warm-up: connections, the broker's JIT
    load_before = loadavg()
    baseline = await round_trips(settings, spec.name, half, offered)
    probe = Probe()
    deps, elapsed = await run_plans(settings, args, probe)
    baseline += await round_trips(settings, spec.name, half, offered)
    load_after = loadavg()

    measured = {node for node in deps if int(node[1].removeprefix("plan")) >= args.warmup}
    latency, to_call, transit = [], [], []
    for node in sorted(measured):
        if node not in probe.received or not deps[node]:
            continue
        parents = [probe.returned.get((node[0], node[1], d)) for d in deps[node]]
        if None in parents:
            continue
        latency.append((probe.received[node] - max(parents)) / 1000)  # type: ignore[type-var]
        to_call.append((probe.called[node] - max(parents)) / 1000)  # type: ignore[type-var]
        transit.append((probe.received[node] - probe.released_at[node]) / 1000)
    # where the time goes, from the producers' record timestamps (ms resolution)
    from topics.catalog import TopicCatalog
    from topics.names import SUBGOAL_RELEASED, SUBGOAL_STATUS

    statuses = await log_times(settings, [TopicCatalog(settings)["plan_events"].name], SUBGOAL_STATUS)
    work_topics = [work_topic_spec(settings, cls).name for cls in sorted({cls for cls, _ in EXECUTORS})]
    releases = await log_times(settings, work_topics, SUBGOAL_RELEASED)
    to_status, in_worker, to_receipt = [], [], []
    for node in sorted(measured):
        if node not in probe.received or not deps[node] or (node, "") not in releases:
            continue
        parents = [(node[0], node[1], d) for d in deps[node]]
        last = max(parents, key=lambda n: probe.returned.get(n, 0))
        if (last, "SUCCEEDED") not in statuses:
            continue
        status_at, release_at = statuses[(last, "SUCCEEDED")], releases[(node, "")]
        to_status.append((status_at - probe.returned[last]) / 1000)
        in_worker.append((release_at - status_at) / 1000)
        to_receipt.append((probe.received[node] - release_at) / 1000)
    receipts = sorted(probe.received[n] for n in measured if n in probe.received)
    span_s = (receipts[-1] - receipts[0]) / 1e6 if len(receipts) > 1 else float("nan")

    pin = "under taskset -c 1" if args.pin else "(not pinned)"
    print(f"{args.plans} plans x {args.nodes} subgoals (chains and random DAGs; {args.warmup} more as warm-up), "
          f"offered {args.rate:g} plans/s = {offered:g} releases/s from {SESSIONS} sessions; "
          f"{len(EXECUTORS)} executors in this process answering at once; `treadle worker` (plans) {pin}; "
          f"{settings.partitions} partitions per work topic")  # fmt: skip
    print(f"  baseline  raw produce -> consume round trip (SDK producer)      {summary(baseline)}")
    print(f"  release   last dependency's return -> executor reads the work  {summary(latency)}")
    if latency and baseline:
        p50 = quantile(latency, 0.5) / quantile(baseline, 0.5)
        p99 = quantile(latency, 0.99) / quantile(baseline, 0.99)
        print(f"            ratio to the baseline: p50 {p50:.1f}x, p99 {p99:.1f}x (a release is two hops + the worker)")
    print(f"  ...       to the handler's call (after RUNNING is acked)       {summary(to_call)}")
    print(f"  ...       release's event time (released_at) -> receipt       {summary(transit)}")
    print("  split by the producers' record timestamps (ms resolution):")
    print(f"    return -> the SUCCEEDED record taken by the executor's producer {summary(to_status)}")
    print(f"    -> the release taken by the worker's producer (fetch + fold)     {summary(in_worker)}")
    print(f"    -> the executor reads it (produce + fetch)                        {summary(to_receipt)}")
    achieved = len(receipts) / span_s if span_s > 0 else float("nan")
    print(f"  achieved  {achieved:,.1f} releases/s received (offered {offered:g}/s; {len(receipts):,} releases in "
          f"{span_s:.1f} s; whole run {elapsed:.1f} s)")  # fmt: skip
    print(f"  load avg  before {load_before}, after {load_after}")
    problems = []
    missing = [n for n in deps if n not in probe.returned]
    if missing:
        problems.append(f"{len(missing)} of {len(deps)} subgoals never ran (first: {missing[0]})")
    twice = [n for n, runs in probe.runs.items() if runs > 1]
    if twice:
        problems.append(f"{len(twice)} subgoals ran more than once (first: {twice[0]})")
    for problem in problems:
        print(f"  CHECK FAILED: {problem}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=200, help="measured plans (200)")
    parser.add_argument("--nodes", type=int, default=5, help="subgoals per plan (5)")
    parser.add_argument("--rate", type=float, default=10.0, help="plans submitted per second (10)")
    parser.add_argument("--warmup", type=int, default=20, help="plans submitted first and not measured (20)")
    parser.add_argument("--round-trips", type=int, default=1000, help="baseline records, half before and half after")
    parser.add_argument("--partitions", type=int, default=4, help="partitions per topic (4)")
    parser.add_argument("--timeout", type=float, default=120.0, help="wait this long for the last subgoal (120 s)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-pin", action="store_true", help="do not pin the worker to one core")
    parser.add_argument("--keep", action="store_true", help="keep the temporary TREADLE_HOME (logs)")
    args = parser.parse_args(argv)
    args.pin = taskset_available() and not args.no_pin
    keep_off_worker_core(args.pin)  # Kafka, Valkey and this process (executors, planner) stay off the worker's core
    print(machine_facts())
    run_id = f"planlat{time.strftime('%H%M%S')}x{os.getpid() % 10_000}"
    home = Path(tempfile.mkdtemp(prefix="treadle-plans-latency-"))
    logging.basicConfig(filename=home / "bench.log", level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    base = bench_settings(home / "stack", run_id, args.partitions)
    settings = base.model_copy(update={"processors": ("plans",), "sink": "off", "home": home / "worker"})
    try:
        with local_stack(base) as up_s:
            from bench.worker_bench import BenchWorker
            from streams.runtime.worker import prepare_cluster

            asyncio.run(prepare_cluster(settings))
            worker = BenchWorker(settings, args.pin).start()
            try:
                ready_s = worker.wait_ready(120)
                print(f"stack up in {up_s:.1f} s (Kafka {base.kafka_bootstrap_servers}); worker pid {worker.pid} "
                      f"ready in {ready_s:.1f} s{f' on core {WORKER_CORE}' if args.pin else ''}")  # fmt: skip
                return asyncio.run(measure(settings, args))
            finally:
                worker.stop()
    finally:
        if args.keep:
            print(f"kept {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
