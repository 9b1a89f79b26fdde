"""The reward-weaving benchmark of issue #3: `python -m bench.weaving_bench` (`make bench-weaving`).

Workload (bench/workload.py): every step is a dispatch, a tool result and one reward from each of 3 sources
(judge, metric, human), all required by the reward policy the bench writes; 10% of rewards are late (sent after
window + grace, with their real time as event_time), 5% of events are sent twice (same bytes, a little later).
The expected rows (final revision per step, the late rewards) are computed from the events as sent, not by the
worker's code, and every section checks the worker against them. It starts its own stack like bench.run:
  1. throughput: the whole workload in Kafka before the worker starts (pinned to one core); events/s from its
     first input record until every final Transition and late reward is read back; vs raw consume + decode, and vs
     a minimal Quix Streams app doing the simpler join on the same backlog (bench.peer; --no-peer skips it);
  2. latency at a paced 5,000 input events/s, after --warmup s of it: last required reward acked -> complete row
     visible in ClickHouse;
  3. soak: the paced load for --soak-minutes; worker (and sink) RSS every 10 s, and the open_steps gauge.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from rich.console import Console

from bench.common import (
    WORKER_CORE,
    bench_settings,
    keep_off_worker_core,
    loadavg,
    local_stack,
    machine_facts,
    taskset_available,
    tuned_by_environment,
)
from bench.weaving_sections import SECTIONS, Context, run_section


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.weaving_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=SECTIONS, action="append", help="run only this part (repeatable)")
    parser.add_argument("--events", type=int, default=100_000, help="input events of the throughput run (100,000)")
    parser.add_argument("--rate", type=float, default=5000.0, help="paced input events/s of the latency run (5,000)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of paced load of the latency run (60)")
    parser.add_argument(
        "--warmup",
        type=float,
        default=45.0,
        help="seconds of the same paced load, not measured, before the latency run (45): a fresh broker's JIT "
        "compiler takes ~20%% of the shared core for its first ~40 s of load",
    )
    parser.add_argument("--poll-interval", type=float, default=0.1, help="ClickHouse poll of the latency run (0.1 s)")
    parser.add_argument("--soak-minutes", type=float, default=10.0, help="minutes of the soak (10)")
    parser.add_argument("--soak-rate", type=float, default=2000.0, help="paced input events/s of the soak (2,000)")
    parser.add_argument("--sessions", type=int, default=500, help="agent sessions the steps spread over (500)")
    parser.add_argument("--partitions", type=int, default=4, help="partitions per topic (4)")
    parser.add_argument("--quick", action="store_true", help="small N, 15 s of latency, a 1-minute soak")
    parser.add_argument(
        "--no-peer", action="store_true", help="throughput: skip the Quix Streams peer (it needs quixstreams from PyPI)"
    )
    parser.add_argument("--no-pin", action="store_true", help="do not pin the worker to one core")
    parser.add_argument("--timeout", type=float, default=300.0, help="give up on the throughput read-back (300 s)")
    parser.add_argument(
        "--profile",
        type=Path,
        help="py-spy the worker (raw format) into this file; the latency run into <name>-latency<suffix> and its sink "
        "child into <name>-sink<suffix>",
    )
    parser.add_argument(
        "--trace-memory",
        type=Path,
        help="soak: run the worker under tracemalloc (bench/traced_worker.py) and write its heap growth to this file",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary TREADLE_HOME (logs, data)")
    args = parser.parse_args(argv)
    if args.quick:
        args.events = min(args.events, 20_000)
        args.duration = min(args.duration, 15.0)
        args.warmup = min(args.warmup, 5.0)
        args.soak_minutes = min(args.soak_minutes, 1.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 200)
    pin = taskset_available() and not args.no_pin
    keep_off_worker_core(pin)
    run_id = f"weave{time.strftime('%H%M%S')}x{os.getpid() % 10_000}"
    home = Path(tempfile.mkdtemp(prefix="treadle-weaving-"))
    # Library warnings (aiokafka retrying on a topic created a moment ago) go to a file, not the tables.
    logging.basicConfig(filename=home / "bench.log", level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    console.print(
        f"[bold]treadle weaving bench[/] {run_id}: {os.cpu_count()} cores, loadavg {loadavg()}; home {home}; "
        + (f"worker pinned to core {WORKER_CORE} with taskset, the bench and Kafka off it" if pin else "no pinning")
    )
    console.print(machine_facts(), markup=False)
    failed = False
    started = time.perf_counter()
    try:
        base = bench_settings(home / "stack", run_id, args.partitions)
        tuned = tuned_by_environment(base)
        console.print(f"settings from the environment: {', '.join(tuned)}" if tuned else "default settings")
        with local_stack(base) as up_s:
            console.print(f"[dim]local stack up in {up_s:.1f}s (Kafka {base.kafka_bootstrap_servers})[/]")
            ctx = Context(base, args, pin, home, console)
            for section in args.only or SECTIONS:
                try:
                    if not run_section(section, ctx):
                        failed = True
                        console.print(f"[red]{section}: the worker's rows were wrong or incomplete (see check)[/]")
                except Exception:
                    failed = True
                    console.print(f"[red]{section} failed:[/]\n{traceback.format_exc(limit=8)}")
    finally:
        if args.keep:
            console.print(f"[dim]kept {home}[/]")
        else:
            shutil.rmtree(home, ignore_errors=True)
    console.print(f"[dim]whole run {time.perf_counter() - started:.0f}s[/]")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
