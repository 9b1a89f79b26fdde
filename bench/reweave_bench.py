"""Re-weave throughput against the live worker's on the same events: `python -m bench.reweave_bench --events 20000`.

Same run, same workload (the weaving bench's: dispatch, tool result and three required rewards per step, 10% late
rewards, 5% duplicates; bench/workload.py):
  1. the live worker: the whole workload in Kafka, then `treadle worker` (pinned to one core), timed from its ready
     signal until every final Transition and late reward is on its topic (the weaving bench's throughput number);
  2. `treadle reweave` with the same policy, in this process pinned to the same core, against the embedded chDB the
     worker's sink wrote: read the step events from raw_events, fold + settle (processors.steps.reweave), write the
     variant's rows; events/s over the step events it read. Its rows are checked against the workload's final
     revisions (computed from the events as sent, not by treadle's code);
  3. the core alone: the same events already decoded in memory, through processors.steps.reweave.reweave.
Target: re-weave >= 1x the worker (it reads a backlog, with no broker, no changelog and no intermediate revisions).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from bench.common import (
    WORKER_CORE,
    Measurement,
    bench_settings,
    keep_off_worker_core,
    loadavg,
    local_stack,
    machine_facts,
    taskset_available,
)
from bench.weaving_sections import Context, _backlog
from bench.worker_bench import backlog_catch_up, cpu_notes
from processors.steps.policy import RewardPolicy, load_policy_file
from processors.steps.reweave import policy_book, reweave
from sinks.clickhouse import ClickHouseStore
from sinks.rows import TABLE_COLUMNS, rows_for
from topics.codec import AvroCodec
from topics.names import DISPATCH, REWARD, TOOL_RESULT
from treadle.reweave import reweave_history

SECTION = "re-weave: throughput (past events)"
KINDS = {DISPATCH: "actions", TOOL_RESULT: "tool_results", REWARD: "rewards"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.reweave_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=20_000, help="input events of the workload (20,000)")
    parser.add_argument("--sessions", type=int, default=500, help="agent sessions the steps spread over (500)")
    parser.add_argument("--partitions", type=int, default=4, help="partitions per topic (4)")
    parser.add_argument("--timeout", type=float, default=300.0, help="give up on the worker's read-back (300 s)")
    parser.add_argument("--no-pin", action="store_true", help="pin neither the worker nor the re-weave to one core")
    parser.add_argument("--keep", action="store_true", help="keep the temporary TREADLE_HOME")
    args = parser.parse_args(argv)
    args.profile = None  # what bench.weaving_sections' Context expects
    return args


def worker_run(ctx: Context, settings, events, expectation) -> Measurement:
    run = backlog_catch_up(settings, events, expectation.final_revisions(), pin=ctx.pin, timeout=ctx.args.timeout,
                           late=frozenset(expectation.late()))  # fmt: skip
    watch = run.watch
    elapsed = run.elapsed_s if run.elapsed_s is not None else ctx.args.timeout
    complete = watch.done_s is not None and not watch.over_revision and not watch.late_unexpected
    timed = run.timed(len(events))
    return Measurement(
        SECTION, "treadle worker, weaving (baseline)",
        f"`treadle worker` {ctx.pin_words}, input already in Kafka: first input record read -> every final Transition "
        "and late reward on its topic", timed, "events", elapsed, complete=complete,
        notes=[run.clock_note(),
               *cpu_notes(run.cpu_s, elapsed, timed),
               *([f"= {timed / run.cpu_s:,.0f} events/s if it had the whole core (its CPU, not the wall clock)"]
                 if run.cpu_s else [])],
    )  # fmt: skip


def step_records(events, codec: AvroCodec) -> list[tuple[str, dict]]:
    """The workload's step events decoded, as raw_events gives them back (duplicates included: fold drops them)."""
    out = []
    for event in events:
        schema_name, record = codec.decode(event.value)
        if schema_name in KINDS:
            out.append((schema_name, record))
    return out


def fill_raw_events(settings, records: list[tuple[str, dict]]) -> None:
    """raw_events as the sink writes it (rows ReplacingMergeTree collapses with the sink's own): the worker's sink
    may not have flushed its last rows when it stopped. Not timed."""
    by_table: dict[str, list[dict]] = {}
    for schema_name, record in records:
        for table, row in rows_for(KINDS[schema_name], record):
            if table == "raw_events":
                by_table.setdefault(table, []).append(row)
    with ClickHouseStore.open(settings) as store:
        columns = TABLE_COLUMNS["raw_events"]
        store.insert_sync("raw_events", [[row[c] for c in columns] for row in by_table["raw_events"]], columns)
        store.command_sync("OPTIMIZE TABLE raw_events FINAL")


def reweave_run(settings, expectation, pin: bool) -> tuple[Measurement, list[str]]:
    """`treadle reweave` with the live policy, in this process; its rows checked against the final revisions."""
    policy: RewardPolicy = load_policy_file(settings.reward_policy)
    report = reweave_history(settings, policy, "bench")
    with ClickHouseStore.open(settings) as store:
        got = dict(store.query_sync("SELECT logical_event_id, revision FROM transitions_variants "
                                    "WHERE variant = 'bench'").result_rows)  # fmt: skip
    want = expectation.final_revisions()
    wrong = [lid for lid, revision in want.items() if got.get(lid) != revision]
    checks = [f"{len(wrong)} of {len(want):,} steps not at their final revision"] if wrong else []
    measured = Measurement(
        SECTION, "treadle reweave (read raw_events, weave, write the variant)",
        f"reweave_history in one process{' under taskset' if pin else ''}, the worker's embedded chDB",
        report.events, "events", report.seconds, baseline="treadle worker, weaving (baseline)", target=1.0,
        complete=not wrong, failed_checks=checks,
        notes=[report.summary(), f"{len(want) - len(wrong):,}/{len(want):,} steps at the final revision"],
    )  # fmt: skip
    return measured, checks


def core_run(settings, records: list[tuple[str, dict]]) -> Measurement:
    book = policy_book(load_policy_file(settings.reward_policy))
    started = time.perf_counter()
    done = reweave(records, book)
    elapsed = time.perf_counter() - started
    return Measurement(
        SECTION, "re-weave core (events in memory)", "processors.steps.reweave.reweave over the decoded events",
        len(records), "events", elapsed, baseline="treadle worker, weaving (baseline)",
        notes=[f"{done.steps:,} steps, {len(done.rows):,} rows"],
    )  # fmt: skip


def render(console: Console, results: list[Measurement]) -> None:
    base = next((m for m in results if m.baseline is None), None)
    for m in results:
        ratio = f" = {m.rate / base.rate:.2f}x the worker" if base is not None and m is not base else ""
        flag = "" if m.complete else " [red]INCOMPLETE OR WRONG[/]"
        console.print(f"[bold]{m.name}[/]: {m.n:,} {m.unit} in {m.elapsed_s:.2f}s = {m.rate:,.0f}/s{ratio}{flag}")
        console.print(f"  [dim]{m.command}[/]")
        for note in m.notes + m.failed_checks:
            console.print(f"  - {note}", markup=False)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 200)
    pin = taskset_available() and not args.no_pin
    keep_off_worker_core(pin)
    run_id = f"reweave{time.strftime('%H%M%S')}x{os.getpid() % 10_000}"
    home = Path(tempfile.mkdtemp(prefix="treadle-reweave-"))
    logging.basicConfig(filename=home / "bench.log", level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    console.print(f"[bold]treadle re-weave bench[/] {run_id}: {os.cpu_count()} cores, loadavg {loadavg()}; {home}")
    console.print(machine_facts(), markup=False)
    ok = True
    try:
        base = bench_settings(home / "stack", run_id, args.partitions)
        with local_stack(base):
            ctx = Context(base, args, pin, home, console)
            settings = ctx.settings("throughput", idle_timeout_s=3600.0, watermark_lag_s=5.0)
            events, expectation, words = _backlog(settings, args.events, args.sessions)
            console.print(f"workload: {len(events):,} input events ({words}); the worker {ctx.pin_words}…")
            worker = worker_run(ctx, settings, events, expectation)
        records = step_records(events, AvroCodec())
        fill_raw_events(settings, records)
        if pin:
            os.sched_setaffinity(0, {WORKER_CORE})
        console.print(f"re-weave of the same events{f' on core {WORKER_CORE}' if pin else ''}…")
        measured, checks = reweave_run(settings, expectation, pin)
        results = [worker, measured, core_run(settings, records)]
        render(console, results)
        ok = worker.complete and not checks
    finally:
        if args.keep:
            console.print(f"[dim]kept {home}[/]")
        else:
            shutil.rmtree(home, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
