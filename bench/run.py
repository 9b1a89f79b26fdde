"""treadle's benchmark, in one run: `python -m bench.run` (`make bench`), `--quick` for a short one.

It starts its own local stack (Kafka + Valkey on ports 29492/29493/29479, moved by TREADLE_BENCH_PORT_SHIFT, under a
temporary TREADLE_HOME, Kafka's jars from the repository's .treadle/cache), uses a fresh topic prefix, stops
everything at the end, and prints:
  1. SDK produce events/s vs the raw aiokafka batch API sending pre-encoded bytes (and vs send()); target >= 0.8x
  2. worker input events/s (input -> final Transitions) vs a raw consume + Avro decode loop;    target >= 5,000/s
     on one core (the worker runs under `taskset -c 1` when taskset exists), and when ClickHouse has the rows;
  3. ClickHouseSink rows/s vs a direct chDB insert of the same rows (own process, fresh chDB path).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.common import (
    WORKER_CORE,
    Measurement,
    bench_settings,
    keep_off_worker_core,
    local_stack,
    machine_facts,
    run_module,
    taskset_available,
)

SECTIONS = ("produce", "worker", "sink")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=20_000, help="input events for sections 1 and 2 (20,000)")
    parser.add_argument("--rows", type=int, default=50_000, help="Transition rows for section 3 (50,000)")
    parser.add_argument("--sessions", type=int, default=200, help="agent sessions the events spread over (200)")
    parser.add_argument("--partitions", type=int, default=4, help="partitions per topic (4, the default)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of sections 1 and 3; the median is shown (3)")
    parser.add_argument("--quick", action="store_true", help="small N and one repeat: a smoke run in about a minute")
    parser.add_argument("--only", choices=SECTIONS, action="append", help="run only this section (repeatable)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the worker to one core")
    parser.add_argument("--no-clickhouse", action="store_true", help="skip waiting for the rows in ClickHouse")
    parser.add_argument("--worker-timeout", type=float, default=120.0, help="give up on the worker run after (120s)")
    parser.add_argument("--profile", type=Path, help="record the worker with py-spy (raw/collapsed) into this file")
    parser.add_argument(
        "--worker-cmd",
        help="run this instead of `python -m treadle.cli worker` (to compare variants; it must announce itself "
        "in <home>/worker/worker.json like `treadle worker` does)",
    )
    parser.add_argument("--json", type=Path, help="also write the measurements as JSON here")
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when a measurement is incomplete or a row check fails (smoke)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary TREADLE_HOME (logs, data)")
    args = parser.parse_args(argv)
    if args.quick:
        args.events = min(args.events, 6_000)
        args.rows = min(args.rows, 10_000)
        args.sessions = min(args.sessions, 100)
        args.repeats = 1
    return args


def _fmt_rate(m: Measurement) -> str:
    return f"{m.rate:,.0f}"


def _ratio(m: Measurement, by_name: dict[str, Measurement]) -> float | None:
    base = by_name.get(m.baseline or "")
    return m.rate / base.rate if base is not None and base.rate > 0 else None


def _target(m: Measurement, ratio: float | None) -> str:
    if m.target is None:
        return ""
    if m.target_is_rate:
        ok = m.complete and m.rate >= m.target
        text = f">= {m.target:,.0f}/s"
    else:
        ok = m.complete and ratio is not None and ratio >= m.target
        text = f">= {m.target:.2f}x"
    return f"[green]{text} ok[/]" if ok else f"[red]{text} MISSED[/]"


def render(console: Console, results: list[Measurement], errors: dict[str, str]) -> None:
    by_name = {m.name: m for m in results}
    sections: dict[str, list[Measurement]] = {}
    for m in results:
        sections.setdefault(m.section, []).append(m)
    for section, rows in sections.items():
        table = Table(title=section, title_justify="left", show_lines=True, expand=False)
        table.add_column("measurement", style="bold", no_wrap=True)
        table.add_column("command (what is timed)", max_width=60)
        table.add_column("N", justify="right")
        table.add_column("elapsed s", justify="right")
        table.add_column("rate /s", justify="right")
        table.add_column("vs baseline", justify="right")
        table.add_column("target", no_wrap=True)
        table.add_column("notes", max_width=58, style="dim")
        for m in rows:
            ratio = _ratio(m, by_name)
            notes = list(m.notes)
            if len(m.samples) > 1:
                notes.append("median of " + " / ".join(f"{s:.2f}" for s in m.samples) + " s")
            if not m.complete:
                notes.insert(0, "[red]INCOMPLETE[/]")
            table.add_row(
                m.name,
                m.command,
                f"{m.n:,} {m.unit}",
                f"{m.elapsed_s:.2f}",
                _fmt_rate(m),
                f"{ratio:.2f}x {m.baseline}" if ratio is not None else ("baseline" if _is_baseline(m, results) else ""),
                _target(m, ratio),
                "\n".join(notes),
            )
        console.print(table)
    summary = Table(title="summary", title_justify="left")
    for column in ("measurement", "rate /s", "vs baseline", "target"):
        summary.add_column(column, justify="left" if column == "measurement" else "right")
    for m in results:
        ratio = _ratio(m, by_name)
        if ratio is not None or m.target is not None:
            shown = f"{ratio:.2f}x {m.baseline}" if ratio is not None else ""
            summary.add_row(m.name, _fmt_rate(m), shown, _target(m, ratio) or "none set")
    if summary.row_count:
        console.print(summary)
    for section, error in errors.items():
        console.print(f"[red]{section} failed:[/]\n{error}")


def _is_baseline(m: Measurement, results: list[Measurement]) -> bool:
    return any(other.baseline == m.name for other in results)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 200)
    sections = tuple(args.only or SECTIONS)
    pin = taskset_available() and not args.no_pin
    keep_off_worker_core(pin)
    run_id = f"bench{time.strftime('%H%M%S')}x{os.getpid() % 10_000}"
    home = Path(tempfile.mkdtemp(prefix="treadle-bench-"))
    # Library warnings (e.g. aiokafka retrying on a topic created a moment ago) go to a file, not the tables.
    logging.basicConfig(filename=home / "bench.log", level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    load = os.getloadavg()
    console.print(
        f"[bold]treadle bench[/] {run_id}: {platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} cores, load avg {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}; home {home}"
    )
    console.print(machine_facts(), markup=False)
    if load[0] > 0.5:
        console.print("[yellow]the machine is busy (load avg > 0.5): numbers will be lower and noisier[/]")
    if pin:
        console.print(
            f"pinning: the worker and the section-2 baselines run under `taskset -c {WORKER_CORE}`; this bench "
            f"process (producers, read-back) and the Kafka + Valkey it starts keep off core {WORKER_CORE}; "
            "section 3 may use every core"
        )
    else:
        why = "--no-pin" if args.no_pin else "taskset missing or a single core"
        console.print(f"pinning: none ({why}); the worker may use every core")

    results: list[Measurement] = []
    errors: dict[str, str] = {}
    info: list[str] = []
    started = time.perf_counter()
    try:
        if "produce" in sections or "worker" in sections:
            base = bench_settings(home / "stack", run_id, args.partitions)
            console.print("starting the local stack (Kafka + Valkey)…")
            try:
                with local_stack(base) as up_s:
                    info.append(f"local stack up in {up_s:.1f}s (Kafka {base.kafka_bootstrap_servers})")
                    if "produce" in sections:
                        results += _section(console, errors, "produce", lambda: _produce(base, args))
                    if "worker" in sections:
                        results += _section(console, errors, "worker", lambda: _worker(base, args, pin, info, home))
                    console.print("stopping the local stack…")
            except Exception as exc:  # e.g. a port taken by a bench that did not stop: say so, go on to the sink
                errors["local stack"] = f"{type(exc).__name__}: {exc}"
        if "sink" in sections:
            results += _section(console, errors, "sink", lambda: _sink(args, home))
    finally:
        if args.keep:
            info.append(f"kept {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)
    render(console, results, errors)
    for line in info:
        console.print(f"[dim]{line}[/]")
    console.print(f"[dim]whole run {time.perf_counter() - started:.0f}s[/]")
    if args.json:
        args.json.write_text(json.dumps([m.to_json() for m in results], indent=2))
    wrong = [m.name for m in results if not m.complete or m.failed_checks]
    if args.strict and wrong:
        console.print(f"[red]incomplete or wrong rows: {', '.join(wrong)}[/]")
        return 1
    return 1 if errors else 0


def _section(console: Console, errors: dict[str, str], name: str, run) -> list[Measurement]:
    with console.status(f"section {name}…"):
        try:
            return run()
        except Exception:
            errors[name] = traceback.format_exc(limit=6)
            return []


def _produce(base, args: argparse.Namespace) -> list[Measurement]:
    import asyncio

    from bench.produce import produce_section
    from streams.runtime.worker import prepare_cluster

    settings = base.model_copy(update={"topic_prefix": f"{base.topic_prefix}p", "app_id": f"{base.app_id}p"})
    asyncio.run(prepare_cluster(settings))
    return produce_section(settings, args.events, min(args.sessions, args.events // 3 or 1), args.repeats)


def _worker(base, args: argparse.Namespace, pin: bool, info: list[str], home: Path) -> list[Measurement]:
    from bench.worker_bench import worker_section

    settings = base.model_copy(
        update={"topic_prefix": f"{base.topic_prefix}w", "app_id": f"{base.app_id}w", "home": home / "worker"}
    )
    results, lines = worker_section(
        settings,
        events=args.events,
        sessions=args.sessions,
        pin=pin,
        timeout=args.worker_timeout,
        clickhouse=not args.no_clickhouse,
        profile=args.profile.resolve() if args.profile else None,
        log_dir=home,
        worker_argv=shlex.split(args.worker_cmd) if args.worker_cmd else None,
    )
    info.extend(lines)
    return results


def _sink(args: argparse.Namespace, home: Path) -> list[Measurement]:
    return run_module(
        "bench.sink_bench",
        ["--rows", str(args.rows), "--home", str(home / "sink"), "--repeats", str(max(1, min(args.repeats, 3)))],
        pin=False,
        timeout=180,
        log=home / "sink.log",
    )


if __name__ == "__main__":
    sys.exit(main())
