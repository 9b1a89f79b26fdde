"""Section 2: worker input events/s (input topics -> final-revision Transitions on the transitions topic).

A real `treadle worker` subprocess (pinned to one core with taskset when available) is started and awaited
until ready; then N pre-encoded input events are produced as fast as the broker takes them, and the clock
stops when every step's final-revision Transition has been read back from the transitions topic. The
baseline is a bare consume + decode loop over the same input topics, in its own process on the same core.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from bench.common import WORKER_CORE, Measurement, busiest_threads, cpu_seconds, pinned, run_module, thread_cpu
from bench.weaving_report import collector_seconds, metric, scrape
from bench.workload import TRANSITION, Step, encoded_events, make_steps
from streams.runtime.run_info import FirstInput, SqlEndpoint
from streams.sdk.producer import producer_config
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.settings import Settings
from treadle.devstack.worker_process import WorkerProcess

LATE_REWARD = "treadle.derived.LateReward"
READY_TIMEOUT_S = 120.0  # a worker not ready by then fails the run (a backlog's read-back waits this much longer)

SECTION = "2. worker"
WORKER_COMMAND = "{pin}: input topics -> every step's final Transition on the topic"
CLICKHOUSE_COMMAND = "same run, until transitions_latest + raw_events_latest are complete (run_sql via worker /sql)"
VISIBLE_SQL = (
    "SELECT (SELECT count() FROM transitions_latest) AS steps, "
    "(SELECT sum(revision) FROM transitions_latest) AS revisions, "
    "(SELECT count() FROM raw_events_latest) AS raw_events"
)


class InputRecord(NamedTuple):
    """An input record to produce. `timestamp_ms`: its Kafka timestamp; None leaves it to the producer's clock."""

    topic: str
    key: bytes
    value: bytes
    timestamp_ms: int | None = None


class BenchWorker(WorkerProcess):
    """`treadle worker` pinned to WORKER_CORE (when `pin`), its sink child moved to the other cores."""

    def __init__(
        self, settings: Settings, pin: bool, argv: list[str] | None = None, env: dict[str, str] | None = None
    ) -> None:
        super().__init__(
            settings, settings.home / "worker.log", env=env, argv_prefix=pinned([], pin), command=argv or None
        )
        self.pin = pin

    def wait_ready(self, timeout: float = 120.0) -> float:
        took = super().wait_ready(timeout)
        self._move_sink_off_the_worker_core()
        return took

    def _move_sink_off_the_worker_core(self) -> None:
        """The sink child inherits the worker's pin; in production it has a core of its own, so here too.

        Affinity is per thread on Linux: every thread the sink has started by now is moved (its ClickHouse thread,
        chDB's pools), and threads it starts later inherit the moved mask. Moving only the process id left those
        threads on the worker's core, competing with what the bench measures.
        """
        endpoint = SqlEndpoint.read(self.settings)
        if self.pin and endpoint is not None and hasattr(os, "sched_setaffinity"):
            others = set(range(os.cpu_count() or 1)) - {WORKER_CORE}
            if others:
                for thread in _threads(endpoint.pid):
                    try:
                        os.sched_setaffinity(thread, others)
                    except ProcessLookupError:
                        pass  # the thread ended meanwhile


def _threads(pid: int) -> list[int]:
    """The ids of a process's threads (its own pid first)."""
    try:
        return sorted((int(tid) for tid in os.listdir(f"/proc/{pid}/task")), key=lambda tid: tid != pid)
    except FileNotFoundError:
        return [pid]


@dataclass
class Watch:
    """What the transitions (and late-rewards) topics showed during the run."""

    started_at: float = 0.0  # Unix time of the bench's clock start (done_s and the others count from it)
    produced_s: float = 0.0  # all input acknowledged by the broker
    first_s: float | None = None  # first Transition read back
    done_s: float | None = None  # last step's final revision read back
    final: int = 0
    transitions: int = 0
    over_revision: int = 0  # revision above the expected final one: a correctness bug
    repeats: int = 0  # the same (step, revision) read twice: reprocessing
    seen: set = field(default_factory=set)
    milestones: dict[int, float] = field(default_factory=dict)  # percent of steps final -> seconds
    late: int = 0  # expected AFTER_GRACE late rewards read back
    late_unexpected: int = 0  # AFTER_GRACE rows for a reward that was not late: a correctness bug


async def _drive(
    settings: Settings,
    expected: dict[str, int],
    events: list[InputRecord],
    timeout: float,
    late: frozenset[str] = frozenset(),
    reading: asyncio.Event | None = None,
):
    """Send `events` (may be none) and read back until every step has its expected final revision
    ({logical_event_id: revision}) on the transitions topic and every `late` reward is on the late-rewards topic.
    `reading` is set once the read-back consumer is in place and the clock runs."""
    codec = AvroCodec()
    catalog = TopicCatalog(settings)
    topic, late_topic = catalog["transitions"].name, catalog["late_rewards"].name
    watch = Watch()
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap_servers,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_records=5000,
    )
    producer = AIOKafkaProducer(**producer_config(settings, client_id="bench-input"))
    await consumer.start()
    await producer.start()
    try:
        watched = (topic, late_topic) if late else (topic,)
        partitions = [TopicPartition(name, p) for name in watched for p in range(settings.partitions)]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        for name in {record.topic for record in events}:
            await producer.partitions_for(name)
        started, watch.started_at = time.perf_counter(), time.time()
        if reading is not None:
            reading.set()

        async def read_back() -> None:
            pending, pending_late = set(expected), set(late)
            marks = [(p, len(expected) * p // 100) for p in (10, 50, 90)]
            while pending or pending_late:
                batches = await consumer.getmany(timeout_ms=100, max_records=5000)
                now = time.perf_counter() - started
                for tp, messages in batches.items():
                    if tp.topic == late_topic:
                        _read_late(codec, messages, pending_late, late, watch)
                        continue
                    for message in messages:
                        record = codec.decode(message.value, expect=TRANSITION)[1]
                        lid, revision = record["logical_event_id"], record["revision"]
                        watch.transitions += 1
                        if watch.first_s is None:
                            watch.first_s = now
                        if (lid, revision) in watch.seen:
                            watch.repeats += 1
                        watch.seen.add((lid, revision))
                        want = expected.get(lid)
                        if want is None:
                            continue
                        if revision > want:
                            watch.over_revision += 1
                        elif revision == want and lid in pending:
                            pending.discard(lid)
                            watch.final += 1
                while marks and watch.final >= marks[0][1]:
                    watch.milestones[marks.pop(0)[0]] = now
            watch.done_s = time.perf_counter() - started

        reader = asyncio.create_task(read_back())
        await _send_all(producer, events)
        watch.produced_s = time.perf_counter() - started
        try:
            await asyncio.wait_for(reader, max(1.0, timeout - watch.produced_s))
        except TimeoutError:
            pass
        return watch, started
    finally:
        await producer.stop()
        await consumer.stop()


def _read_late(codec: AvroCodec, messages, pending: set[str], late: frozenset[str], watch: Watch) -> None:
    for message in messages:
        record = codec.decode(message.value, expect=LATE_REWARD)[1]
        if record["reason"] != "AFTER_GRACE":
            continue
        if record["event_id"] in pending:
            pending.discard(record["event_id"])
            watch.late += 1
        elif record["event_id"] not in late:
            watch.late_unexpected += 1


async def _send_all(producer: AIOKafkaProducer, events: list[InputRecord]) -> None:
    for record in events:
        await producer.send(record.topic, record.value, key=record.key, timestamp_ms=record.timestamp_ms)
    await producer.flush()


async def _preload(settings: Settings, events: list[InputRecord]) -> None:
    producer = AIOKafkaProducer(**producer_config(settings, client_id="bench-backlog"))
    await producer.start()
    try:
        await _send_all(producer, events)
    finally:
        await producer.stop()


@dataclass
class CatchUp:
    """A backlog run: what was read back, and the worker's CPU seconds (all threads) meanwhile.

    The clock runs from the worker's first input record (FirstInput) to the last output read back: a worker reads
    input while it is still starting up, before it says it is ready. A worker that leaves no FirstInput (another
    command) is timed from its ready signal instead, less the events it had read by then (`read_before_clock`).
    """

    watch: Watch
    cpu_s: float | None
    by_thread: str = ""
    gc_s: tuple[float, float] | None = None  # the worker's cycle collector meanwhile: (all generations, full only)
    read_before_clock: int = 0  # input events the worker had read when the clock started (its ready scrape)
    lead_s: float = 0.0  # from the clock's start (first input record, or ready) to the bench's read-back start
    from_first_input: bool = False

    @property
    def elapsed_s(self) -> float | None:
        return None if self.watch.done_s is None else self.lead_s + self.watch.done_s

    def timed(self, n: int) -> int:
        """The events the clock saw (all of them, when it starts at the first input record)."""
        return n - self.read_before_clock

    def clock_note(self) -> str:
        if self.from_first_input:
            return ("clock and CPU from the worker's first input record (FirstInput) to the last output read back "
                    "(read back from before the worker started); every event timed")  # fmt: skip
        return (f"clock from the worker's ready signal: {self.read_before_clock:,} events read before it are left out "
                "of the rate and the CPU per event")  # fmt: skip


@dataclass
class _AtReady:
    """The worker when it said it was ready: CPU, per-thread CPU, collector seconds, input events read."""

    at_s: float  # since the read-back's clock start
    cpu_s: float | None
    threads: dict[int, tuple[str, float]]
    gc_s: tuple[float, float] | None
    read: int


def backlog_catch_up(
    settings: Settings,
    events: list[InputRecord],
    expected: dict[str, int],
    *,
    pin: bool,
    timeout: float,
    argv: list[str] | None = None,
    env: dict[str, str] | None = None,
    late: frozenset[str] = frozenset(),
    profile: Path | None = None,
) -> CatchUp:
    """Put `events` in Kafka, start reading the output topics, then start the worker; time it from its first input
    record (else from "ready") until the read-back is complete. The read-back runs from before the worker starts, so
    a worker that is done before it says it is ready (a small backlog, a slow sink start) is not timed as slower."""
    from streams.runtime.worker import prepare_cluster

    asyncio.run(prepare_cluster(settings))
    asyncio.run(_preload(settings, events))
    worker = BenchWorker(settings, pin, argv, env)
    spy: subprocess.Popen[bytes] | None = None

    async def run() -> tuple[Watch, _AtReady]:
        nonlocal spy
        reading = asyncio.Event()
        drive = asyncio.create_task(_drive(settings, expected, [], timeout + READY_TIMEOUT_S, late, reading))
        await reading.wait()
        clock = time.perf_counter()
        worker.start()
        await asyncio.to_thread(worker.wait_ready, READY_TIMEOUT_S)
        spy = py_spy(worker.pid, profile) if profile is not None else None
        page = await asyncio.to_thread(scrape, settings.web_port)
        at_ready = _AtReady(
            time.perf_counter() - clock, cpu_seconds(worker.pid), thread_cpu(worker.pid), collector_seconds(page),
            int(metric(page, "treadle_events_in_total{") or 0),
        )  # fmt: skip
        watch, _ = await drive
        return watch, at_ready

    try:
        watch, ready = asyncio.run(run())
        cpu_after, threads_after = cpu_seconds(worker.pid), thread_cpu(worker.pid)
        gc_after = collector_seconds(scrape(settings.web_port))
        first = FirstInput.read(settings)
        stop_spy(spy)
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
        worker.stop()
    gc_s = None
    if ready.gc_s is not None and gc_after is not None:
        gc_s = (gc_after[0] - ready.gc_s[0], gc_after[1] - ready.gc_s[1])
    by_thread = busiest_threads(worker.pid, ready.threads, threads_after)  # from its ready signal on
    if first is not None and first.pid == worker.pid:
        used = cpu_after - first.cpu_s if cpu_after is not None else None
        return CatchUp(watch, used, by_thread, gc_s, 0, watch.started_at - first.read_at, from_first_input=True)
    used = cpu_after - ready.cpu_s if cpu_after is not None and ready.cpu_s is not None else None
    return CatchUp(watch, used, by_thread, gc_s, ready.read, -ready.at_s)


def cpu_notes(used: float | None, elapsed: float, n: int) -> list[str]:
    """The worker's CPU over a timed run, as table notes."""
    if used is None or elapsed <= 0 or n <= 0:
        return []
    return [
        f"worker CPU {used:.1f}s = {100 * used / elapsed:.0f}% of one core",
        f"= {1e6 * used / n:.0f} us of CPU per input event",
    ]


def _backlog_run(
    settings: Settings, steps: list[Step], events: list[InputRecord], pin: bool, timeout: float, argv
) -> Measurement:
    """The same workload already in Kafka when the worker starts: its catch-up rate, timed from "ready" to
    the last final Transition, with no load generator competing for the broker's core."""
    expected = {s.logical_event_id: s.final_revision for s in steps}
    run = backlog_catch_up(settings, events, expected, pin=pin, timeout=timeout, argv=argv)
    watch = run.watch
    elapsed = run.elapsed_s if run.elapsed_s is not None else timeout
    timed = run.timed(len(events))
    notes = [f"{len(events)} input events in Kafka before the worker started", run.clock_note()]
    if timed <= 0:
        notes.append("[yellow]the worker read the whole backlog before its ready signal: too small to time "
                     "(raise --events)[/]")  # fmt: skip
    notes += cpu_notes(run.cpu_s, elapsed, timed)
    return _worker_measurement(
        "treadle worker, backlog",
        "same worker and workload, input produced before the worker starts (catch-up after downtime)",
        watch,
        len(steps),
        timed,
        elapsed,
        notes,
    )


def _worker_measurement(
    name: str, command: str, watch: Watch, steps: int, n: int, elapsed: float, notes: list[str]
) -> Measurement:
    """A worker run against the 5,000 input events/s target; incomplete when not every step got final."""
    return Measurement(
        SECTION,
        name,
        command,
        n,
        "events",
        elapsed,
        baseline="raw consume+decode",
        target=5000.0,
        target_is_rate=True,
        complete=watch.done_s is not None,
        notes=notes if watch.done_s is not None else [f"TIMED OUT: {watch.final}/{steps} steps final", *notes],
    )


def _wait_visible(settings: Settings, want: tuple[int, int, int], started: float, timeout: float):
    """Seconds since `started` until the ClickHouse views hold every row, or None; and the last answer."""
    from sinks.sql_client import run_sql

    deadline = time.perf_counter() + timeout
    last = None
    while time.perf_counter() < deadline:
        _, rows = run_sql(settings, VISIBLE_SQL)
        last = tuple(int(v or 0) for v in rows[0])
        if last == want:
            return time.perf_counter() - started, last
        time.sleep(0.1)
    return None, last


def rename(topic: str, old: Settings, new: Settings) -> str:
    """The same topic under another deployment's prefix."""
    return new.topic_prefix + topic.removeprefix(old.topic_prefix)


def consume_baseline(
    settings: Settings, n: int, *, pin: bool, log_dir: Path, extra: tuple[str, ...] = ()
) -> list[Measurement]:
    """bench.consume over the input topics of `settings` in its own process, on the worker's core when pinning."""
    return run_module(
        "bench.consume",
        [
            "--bootstrap", settings.kafka_bootstrap_servers, "--prefix", settings.topic_prefix,
            "--partitions", str(settings.partitions), "--events", str(n), "--timeout", "60", *extra,
        ],
        pin=pin,
        timeout=120,
        log=log_dir / f"consume-{settings.topic_prefix}.log",
    )  # fmt: skip


def stop_spy(spy: subprocess.Popen[bytes] | None) -> None:
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)


def py_spy(pid: int, out: Path) -> subprocess.Popen[bytes] | None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        return None
    return subprocess.Popen(
        [exe, "record", "--pid", str(pid), "--rate", "200", "--format", "raw", "--output", str(out), "--nonblocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def worker_section(
    settings: Settings,
    *,
    events: int,
    sessions: int,
    pin: bool,
    timeout: float,
    clickhouse: bool,
    profile: Path | None,
    log_dir: Path,
    worker_argv: list[str] | None = None,
) -> tuple[list[Measurement], list[str]]:
    """The worker run, its ClickHouse visibility and the raw consume baseline; plus lines for the log."""
    from streams.runtime.worker import prepare_cluster

    asyncio.run(prepare_cluster(settings))
    codec = AvroCodec()
    catalog = TopicCatalog(settings)
    steps = make_steps(events, sessions, seed=7)
    encoded = [InputRecord(catalog[kind].name, key, value) for kind, key, value in encoded_events(steps, codec)]
    n = len(encoded)
    info: list[str] = []

    worker = BenchWorker(settings, pin, worker_argv).start()
    spy = None
    try:
        ready_s = worker.wait_ready(120)
        info.append(f"worker pid {worker.pid} ready after {ready_s:.1f}s; log {worker.log_path}")
        if profile is not None:
            spy = py_spy(worker.pid, profile)
            info.append(f"py-spy raw profile -> {profile}" if spy else "py-spy not installed: no profile")
        cpu_before, threads_before = cpu_seconds(worker.pid), thread_cpu(worker.pid)
        expected = {s.logical_event_id: s.final_revision for s in steps}
        watch, started = asyncio.run(_drive(settings, expected, encoded, timeout))
        cpu_after, threads_after = cpu_seconds(worker.pid), thread_cpu(worker.pid)
        stop_spy(spy)
        visible_s = visible = None
        if clickhouse and watch.done_s is not None:
            want = (len(steps), sum(s.final_revision for s in steps), n)
            visible_s, visible = _wait_visible(settings, want, started, 60)
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
        worker.stop()

    rewards = n - 2 * len(steps)
    elapsed = watch.done_s if watch.done_s is not None else timeout
    notes = [
        f"{len(steps)} steps over {sessions} sessions (dispatch + result + 1-3 rewards; {rewards} rewards)",
        f"input produced+acked in {watch.produced_s:.2f}s; first Transition at {watch.first_s or float('nan'):.2f}s",
        f"{watch.transitions} Transitions read back; steps final: "
        + ", ".join(f"{p}% at {t:.1f}s" for p, t in watch.milestones.items()),
    ]
    if cpu_before is not None and cpu_after is not None and elapsed > 0:
        notes += cpu_notes(cpu_after - cpu_before, elapsed, n)
        notes.append(f"by thread: {busiest_threads(worker.pid, threads_before, threads_after)}")
    if watch.over_revision or watch.repeats:
        notes.append(
            f"[red]check: {watch.over_revision} Transitions above their step's final revision, "
            f"{watch.repeats} repeated (step, revision) pairs[/]"
        )
    measured = _worker_measurement(
        "treadle worker",
        (f"`{' '.join(worker_argv)}`" if worker_argv else "`python -m treadle.cli worker`")
        + WORKER_COMMAND.format(pin=f" under taskset -c {WORKER_CORE}" if pin else " (not pinned)"),
        watch,
        len(steps),
        n,
        elapsed,
        notes,
    )
    if watch.over_revision or watch.repeats:
        measured.failed_checks.append(f"{watch.over_revision} above the final revision, {watch.repeats} repeated")
    results = [measured]
    backlog = settings.model_copy(
        update={
            "topic_prefix": f"{settings.topic_prefix}b",
            "app_id": f"{settings.app_id}b",
            "home": settings.home.with_name(f"{settings.home.name}-backlog"),
        }
    )
    renamed = [record._replace(topic=rename(record.topic, settings, backlog)) for record in encoded]
    results.append(_backlog_run(backlog, steps, renamed, pin, timeout, worker_argv))
    if clickhouse and watch.done_s is not None:
        results.append(
            Measurement(
                SECTION,
                "  ... rows in ClickHouse",
                CLICKHOUSE_COMMAND,
                n,
                "events",
                visible_s if visible_s is not None else 60.0,
                complete=visible_s is not None,
                notes=[f"after {visible_s - watch.done_s:.2f}s more" if visible_s else f"last answer {visible}"],
            )
        )
    baseline = consume_baseline(settings, n, pin=pin, log_dir=log_dir)
    return [*baseline, *results], info
