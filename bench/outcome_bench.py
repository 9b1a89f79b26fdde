"""`outcome()` latency: from a step's last required reward to the agent holding its woven reward, under paced load.

    python -m bench.outcome_bench [--rate 2000] [--seconds 30] [--sessions 20]

A private stack (Kafka, Valkey) and a worker whose reward policy requires one source (`judge`). `--sessions` agent
streams share one producer and send, paced to `--rate` events/s in all, steps of three events: dispatch, tool result,
then the judge's reward. Right after a step's reward is handed to the producer, the agent awaits `outcome(step)`;
the latency is from that hand-off to `outcome()` returning. The baseline, in the same run: a plain aiokafka consumer
assigned every partition of the woven-rewards topic, noting when each step's WovenReward reaches it (the least any
reader of the topic can see). Both include the worker's own latency; their difference is what `outcome()` adds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.common import bench_settings, local_stack
from streams.runtime.worker import prepare_cluster
from streams.sdk.producer import create_producer
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.names import WOVEN_REWARD
from topics.settings import Settings
from treadle import AgentStream, StepRef
from treadle.devstack.worker_process import WorkerProcess

POLICY = {"version": "outcome-bench", "specs": [{"source": "judge", "window_s": 600, "required": True}]}
EVENTS_PER_STEP = 3
TICK_S = 0.01


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def watch_topic(settings: Settings, seen: dict[str, float], stop: asyncio.Event) -> None:
    """The baseline: when each step's first WovenReward reaches a consumer of the whole topic."""
    topic = TopicCatalog(settings).for_schema(WOVEN_REWARD).name
    codec = AvroCodec()
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, group_id=None)
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in range(settings.partitions)]
        consumer.assign(partitions)
        await consumer.seek_to_end(*partitions)
        while not stop.is_set():
            for messages in (await consumer.getmany(timeout_ms=100)).values():
                now = time.perf_counter()
                for message in messages:
                    _, record = codec.decode(message.value, expect=WOVEN_REWARD)
                    seen.setdefault(record["logical_event_id"], now)
    finally:
        await consumer.stop()


async def agent_load(settings: Settings, rate: float, seconds: float, sessions: int) -> tuple[dict, dict]:
    """(reward hand-off times, outcome() return times) by logical_event_id."""
    producer = create_producer(settings)
    await producer.start()
    sent: dict[str, float] = {}
    answered: dict[str, float] = {}
    waiting: list[asyncio.Task[None]] = []
    streams = [AgentStream(settings, agent_id=f"bench-{i}", producer=producer) for i in range(sessions)]
    try:
        for stream in streams:
            await stream.start()

        async def await_outcome(stream: AgentStream, step: StepRef) -> None:
            asked = time.perf_counter()
            outcome = await stream.outcome(step, timeout=120)
            if not outcome.partial:
                answered[step.logical_event_id] = time.perf_counter()
            else:
                print(f"partial after {time.perf_counter() - asked:.1f}s: step {step.step} of {step.session_id}, "
                      f"signals {outcome.signals}")  # fmt: skip

        steps_per_second = rate / EVENTS_PER_STEP
        n = 0
        started = time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            while n < elapsed * steps_per_second:  # catch up to the pace, then sleep a tick
                stream = streams[n % sessions]
                n += 1
                step = await stream.dispatch("search", {"q": str(n)})
                await stream.tool_result(step, "OK", output="ok", latency_ms=1.0)
                await stream.reward(step, 1.0, source="judge")
                sent[step.logical_event_id] = time.perf_counter()
                waiting.append(asyncio.create_task(await_outcome(stream, step)))
            await asyncio.sleep(TICK_S)
        done, pending = await asyncio.wait(waiting, timeout=120)
        failed = [t.exception() for t in done if t.exception() is not None]
        if failed or pending:
            print(f"{len(failed)} outcome() calls failed (first: {failed[:1]!r}), {len(pending)} still waiting")
    finally:
        for stream in streams:
            await stream.close()
        await producer.stop()
    return sent, answered


async def measure(settings: Settings, rate: float, seconds: float, sessions: int) -> dict:
    seen: dict[str, float] = {}
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_topic(settings, seen, stop))
    await asyncio.sleep(1.0)  # the baseline consumer is at the end of the topic
    sent, answered = await agent_load(settings, rate, seconds, sessions)
    await asyncio.sleep(1.0)
    stop.set()
    await watcher
    outcome_ms = [(answered[lid] - t) * 1000 for lid, t in sent.items() if lid in answered]
    topic_ms = [(seen[lid] - t) * 1000 for lid, t in sent.items() if lid in seen]
    return {
        "steps": len(sent),
        "answered": len(outcome_ms),
        "on_topic": len(topic_ms),
        "outcome_p50_ms": statistics.median(outcome_ms),
        "outcome_p99_ms": percentile(outcome_ms, 0.99),
        "topic_p50_ms": statistics.median(topic_ms),
        "topic_p99_ms": percentile(topic_ms, 0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=2000.0, help="Events/s in all (3 per step).")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--sessions", type=int, default=20)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="treadle-outcome-bench-"))
    policy = home / "policy.json"
    policy.write_text(json.dumps(POLICY))
    run_id = f"outcome{int(time.time())}"
    settings = bench_settings(home, run_id, partitions=3).model_copy(
        update={"reward_policy": policy, "catch_up_backlog": 0}
    )
    with local_stack(settings) as up_s:
        print(f"stack up in {up_s:.1f}s", flush=True)
        asyncio.run(prepare_cluster(settings))
        worker = WorkerProcess(settings, home / "worker.log").start()
        try:
            worker.wait_ready()
            result = asyncio.run(measure(settings, args.rate, args.seconds, args.sessions))
        finally:
            worker.stop()
    print(f"{result['steps']:,} steps at {args.rate:,.0f} events/s over {args.seconds:.0f}s, "
          f"{result['answered']:,} outcomes (not partial), {result['on_topic']:,} seen on the topic")  # fmt: skip
    print(f"outcome(): last required reward -> agent holds the woven reward: p50 {result['outcome_p50_ms']:.0f} ms, "
          f"p99 {result['outcome_p99_ms']:.0f} ms")  # fmt: skip
    print(f"baseline, a consumer of the whole woven-rewards topic:       p50 {result['topic_p50_ms']:.0f} ms, "
          f"p99 {result['topic_p99_ms']:.0f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
