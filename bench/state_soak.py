"""State-graph soak: `python -m bench.state_soak [--minutes 10] [--rate 2000] [--sessions 500]`.

A real `treadle worker` with TREADLE_PROCESSORS=state (sink off, its own local stack) under a paced live load of
agent steps, each a dispatch, a tool result and a delta of 5 node upserts (bench.state_bench's steps), `--rate`
deltas/s for `--minutes`. A session updates a working set of `--working-set` steps' nodes (node ids repeat), so
what the graph holds is bounded and any growth of the worker's memory is the worker's, not the workload's.

Every 10 s: the worker's RSS and CPU, its RocksDB memory (treadle_rocksdb_memory_bytes, the shared cache bounded by
TREADLE_TABLE_MEMORY_MB), and the StateVersions it has published (one per input event). At the end: the RSS slope
over the second half (least squares, MB per minute; flat is the target), split into RocksDB and the rest (the Python
heap and other native memory), and whether the worker kept up (versions behind the events sent); from its
/metrics, how many sessions the idle flush applied after the short wait and after the long one (the worker
lagged), and how many still wait.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from collections.abc import Callable
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
    rocksdb_mb: float | None = None


def second_half_slope(samples: list[Sample], mb: Callable[[Sample], float | None] = lambda s: s.rss_mb) -> float | None:
    """Least-squares slope of `mb` (RSS by default; MB per minute) over the second half of the samples; None if it
    has no spread."""
    points = [(s.at_s, value) for s in samples[len(samples) // 2 :] if (value := mb(s)) is not None]
    slope = slope_mb_per_min(points)
    return None if math.isnan(slope) else slope


def _rss_less_rocksdb(s: Sample) -> float | None:
    return None if s.rss_mb is None or s.rocksdb_mb is None else s.rss_mb - s.rocksdb_mb


def _slope_words(slope: float | None) -> str:
    return "n/a" if slope is None else f"{slope:+.2f} MB/min"


def _sample(page: str, worker_pid: int, at_s: float, sent: int, versions: int) -> Sample:
    """One sample; its RocksDB memory from the worker's /metrics `page` (None if it did not answer)."""
    rocksdb = metric(page, 'treadle_rocksdb_memory_bytes{kind="cache"}')
    rocksdb_mb = None if rocksdb is None else rocksdb / 2**20
    return Sample(at_s, rss_mb(worker_pid), cpu_seconds(worker_pid), sent, versions, rocksdb_mb)


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
                    page = await asyncio.to_thread(scrape, settings.web_port)
                    sample = _sample(page, worker.pid, elapsed, sent, versions)
                    samples.append(sample)
                    rocksdb = "n/a" if sample.rocksdb_mb is None else f"{sample.rocksdb_mb:5.1f}"
                    print(f"  {elapsed:6.0f}s  RSS {sample.rss_mb or 0:7.1f} MB  RocksDB {rocksdb} MB  "
                          f"sent {sent:>10,}  versions {versions:>10,}  behind {sent - versions:>8,}",
                          flush=True)  # fmt: skip
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
            metrics = await asyncio.to_thread(scrape, settings.web_port)
            samples.append(_sample(metrics, worker.pid, end, sent, versions))
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
          f"half {_slope_words(slope)} (RocksDB {_slope_words(second_half_slope(samples, lambda s: s.rocksdb_mb))}, "
          f"the rest {_slope_words(second_half_slope(samples, _rss_less_rocksdb))}); load {loadavg()}")  # fmt: skip
    print(state_waits(metrics))
    return 1 if args.strict and last.versions < last.sent_events else 0


if __name__ == "__main__":
    raise SystemExit(main())
