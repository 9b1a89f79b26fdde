"""The three parts of the weaving bench (bench/weaving_bench.py): throughput, latency, soak."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from aiokafka import AIOKafkaProducer
from rich.console import Console

from bench.common import WORKER_CORE, Measurement, cpu_seconds, loadavg
from bench.paced import CompletePoller, Observed, PacedRun, Published, Receipts, send_paced
from bench.peer import PEER_NAME, peer_measurement, peer_python, quix_catch_up, versus_line
from bench.weaving_report import (
    check_in_clickhouse,
    gc_time,
    latency_table,
    metric,
    render_throughput,
    rss_mb,
    scrape,
    sink_inserts,
    soak_table,
)
from bench.worker_bench import BenchWorker, InputRecord, backlog_catch_up, consume_baseline, cpu_notes, py_spy, stop_spy
from bench.workload import (
    KIND_OF,
    REWARD,
    WINDOWS,
    WeavingExpectation,
    sentinels,
    weaving_plan,
    weaving_policy,
)
from streams.runtime.garbage_collection import freeze_startup_objects
from streams.runtime.run_info import SqlEndpoint
from streams.sdk.producer import producer_config
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.settings import Settings
from treadle.devstack.kafka import LocalKafka

SECTIONS = ("throughput", "latency", "soak")
SECTION = "weaving: throughput (backlog)"
# The paced load's producer lingers longer than the SDK's 5 ms: fewer, fuller produce requests for the bench and the
# broker, which share the sink's core (at 5,000 events/s: bench 48% -> 40%, Kafka 19% -> 15% of it). The latency
# clock starts at the broker's ack, so a linger is never part of what is measured.
LOAD_LINGER_MS = 20
STEP_RETENTION_S = "30"  # TREADLE_STEP_RETENTION_S for the soak (ignored by workers without the setting)


@dataclass
class Context:
    base: Settings
    args: argparse.Namespace
    pin: bool
    home: Path
    console: Console

    def settings(self, suffix: str, **update: object) -> Settings:
        """A section's own topics, consumer group, home and reward policy file on the shared stack."""
        home = self.home / suffix
        home.mkdir(parents=True, exist_ok=True)
        policy = home / "reward_policy.json"
        policy.write_text(json.dumps(weaving_policy()))
        return self.base.model_copy(
            update={
                "topic_prefix": f"{self.base.topic_prefix}{suffix[0]}",
                "app_id": f"{self.base.app_id}{suffix[0]}",
                "home": home,
                "reward_policy": policy,
                **update,
            }
        )

    @property
    def pin_words(self) -> str:
        return f"under taskset -c {WORKER_CORE}" if self.pin else "(not pinned)"


def run_section(name: str, ctx: Context) -> bool:
    """Run and print one part; False when the worker's rows were wrong or incomplete (a missed target is not)."""
    return {"throughput": throughput, "latency": latency, "soak": soak}[name](ctx)


def _topics(settings: Settings) -> dict[str, str]:
    catalog = TopicCatalog(settings)
    return {schema: catalog[kind].name for schema, kind in KIND_OF.items()}


# --- 1. throughput -----------------------------------------------------------------------------------------------


def throughput(ctx: Context) -> bool:
    """The whole workload (and the sentinels) in Kafka, then the worker: its catch-up rate on one core.

    Event times are real: the run is placed in the recent past, spread at 5,000 input events/s of event time. The
    sentinels (one event per partition per input topic, after the last window) close every window, so the clock
    measures processing, not an idle timer; TREADLE_IDLE_TIMEOUT_S is an hour so that nothing else can close one.
    """
    args = ctx.args
    settings = ctx.settings("throughput", idle_timeout_s=3600.0, watermark_lag_s=5.0)
    ctx.console.print(f"[bold]throughput[/]: planning {args.events:,} input events…")
    events, expectation, workload = _backlog(settings, args.events, args.sessions)
    expected, late = expectation.final_revisions(), frozenset(expectation.late())
    load_before = loadavg()
    ctx.console.print(f"throughput: {len(events):,} events into Kafka, then the worker ({ctx.pin_words})…")
    run = backlog_catch_up(
        settings, events, expected, pin=ctx.pin, timeout=args.timeout, late=late,
        profile=args.profile.resolve() if args.profile else None,
    )  # fmt: skip
    watch = run.watch
    elapsed = run.elapsed_s if run.elapsed_s is not None else args.timeout
    complete = watch.done_s is not None and not watch.over_revision and not watch.late_unexpected
    timed = run.timed(len(events))
    notes = [
        workload,
        run.clock_note(),
        f"read back {watch.transitions:,} Transitions; steps final: "
        + ", ".join(f"{p}% at {t:.1f}s" for p, t in watch.milestones.items()),
        f"late rewards on the topic: {watch.late:,}/{len(late):,}",
        f"check: {watch.over_revision} Transitions above the final revision, {watch.late_unexpected} unexpected "
        f"AFTER_GRACE rows, {len(expected) - watch.final} steps short of final",
        *cpu_notes(run.cpu_s, elapsed, timed),
        *([f"= {timed / run.cpu_s:,.0f} events/s if it had the whole core"] if run.cpu_s else []),
        f"by thread: {run.by_thread}",
        *([f"of it in the cycle collector: {run.gc_s[0]:.2f}s ({run.gc_s[1]:.2f}s full)"] if run.gc_s else []),
        f"loadavg before {load_before}, after {loadavg()}",
    ]
    measured = Measurement(
        SECTION,
        "treadle worker, weaving",
        f"`treadle worker` {ctx.pin_words}, input already in Kafka: from its first input record until every step's "
        "final-revision Transition is on the transitions topic and every late reward on late_rewards",
        timed, "events", elapsed, baseline="raw consume+decode", target=20_000.0, target_is_rate=True,
        complete=complete, notes=notes if complete else ["[red]INCOMPLETE OR WRONG: see check[/]", *notes],
    )  # fmt: skip
    peer, versus = _quix_peer(ctx, settings, events, expected, measured, run.cpu_s)
    baseline = consume_baseline(
        settings, len(events), pin=ctx.pin, log_dir=ctx.home, extra=("--reward-policy", str(settings.reward_policy))
    )
    for m in baseline:
        m.section = SECTION
    render_throughput(ctx.console, [*baseline, measured, *peer])
    if versus:
        ctx.console.print(f"[bold]{versus}[/]; loadavg {loadavg()}")
    return complete and all(m.complete for m in peer)


def _quix_peer(
    ctx: Context, settings: Settings, events: list, expected: dict[str, int], treadle: Measurement, cpu_s: float | None
) -> tuple[list[Measurement], str]:
    """The Quix Streams peer on the same backlog (bench.peer), and the line comparing treadle with it."""
    if ctx.args.no_peer:
        return [], ""
    python, how = peer_python()
    ctx.console.print(f"throughput: the {PEER_NAME} on the same backlog ({how})…")
    if python is None:
        return [], f"no {PEER_NAME}: {how}"
    run = quix_catch_up(settings, python, set(expected), pin=ctx.pin, timeout=ctx.args.timeout, home=ctx.home / "quix")
    peer = peer_measurement(SECTION, run, len(events), len(expected), ctx.pin_words, ctx.args.timeout)
    if not peer.complete or not treadle.complete:
        return [peer], ""  # no ratio against a run that did not finish
    treadle_us = 1e6 * cpu_s / treadle.n if cpu_s and treadle.n > 0 else None
    peer_us = 1e6 * run.cpu_s / peer.n if run.cpu_s else None
    return [peer], versus_line(treadle.rate, treadle_us, peer, peer_us)


def _backlog(settings: Settings, n: int, sessions: int) -> tuple[list[InputRecord], WeavingExpectation, str]:
    """The workload's input records and its sentinels, its expectation, and a line saying what it is.

    Each record's Kafka timestamp is when the plan sends it (its event time), as a live producer would have left
    it: the backlog is what a worker finds after downtime, not 25 s of traffic produced in two.
    """
    plan = list(weaving_plan(5000.0, sessions=sessions, seed=7, events=n))
    span = plan[-1].at_s
    last_deadline = max(w + g for w, g in WINDOWS.values())
    tail = sentinels(settings.partitions, span + last_deadline + settings.watermark_lag_s + 2.0)
    origin_us = time.time_ns() // 1000 - int((span + 30.0) * 1e6)  # the sentinels' event time is still in the past
    codec, seqs, expectation, topics = AvroCodec(), {}, WeavingExpectation(), _topics(settings)
    events = []
    for item in plan + tail:
        sent_us = origin_us + int(item.at_s * 1e6)
        value = item.encode(codec, sent_us, seqs)
        events.append(InputRecord(topics[item.schema], item.session_id.encode(), value, sent_us // 1000))
    for item in plan:
        expectation.sent(item)
    duplicates = sum(1 for item in plan if item.original is not None)
    words = (
        f"{len(expectation.steps):,} steps, {len(expectation.late()):,} late rewards, {duplicates:,} duplicates, "
        f"{len(tail)} sentinels; event time spans {span:.0f}s"
    )
    return events, expectation, words


# --- 2. latency --------------------------------------------------------------------------------------------------


def latency(ctx: Context) -> bool:
    """Paced live load; per complete step, its last required reward's ack -> its complete row in ClickHouse."""
    args = ctx.args
    settings = ctx.settings("latency", idle_timeout_s=5.0)
    worker, load_before = _start_worker(ctx, settings, {}), loadavg()
    spies: list = []
    try:
        warm = WeavingExpectation()  # its rows are checked with the measured ones
        if args.warmup > 0:
            ctx.console.print(f"latency: warm-up, {args.rate:,.0f} events/s for {args.warmup:.0f}s, not measured…")
            asyncio.run(_warm_up(settings, args.rate, args.warmup, args.sessions, warm))
        ctx.console.print(f"latency: {args.rate:,.0f} input events/s for {args.duration:.0f}s…")
        sink = SqlEndpoint.read(settings)
        sink_pid = sink.pid if sink is not None else None
        cpu_before, sink_before = cpu_seconds(worker.pid), _cpu(sink_pid)
        neighbours = {"Kafka": LocalKafka(ctx.base).pid(), "the bench": os.getpid()}  # on the sink's core
        neighbours_before = {name: _cpu(pid) for name, pid in neighbours.items()}
        if args.profile is not None:  # the paced load: small batches, every event its own step touch
            for pid, name in ((worker.pid, "latency"), (sink_pid, "sink")):
                if pid is not None:
                    out = args.profile.with_name(f"{args.profile.stem}-{name}{args.profile.suffix}")
                    spies.append(py_spy(pid, out))
        seen = asyncio.run(_live(settings, args.rate, args.duration, args.sessions, args.poll_interval))
        for spy in spies:
            stop_spy(spy)
        run = seen.run
        cpu_load, sink_load = _diff(cpu_before, cpu_seconds(worker.pid)), _diff(sink_before, _cpu(sink_pid))
        neighbour_load = {name: _diff(neighbours_before[name], _cpu(pid)) for name, pid in neighbours.items()}
        load_after = loadavg()
        check = check_in_clickhouse(settings, WeavingExpectation.union(warm, seen.expectation), timeout=120.0)
        cpu_all = _diff(cpu_before, cpu_seconds(worker.pid))
        page = scrape(settings.web_port)
        inserts, gc_pauses = sink_inserts(page), gc_time(page)
    finally:
        for spy in spies:
            if spy is not None and spy.poll() is None:
                spy.kill()
        worker.stop()
    load_s = (run.last_s or 0) - (run.first_s or 0)
    notes = [
        f"worker CPU while the load ran: {cpu_load or 0:.1f}s = {100 * (cpu_load or 0) / max(load_s, 1e-9):.0f}% "
        f"of one core; until every final row was in ClickHouse: {1e6 * (cpu_all or 0) / max(run.sent, 1):.0f} us "
        "of CPU per input event",
        f"sink child CPU while the load ran: {sink_load or 0:.1f}s = {100 * (sink_load or 0) / max(load_s, 1e-9):.0f}% "
        "of a core (it runs off the worker's core)",
        "sharing that core meanwhile: "
        + ", ".join(f"{name} {100 * (used or 0) / max(load_s, 1e-9):.0f}%" for name, used in neighbour_load.items()),
        inserts,
        gc_pauses,
        f"loadavg before {load_before}, after the load {load_after}",
        f"measured after {args.warmup:.0f}s of the same load (other steps, not measured): a fresh broker's JIT "
        "compiler takes ~20% of the shared core for its first ~40 s of load",
    ]
    latency_table(ctx.console, ctx.pin_words, args, seen, check, notes)
    return check.ok


async def _load_producer(settings: Settings, client_id: str) -> AIOKafkaProducer:
    """A started producer for the latency run's paced load (LOAD_LINGER_MS)."""
    producer = AIOKafkaProducer(**producer_config(settings, client_id=client_id, linger_ms=LOAD_LINGER_MS))
    await producer.start()
    return producer


async def _warm_up(
    settings: Settings, rate: float, duration: float, sessions: int, expectation: WeavingExpectation
) -> None:
    """The latency run's load for `duration` s, steps of its own, not timed: the broker's JIT compiler, the worker's
    and the sink's caches, and ClickHouse's parts reach their steady state before anything is measured."""
    plan = weaving_plan(rate, sessions=sessions, seed=5, duration_s=duration)
    producer = await _load_producer(settings, "bench-warm-up")
    try:
        await send_paced(producer, plan, _topics(settings), PacedRun(), expectation)
    finally:
        await producer.stop()


async def _live(settings: Settings, rate: float, duration: float, sessions: int, poll_s: float) -> Observed:
    topics = _topics(settings)
    seen = Observed(
        PacedRun(),
        WeavingExpectation(),
        CompletePoller(settings, interval_s=poll_s),
        Receipts(settings, topics[REWARD]),
        Published(settings, TopicCatalog(settings)["transitions"].name),
    )
    # Planned before the load, not while sending: the bench shares a core with Kafka and the sink, and making
    # steps on the fly took ~14% of its CPU (py-spy). Frozen out of the bench's own garbage collections.
    plan = list(weaving_plan(rate, sessions=sessions, seed=11, duration_s=duration))
    freeze_startup_objects()
    for tail in (seen.receipts, seen.published):
        await tail.start()
    load_done, polled = asyncio.Event(), asyncio.Event()
    producer = await _load_producer(settings, "bench-paced")
    try:
        tails = [asyncio.create_task(tail.run(polled)) for tail in (seen.receipts, seen.published)]
        poller = asyncio.create_task(seen.poller.run(load_done))
        await send_paced(producer, iter(plan), topics, seen.run, seen.expectation, seen.poller, steady_s=duration)
        load_done.set()
        await poller
        polled.set()
        await asyncio.gather(*tails)
    finally:
        await producer.stop()
    return seen


# --- 3. soak -----------------------------------------------------------------------------------------------------


def soak(ctx: Context) -> bool:
    """Paced live load for --soak-minutes; RSS of the worker and of its sink child every 10 s."""
    args = ctx.args
    settings = ctx.settings("soak", idle_timeout_s=5.0)
    env, argv = {"TREADLE_STEP_RETENTION_S": STEP_RETENTION_S}, None
    if args.trace_memory is not None:
        env["TREADLE_TRACE_OUT"] = str(args.trace_memory.resolve())
        argv = [sys.executable, "-m", "bench.traced_worker"]
    worker = _start_worker(ctx, settings, env, argv)
    load_before = loadavg()
    try:
        endpoint = SqlEndpoint.read(settings)
        sink_pid = endpoint.pid if endpoint is not None else None
        ctx.console.print(f"soak: {args.soak_rate:,.0f} input events/s for {args.soak_minutes:g} min, RSS every 10 s…")
        samples, run = asyncio.run(_soak(settings, worker.pid, sink_pid, args))
        load_after = loadavg()
    finally:
        worker.stop()
    soak_table(ctx.console, ctx.pin_words, args, samples, run, [f"loadavg before {load_before}, after {load_after}"])
    return run.failed == 0


async def _soak(settings: Settings, pid: int, sink_pid: int | None, args: argparse.Namespace):
    run, samples = PacedRun(), []
    stop = asyncio.Event()

    async def sample() -> None:
        started = time.perf_counter()
        while True:
            at, worker, sink, sent = time.perf_counter() - started, rss_mb(pid), rss_mb(sink_pid), run.sent
            page = await asyncio.to_thread(scrape, settings.web_port)
            samples.append(
                (
                    at,
                    worker,
                    sink,
                    metric(page, "treadle_open_steps "),
                    metric(page, "treadle_expired_steps_total "),
                    sent,
                    _bytes_in_mb(metric(page, 'treadle_rocksdb_memory_bytes{kind="cache"}')),
                )
            )
            if stop.is_set():
                return
            try:
                await asyncio.wait_for(stop.wait(), 10.0)
            except TimeoutError:
                pass

    producer = AIOKafkaProducer(**producer_config(settings, client_id="bench-soak"))
    await producer.start()
    try:
        sampler = asyncio.create_task(sample())
        plan = weaving_plan(args.soak_rate, sessions=args.sessions, seed=13, duration_s=args.soak_minutes * 60)
        await send_paced(producer, plan, _topics(settings), run, steady_s=args.soak_minutes * 60)
        stop.set()
        await sampler
    finally:
        await producer.stop()
    return samples, run


# --- helpers -----------------------------------------------------------------------------------------------------


def _start_worker(ctx: Context, settings: Settings, env: dict[str, str], argv: list[str] | None = None) -> BenchWorker:
    from streams.runtime.worker import prepare_cluster

    asyncio.run(prepare_cluster(settings))
    worker = BenchWorker(settings, ctx.pin, argv=argv, env=env).start()
    try:
        ready = worker.wait_ready(120)
    except Exception:
        worker.stop()
        raise
    ctx.console.print(f"[dim]worker pid {worker.pid} ready after {ready:.1f}s; log {worker.log_path}[/]")
    return worker


def _bytes_in_mb(value: float | None) -> float | None:
    return None if value is None else value / 2**20


def _cpu(pid: int | None) -> float | None:
    return cpu_seconds(pid) if pid is not None else None


def _diff(before: float | None, after: float | None) -> float | None:
    return after - before if before is not None and after is not None else None
