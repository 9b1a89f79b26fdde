"""State-graph soak: `python -m bench.state_soak [--minutes 10] [--rate 2000] [--sessions 500]`.

A real `treadle worker` with TREADLE_PROCESSORS=state (sink off, its own local stack) under a paced live load of
agent steps, each a dispatch, a tool result and a delta of 5 node upserts (bench.state_bench's steps), `--rate`
deltas/s for `--minutes`. A session updates a working set of `--working-set` steps' nodes (node ids repeat), so
what the graph holds is bounded and any growth of the worker's memory is the worker's, not the workload's.

Every 10 s: the worker's RSS and CPU, and the StateVersions it has published (one per input event). At the end:
the RSS slope over the second half (least squares, MB per minute; flat is the target), and whether the worker kept
up (versions behind the events sent); from its /metrics, how many sessions the idle flush applied after the short
wait and after the long one (the worker lagged), and how many still wait.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import bench_settings, cpu_seconds, loadavg, local_stack, machine_facts
from bench.state_bench import step_events
from bench.weaving_report import metric, rss_mb, scrape, slope_mb_per_min
from topics.names import DISPATCH, STATE_DELTA, TOOL_RESULT
from topics.settings import Settings

SAMPLE_EVERY_S = 10.0
KINDS = {DISPATCH: "actions", TOOL_RESULT: "tool_results", STATE_DELTA: "state_deltas"}


@dataclass(frozen=True)
class Sample:
    at_s: float
    rss_mb: float | None
    cpu_s: float | None
    sent_events: int
    versions: int


def second_half_slope(samples: list[Sample]) -> float | None:
    """Least-squares slope of RSS (MB per minute) over the second half of the samples; None if it has no spread."""
    slope = slope_mb_per_min([(s.at_s, s.rss_mb) for s in samples[len(samples) // 2 :] if s.rss_mb is not None])
    return None if math.isnan(slope) else slope


def state_waits(text: str) -> str:
    """How the worker's reorder buffers were released (treadle_state_flushes_total, ..._waiting_sessions), in words."""
    if not text:
        return "state waits: no metrics (/metrics did not answer)"
    short = metric(text, 'treadle_state_flushes_total{wait="short"}') or 0.0
    long = metric(text, 'treadle_state_flushes_total{wait="long"}') or 0.0
    waiting = metric(text, "treadle_state_waiting_sessions") or 0.0
    return (f"state waits: sessions applied by the idle flush {short:,.0f} (short wait) and {long:,.0f} (long wait: "
            f"the worker lagged); sessions waiting at the end {waiting:,.0f}")  # fmt: skip


async def _soak(settings: Settings, args: argparse.Namespace) -> tuple[list[Sample], str]:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    from bench.worker_bench import BenchWorker
    from streams.runtime.worker import prepare_cluster
    from streams.sdk.producer import producer_config
    from topics.catalog import TopicCatalog
    from topics.codec import AvroCodec

    await prepare_cluster(settings)
    catalog, codec = TopicCatalog(settings), AvroCodec()
    topics = {schema: catalog[name].name for schema, name in KINDS.items()}
    env, argv = None, None
    if args.trace_memory is not None:  # what the RSS growth is made of (bench.traced_worker)
        env = {"TREADLE_TRACE_OUT": str(args.trace_memory.resolve())}
        argv = [sys.executable, "-m", "bench.traced_worker"]
    worker = BenchWorker(settings, pin=False, argv=argv, env=env).start()
    samples: list[Sample] = []
    metrics = ""
    try:
        await asyncio.to_thread(worker.wait_ready, 180)
        producer = AIOKafkaProducer(**producer_config(settings, client_id="state-soak"))
        consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, auto_offset_reset="earliest")
        await producer.start()
        await consumer.start()
        versions = 0

        async def count_versions() -> None:
            nonlocal versions
            out = catalog["state_versions"].name
            consumer.assign([TopicPartition(out, p) for p in range(settings.partitions)])
            while True:
                for messages in (await consumer.getmany(timeout_ms=200, max_records=10_000)).values():
                    versions += len(messages)

        counter = asyncio.create_task(count_versions())
        try:
            sent, step, started = 0, 0, time.perf_counter()
            next_sample, duration = 0.0, args.minutes * 60
            while (elapsed := time.perf_counter() - started) < duration:
                if elapsed >= next_sample:
                    samples.append(Sample(elapsed, rss_mb(worker.pid), cpu_seconds(worker.pid), sent, versions))
                    print(f"  {elapsed:6.0f}s  RSS {samples[-1].rss_mb or 0:7.1f} MB  sent {sent:>10,}  "
                          f"versions {versions:>10,}", flush=True)  # fmt: skip
                    next_sample += SAMPLE_EVERY_S
                due = int(elapsed * args.rate) + 1
                while step < due:
                    session = f"s{step % args.sessions}"
                    k = step // args.sessions
                    t = time.time_ns() // 1000
                    for schema, record in step_events(session, k % args.working_set, 3 * k, t, 5):
                        record["envelope"]["logical_event_id"] = f"{session}-step-{k}"
                        await producer.send(topics[schema], codec.encode(schema, record), key=session.encode())
                        sent += 1
                    step += 1
                await asyncio.sleep(0.02)
            await producer.flush()
            deadline = time.perf_counter() + 60
            while versions < sent and time.perf_counter() < deadline:
                await asyncio.sleep(1)
            end = time.perf_counter() - started
            samples.append(Sample(end, rss_mb(worker.pid), cpu_seconds(worker.pid), sent, versions))
            metrics = await asyncio.to_thread(scrape, settings.web_port)
        finally:
            counter.cancel()
            await producer.stop()
            await consumer.stop()
    finally:
        worker.stop()
    return samples, metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.state_soak", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="minutes of paced load (10)")
    parser.add_argument("--rate", type=float, default=2000.0, help="deltas (steps of 3 events) per second (2,000)")
    parser.add_argument("--sessions", type=int, default=500, help="sessions the steps spread over (500)")
    parser.add_argument("--working-set", type=int, default=64, help="steps' nodes a session keeps updating (64)")
    parser.add_argument("--strict", action="store_true", help="exit 1 unless every event's StateVersion came out")
    parser.add_argument(
        "--trace-memory",
        type=Path,
        default=None,
        help="run the worker under tracemalloc (bench.traced_worker) and write its heap growth here",
    )
    args = parser.parse_args(argv)
    print(machine_facts())
    print(f"state soak: {args.rate:,.0f} deltas/s ({3 * args.rate:,.0f} events/s) for {args.minutes:g} min over "
          f"{args.sessions} sessions; worker RSS every {SAMPLE_EVERY_S:.0f} s; load {loadavg()}")  # fmt: skip
    with tempfile.TemporaryDirectory() as home:
        settings = bench_settings(Path(home), f"statesoak{int(time.time())}", 4)
        settings = settings.model_copy(update={"processors": ("state",), "sink": "off"})
        with local_stack(settings):
            samples, metrics = asyncio.run(_soak(settings, args))
    first, last = samples[0], samples[-1]
    minutes = (last.at_s - first.at_s) / 60 or 1.0
    cpu = (last.cpu_s or 0.0) - (first.cpu_s or 0.0)  # to the end of the catch-up wait: the work of every event
    slope = second_half_slope(samples)
    print(f"sent {last.sent_events:,} events ({last.sent_events / 3 / (args.minutes * 60):,.0f} deltas/s); versions "
          f"published {last.versions:,} ({last.sent_events - last.versions:,} behind at the end); worker CPU "
          f"{cpu / (minutes * 60):.0%} of a core")  # fmt: skip
    rss = [s.rss_mb for s in samples if s.rss_mb is not None]
    print(f"worker RSS: first {rss[0]:.0f} MB, peak {max(rss):.0f} MB, last {rss[-1]:.0f} MB; slope over the second "
          f"half {'n/a' if slope is None else f'{slope:+.2f} MB/min'}; load {loadavg()}")  # fmt: skip
    print(state_waits(metrics))
    return 1 if args.strict and last.versions < last.sent_events else 0


if __name__ == "__main__":
    raise SystemExit(main())
