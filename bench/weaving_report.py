"""What the weaving bench reads back and prints: the ClickHouse check, latency percentiles, RSS samples."""

from __future__ import annotations

import argparse
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.common import Measurement
from bench.paced import COMPLETE_SQL, Observed, PacedRun
from bench.workload import WeavingExpectation
from topics.settings import Settings

FINAL_SQL = (
    "SELECT logical_event_id, max(revision), argMax(reward_status, revision) FROM transitions GROUP BY logical_event_id"
)
LATE_SQL = "SELECT event_id, argMax(reason, revision) FROM late_rewards GROUP BY event_id"


def render_throughput(console: Console, results: list[Measurement]) -> None:
    from bench.run import render

    render(console, results, {})


# --- correctness in ClickHouse -----------------------------------------------------------------------------------


@dataclass
class Check:
    """The final rows in ClickHouse against the expectation (after every window closed, or the timeout)."""

    steps: int
    final: int = 0  # steps whose highest revision is the expected final one
    over: int = 0  # steps with a revision above it: a correctness bug
    wrong_status: int = 0  # final row not `complete` where every required reward came in time, or vice versa
    late: int = 0
    late_expected: int = 0
    late_unexpected: int = 0  # AFTER_GRACE rows for rewards that were in time
    waited_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.final == self.steps and not self.over and not self.wrong_status and self.late_ok

    @property
    def late_ok(self) -> bool:
        return self.late == self.late_expected and not self.late_unexpected

    def words(self) -> str:
        return (
            f"{self.final:,}/{self.steps:,} steps at their final revision, {self.over} above it, "
            f"{self.wrong_status} with a wrong final reward_status; late rewards {self.late:,}/{self.late_expected:,}"
            f", {self.late_unexpected} unexpected (checked {self.waited_s:.0f}s after the load)"
        )


def check_in_clickhouse(settings: Settings, expectation: WeavingExpectation, timeout: float) -> Check:
    """Poll the final rows until they match (windows close one watermark lag + idle timeout after the load)."""
    from sinks.sql_client import run_sql

    started = time.perf_counter()
    late = expectation.late()
    while True:
        check = Check(len(expectation.steps), late_expected=len(late))
        for lid, revision, status in run_sql(settings, FINAL_SQL)[1]:
            step = expectation.steps.get(lid)
            if step is None:
                continue
            want = step.final_revision
            check.final += revision == want
            check.over += revision > want
            if revision == want:
                check.wrong_status += (status == "complete") != step.complete
        for event_id, reason in run_sql(settings, LATE_SQL)[1]:
            if reason == "AFTER_GRACE":
                check.late += event_id in late
                check.late_unexpected += event_id not in late
        check.waited_s = time.perf_counter() - started
        if check.ok or check.waited_s > timeout:
            return check
        time.sleep(2.0)


# --- latency -----------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


@dataclass
class Latencies:
    """Seconds from each complete step's last required reward's ack to: its complete row in ClickHouse (visible),
    its complete Transition on the topic (published), the producer timestamp the worker gave that Transition
    (produced), and a raw consumer's receipt of that reward (floor)."""

    visible: list[float]
    published: list[float]
    produced: list[float]
    floor: list[float]
    no_ack: int = 0


def latencies(seen: Observed) -> Latencies:
    out = Latencies([], [], [], [])
    inf = float("inf")
    for lid, step in seen.expectation.steps.items():
        if not step.complete:
            continue
        acks = [seen.run.acks.get(eid) for eid, (src, t) in step.rewards.items() if not step.is_late(src, t)]
        if any(a is None for a in acks):
            out.no_ack += 1
            continue
        acked, value = max(acks)  # type: ignore[type-var]
        out.visible.append(seen.poller.seen.get(lid, inf) - acked)  # inf: not seen within the poller's horizon
        out.published.append(seen.published.at.get(lid, inf) - acked)
        out.produced.append(seen.published.created.get(lid, inf) - acked)
        received = seen.receipts.at.get(value)
        if received is not None:
            out.floor.append(received - acked)
    return out


def latency_table(
    console: Console, pin_words: str, args: argparse.Namespace, seen: Observed, check: Check, notes: list[str]
) -> None:
    found = latencies(seen)
    run, poller, queries = seen.run, seen.poller, seen.poller.query_s
    complete = sum(step.complete for step in seen.expectation.steps.values())
    table = _table("weaving: latency at a paced input rate", ["N", "p50 s", "p90 s", "p99 s", "max s", "target"])
    table.add_row(
        "raw Kafka delivery",
        "the same last required reward: broker ack -> a raw consumer of the rewards topic in the bench has it",
        f"{len(found.floor):,}",
        *_quantiles(found.floor),
        "baseline",
        "consumer polls with getmany(timeout_ms=50); negative: received before the ack callback ran",
    )
    table.add_row(
        "complete Transition on the topic",
        "last required reward acked -> a raw consumer of the transitions topic reads the step's first Transition "
        "with reward_status = 'complete' (the worker's part, before the sink)",
        f"{len(found.published):,} steps",
        *_quantiles(found.published),
        "",
        "inf: not on the topic before the poller gave up",
    )
    table.add_row(
        "complete Transition produced",
        "the same step: last required reward acked -> the producer timestamp (CreateTime, ms) of that Transition, "
        "i.e. when the worker sent it; unlike the line above, free of the bench process's own delay in reading",
        f"{len(found.produced):,} steps",
        *_quantiles(found.produced),
        "",
        "the bench shares a core with Kafka and the sink: a busy bench reads late",
    )
    p99 = percentile(found.visible, 99)
    ok = check.ok and found.visible and p99 <= 2.0 and abs(run.rate - args.rate) <= 0.05 * args.rate
    table.add_row(
        "complete row visible",
        f"`treadle worker` {pin_words}, paced producer: last required reward acked -> its step's row with "
        f"reward_status = 'complete' first returned by `{COMPLETE_SQL.format(since='<oldest pending>')}` "
        "via run_sql (the worker's sink endpoint)",
        f"{len(found.visible):,} steps",
        *_quantiles(found.visible),
        "[green]p99 <= 2 s ok[/]" if ok else "[red]p99 <= 2 s MISSED (or wrong rows / rate)[/]",
        "\n".join(
            [
                f"achieved {run.rate:,.0f} input events/s (asked {args.rate:,.0f}) until the last dispatch; "
                f"{run.sent:,} sent, worst send {run.behind_s * 1000:.0f} ms behind schedule, {run.failed} failed",
                f"{complete:,} steps had every required reward in time; {len(poller.seen):,} seen, "
                f"{len(poller.stale)} not seen within {poller.horizon_s:g}s and {len(poller.pending)} never seen "
                f"(both count as inf), {found.no_ack} left out without an ack",
                f"resolution: a poll every {poller.interval_s * 1000:.0f} ms + the query ({len(queries)} queries, p50 "
                f"{1000 * percentile(queries, 50):.0f} ms, max {1000 * max(queries or [0]):.0f} ms); the time taken "
                "is the end of the first query that returns the row (an upper bound)",
                f"check: {check.words()}",
                *notes,
            ]
        ),
    )
    console.print(table)


def _quantiles(values: list[float]) -> list[str]:
    return [f"{percentile(values, q):.3f}" for q in (50, 90, 99)] + [f"{max(values or [float('nan')]):.3f}"]


def _table(title: str, columns: list[str]) -> Table:
    table = Table(title=title, title_justify="left", show_lines=True)
    table.add_column("measurement", style="bold", no_wrap=True)
    table.add_column("command (what is timed)", max_width=56)
    for column in columns:
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("notes", max_width=70, style="dim")
    return table


# --- soak --------------------------------------------------------------------------------------------------------

# seconds, worker MB, sink MB, open_steps, expired steps, events sent, worker's RocksDB cache MB (all it charges)
Sample = tuple[float, float | None, float | None, float | None, float | None, int, float | None]


def rss_mb(pid: int | None) -> float | None:
    """VmRSS of a process in MB, from /proc."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def scrape(port: int) -> str:
    """The Prometheus text page on 127.0.0.1:port/metrics (the worker's includes its sink's); '' if no answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return response.read().decode()
    except OSError:
        return ""


def sink_inserts(text: str) -> str:
    """What the sink spent inserting into ClickHouse (its batch histograms), in words."""
    seconds = metric(text, "treadle_sink_batch_seconds_sum{")
    inserts = metric(text, "treadle_sink_batch_seconds_count{")
    flushes = metric(text, 'treadle_sink_batch_seconds_count{table="transitions"')
    rows = metric(text, "treadle_sink_batch_rows_sum{")
    if not inserts or seconds is None:
        return "sink inserts: no metrics"
    by_table = sorted(
        ((line.split('table="', 1)[1].split('"', 1)[0], float(line.rsplit(" ", 1)[1]))
         for line in text.splitlines() if line.startswith("treadle_sink_batch_rows_sum{")),
        key=lambda item: -item[1],
    )  # fmt: skip
    return (
        f"sink inserts: {seconds:.1f}s in {inserts:,.0f} inserts of {rows or 0:,.0f} rows (mean "
        f"{1000 * seconds / inserts:.0f} ms each, ~{seconds / (flushes or 1):.2f}s per flush of every table); "
        + ", ".join(f"{table} {n:,.0f}" for table, n in by_table)
    )


def gc_time(text: str) -> str:
    """What CPython's cycle collector took from the worker and the sink (treadle_*gc_seconds_total), in words."""
    parts = []
    for who, family in (("worker", "treadle_gc_seconds_total"), ("sink", "treadle_sink_gc_seconds_total")):
        seconds = metric(text, family + "{")
        if seconds is not None:
            full = metric(text, family + '{generation="2"}') or 0.0
            parts.append(f"{who} {seconds:.1f}s ({full:.1f}s in full collections)")
    return "garbage collection: " + (", ".join(parts) if parts else "no metrics")


def collector_seconds(text: str) -> tuple[float, float] | None:
    """The worker's treadle_gc_seconds_total on a /metrics page: (all generations, full collections); None if absent."""
    family = "treadle_gc_seconds_total"
    seconds = metric(text, family + "{")
    return None if seconds is None else (seconds, metric(text, family + '{generation="2"}') or 0.0)


def metric(text: str, prefix: str) -> float | None:
    """Sum of the samples on a /metrics page whose line starts with `prefix` (a name, the start of its labels)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)]
    return sum(values) if values else None


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) in MB/min; nan for fewer than two samples."""
    if len(samples) < 2:
        return float("nan")
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 60 * sum((t - mt) * (v - mv) for t, v in samples) / var if var else float("nan")


def soak_table(
    console: Console, pin_words: str, args: argparse.Namespace, samples: list[Sample], run: PacedRun, notes: list[str]
) -> None:
    columns = ["at min", "worker RSS MB", "RocksDB MB", "sink RSS MB", "open_steps", "expired steps", "events sent"]
    table = _table("weaving: soak", columns)
    marks = [0.0, 1.0, 2.0, 5.0, 10.0, samples[-1][0] / 60 if samples else 0.0]
    shown = sorted({min(range(len(samples)), key=lambda i: abs(samples[i][0] / 60 - m)) for m in marks})
    for rank, i in enumerate(shown):
        at, worker, sink, gauge, expired, sent, tables = samples[i]
        first = rank == 0
        table.add_row(
            "before the load (baseline)" if first else "",
            f"`treadle worker` {pin_words}, TREADLE_STEP_RETENTION_S=30, {args.soak_rate:,.0f} input events/s "
            f"paced for {args.soak_minutes:g} min; /proc/PID/status VmRSS every 10 s"
            if first
            else "",
            f"{at / 60:.1f}",
            _mb(worker),
            _mb(tables),
            _mb(sink),
            "n/a" if gauge is None else f"{gauge:,.0f}",
            "n/a" if expired is None else f"{expired:,.0f}",
            f"{sent:,}",
            "",
        )
    half = [s for s in samples if s[0] >= samples[-1][0] / 2] if samples else []
    worker_slope = slope_mb_per_min([(s[0], s[1]) for s in half if s[1] is not None])
    sink_slope = slope_mb_per_min([(s[0], s[2]) for s in half if s[2] is not None])
    tables_slope = slope_mb_per_min([(s[0], s[6]) for s in half if s[6] is not None])
    rest_slope = slope_mb_per_min([(s[0], s[1] - s[6]) for s in half if s[1] is not None and s[6] is not None])
    table.add_row(
        "slope, second half",
        "least squares over the samples of the second half",
        "",
        f"{worker_slope:+.2f}/min",
        f"{tables_slope:+.2f}/min",
        f"{sink_slope:+.2f}/min",
        "",
        "",
        "",
        "\n".join(
            [
                f"achieved {run.rate:,.0f} input events/s; worst send {run.behind_s * 1000:.0f} ms behind schedule",
                f"worker RSS minus its RocksDB memory, second half: {rest_slope:+.2f} MB/min (RocksDB: the shared "
                "cache, memtables charged to it, bounded by TREADLE_TABLE_MEMORY_MB; treadle_rocksdb_memory_bytes)",
                "open_steps, expired steps: the worker's treadle_open_steps gauge and treadle_expired_steps_total "
                "(n/a: /metrics did not answer within 5 s, or a worker without it); open_steps: steps waiting for a "
                "required window",
                "all samples (min: worker/RocksDB/sink MB): "
                + ", ".join(f"{s[0] / 60:.1f}: {_mb(s[1])}/{_mb(s[6])}/{_mb(s[2])}" for s in samples),
                *notes,
            ]
        ),
    )
    console.print(table)


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"
