"""Faults under load, then every table checked against the events sent: `python -m bench.chaos` (`make chaos`).

A private stack with a 3-broker KRaft cluster (replication 3, 2 in sync), Valkey, one `treadle worker` running the
`steps,state` processors (TREADLE_SINK=off) and one `treadle sink` (embedded chDB) in its own process. An
idempotent acks=all producer (the SDK's settings) sends the workload of bench.workload (dispatch, tool result,
1-3 rewards per step) plus a state delta per step, paced over the run. Meanwhile a seeded schedule kills one of
worker, sink, a Kafka broker (never two at once) or Valkey with SIGKILL at a random moment, leaves it down a random
1-4 s, and starts it again. When the producer is done and every fault is over, it waits for the tables to settle
and compares them with what the events must yield:

- raw_events_latest: every event id once;
- transitions_latest: one row per step, with the revision, tool status, reward and logical id that folding the
  step's events gives (bench.workload.final_transitions);
- state_versions_latest: per session, one version per dispatch, tool result and delta (ordinals 1..n, no gap);
- the Valkey state cache: per session, the ordinal of the last version;
- dead_letters_latest: empty (nothing sent is bad).

It prints one line: events, faults injected (by kind), lost, duplicated, wrong, the seed and the load average.
`--quick` is the bench-smoke size. Ports follow TREADLE_BENCH_PORT_SHIFT like every bench.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import bench_settings, loadavg, local_stack, machine_facts
from bench.workload import BASE_TIME, KIND_OF, Step, _envelope, final_transitions, make_steps
from streams.runtime.processes import StackError, pid_alive
from streams.runtime.run_info import SqlEndpoint
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.names import STATE_DELTA
from topics.settings import Settings
from treadle.devstack.kafka import LocalKafkaCluster
from treadle.devstack.valkey import LocalValkey
from treadle.devstack.worker_process import WorkerProcess

KINDS = ("worker", "sink", "broker", "valkey")
SETTLE_S = 600.0  # at most this long after the last fault for the tables to reach the expected rows


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- the workload: bench.workload's steps, plus a state delta per step ----------------------------------------------


def with_state_deltas(steps: list[Step]) -> list[Step]:
    """A delta (one node upsert) after each step's events; every session's events are numbered again in send order,
    so seq stays unique per session. State versions per session are then its dispatches, tool results and deltas."""
    seqs: dict[str, int] = {}
    for step in steps:
        envelope = _envelope(step.session_id, step.logical_event_id, 0, step.logical_event_id.replace("-", ""))
        node = {"id": f"n-{step.step}", "type": "memo", "data_json": '{"k": 1}', "ttl_seconds": None}
        delta = {"envelope": envelope, "node_upserts": [node], "node_deletes": [], "edge_upserts": [],
                 "edge_deletes": [], "rollback_to": None}  # fmt: skip
        step.events.append((STATE_DELTA, delta))
        for _, record in step.events:
            seq = seqs[step.session_id] = seqs.get(step.session_id, 0) + 1
            record["envelope"]["seq"] = seq
            record["envelope"]["event_time"] = BASE_TIME + seq * 1000
    return steps


def encoded(steps: list[Step], codec: AvroCodec) -> list[tuple[str, bytes, bytes]]:
    """(topic kind, key, value) of every event, in send order."""
    kinds = {**KIND_OF, STATE_DELTA: "state_deltas"}
    return [
        (kinds[name], step.session_id.encode(), codec.encode(name, record))
        for step in steps
        for name, record in step.events
    ]


# --- the processes and the faults ------------------------------------------------------------------------------------


class Sink(WorkerProcess):
    """`treadle sink` on its own: ready once its SQL endpoint is announced."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings, settings.logs_dir / "sink.log",
                         command=[sys.executable, "-m", "treadle.cli", "sink"])  # fmt: skip

    def wait_ready(self, timeout: float = 180.0) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc is None or self.proc.poll() is not None:
                raise StackError(f"the sink exited; see {self.log_path}\n{self.log_tail()}")
            endpoint = SqlEndpoint.read(self.settings)
            if endpoint is not None and self.proc is not None and endpoint.pid == self.proc.pid:
                return time.monotonic() - started
            time.sleep(0.2)
        raise StackError(f"the sink was not ready after {timeout:.0f} s; see {self.log_path}\n{self.log_tail()}")


@dataclass
class Fault:
    at_s: float  # after the previous fault ended
    kind: str
    down_s: float


def schedule(rng: random.Random, faults: int, spread_s: float) -> list[Fault]:
    """`faults` faults, each kind in turn from a seeded shuffle, at random gaps that spread them over `spread_s`."""
    kinds = [KINDS[i % len(KINDS)] for i in range(faults)]
    rng.shuffle(kinds)
    gap = spread_s / max(faults, 1)
    return [Fault(rng.uniform(0.2, 1.0) * gap, kind, rng.uniform(1.0, 4.0)) for kind in kinds]


@dataclass
class Chaos:
    """Runs the schedule on a thread: kill, stay down, start again (and wait until ready)."""

    settings: Settings
    worker: WorkerProcess
    sink: Sink
    faults: list[Fault]
    rng: random.Random
    injected: list[str] = field(default_factory=list)
    error: BaseException | None = None

    def run(self) -> None:
        try:
            for fault in self.faults:
                time.sleep(fault.at_s)
                self.inject(fault)
        except BaseException as exc:  # reported by the main thread
            self.error = exc

    def inject(self, fault: Fault) -> None:
        if fault.kind == "worker":
            self.worker.kill()
            what = f"worker pid {self.worker.pid}"
            time.sleep(fault.down_s)
            self.worker.start().wait_ready(300)
        elif fault.kind == "sink":
            self.sink.kill()
            what = f"sink pid {self.sink.pid}"
            time.sleep(fault.down_s)
            self.sink.start().wait_ready(300)
        elif fault.kind == "broker":
            node = LocalKafkaCluster(self.settings).node(self.rng.randint(1, self.settings.kafka_brokers))
            what = f"{node.name} pid {node.kill()}"
            time.sleep(fault.down_s)
            node.up(timeout=180)
        else:
            valkey = LocalValkey(self.settings)
            pid = valkey.pid()
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                while pid_alive(pid):
                    time.sleep(0.05)
            what = f"valkey pid {pid}"
            time.sleep(fault.down_s)
            valkey.up()
        self.injected.append(fault.kind)
        log(f"fault {len(self.injected)}/{len(self.faults)}: killed {what}, down {fault.down_s:.1f} s, back")


# --- producing ------------------------------------------------------------------------------------------------------


async def produce(settings: Settings, events: list[tuple[str, bytes, bytes]], duration_s: float) -> int:
    """Send every event, paced over `duration_s`, with the SDK's producer settings; returns the sends that failed."""
    from streams.sdk.producer import create_producer

    catalog = TopicCatalog(settings)
    producer = create_producer(settings)
    await producer.start()
    failed = 0
    try:
        started = time.monotonic()
        chunk = 200
        for i in range(0, len(events), chunk):
            futures = [
                await producer.send(catalog[kind].name, value, key=key) for kind, key, value in events[i : i + chunk]
            ]
            for outcome in await asyncio.gather(*futures, return_exceptions=True):
                if isinstance(outcome, BaseException):
                    failed += 1
                    log(f"a send failed: {outcome!r}")
            ahead = started + duration_s * (i + chunk) / len(events) - time.monotonic()
            if ahead > 0:
                await asyncio.sleep(ahead)
    finally:
        await producer.stop()
    return failed


# --- checking -------------------------------------------------------------------------------------------------------


@dataclass
class Verdict:
    lost: int = 0
    duplicated: int = 0
    wrong: int = 0
    notes: list[str] = field(default_factory=list)

    def add(self, table: str, lost: int = 0, duplicated: int = 0, wrong: int = 0) -> None:
        self.lost += lost
        self.duplicated += duplicated
        self.wrong += wrong
        if lost or duplicated or wrong:
            self.notes.append(f"{table}: lost {lost}, duplicated {duplicated}, wrong {wrong}")


def query(settings: Settings, sql: str) -> list[list]:
    from sinks.sql_client import run_sql

    return run_sql(settings, sql, timeout=300)[1]


def settled(settings: Settings, steps: list[Step]) -> bool:
    """Every step at its final revision and every state version in (a cheap count, before the full check)."""
    want_revisions = sum(s.final_revision - 1 for s in steps)  # the delta is not part of the transition
    want_versions = sum(len(s.events) - sum(1 for n, _ in s.events if n.endswith("RewardSignal")) for s in steps)
    try:
        (revisions,) = query(settings, "SELECT sum(revision) FROM transitions_latest")[0]
        (versions,) = query(settings, "SELECT count() FROM state_versions_latest")[0]
    except Exception as exc:  # the sink may be starting again
        log(f"not settled yet: {exc!r}"[:200])
        return False
    return int(revisions or 0) >= want_revisions and int(versions) >= want_versions


def check(settings: Settings, steps: list[Step], codec: AvroCodec) -> Verdict:
    verdict = Verdict()
    event_ids = {r["envelope"]["event_id"] for s in steps for _, r in s.events}
    rows = query(settings, "SELECT event_id, count() FROM raw_events_latest GROUP BY event_id")
    seen = {r[0]: int(r[1]) for r in rows}
    verdict.add(
        "raw_events_latest",
        lost=len(event_ids - seen.keys()),
        duplicated=sum(n - 1 for n in seen.values()) + len(seen.keys() - event_ids),
    )

    expected = final_transitions([_without_deltas(s) for s in steps], codec)  # a delta is no part of a transition
    rows = query(
        settings,
        "SELECT session_id, step, logical_event_id, revision, tool_status, reward FROM transitions_latest",
    )
    got: dict[tuple[str, int], list[list]] = {}
    for row in rows:
        got.setdefault((row[0], int(row[1])), []).append(row)
    want = {(t["session_id"], t["step"]): t for t in expected}
    lost = sum(1 for key in want if key not in got)
    duplicated = sum(len(v) - 1 for v in got.values()) + sum(1 for key in got if key not in want)
    wrong = 0
    for key, t in want.items():
        if key not in got:
            continue
        _, _, lid, revision, tool_status, reward = got[key][0]
        same_reward = (reward is None) == (t["reward"] is None) and (
            reward is None or abs(float(reward) - t["reward"]) < 1e-9
        )
        same = lid == t["logical_event_id"] and int(revision) == t["revision"] and tool_status == t["tool_status"]
        wrong += int(not (same and same_reward))
    verdict.add("transitions_latest", lost, duplicated, wrong)

    versions_of: dict[str, int] = {}
    for s in steps:
        versions_of[s.session_id] = versions_of.get(s.session_id, 0) + sum(
            1 for name, _ in s.events if not name.endswith("RewardSignal")
        )
    rows = query(
        settings,
        "SELECT session_id, count(), uniqExact(ordinal), max(ordinal) FROM state_versions_latest GROUP BY session_id",
    )
    have = {r[0]: (int(r[1]), int(r[2]), int(r[3])) for r in rows}
    lost = duplicated = wrong = 0
    for session, n in versions_of.items():
        count, distinct, top = have.get(session, (0, 0, 0))
        lost += max(0, n - distinct)
        duplicated += count - distinct + max(0, distinct - n)
        wrong += int(top != distinct)  # a gap in the chain
    verdict.add("state_versions_latest", lost, duplicated, wrong)

    cached = asyncio.run(cache_ordinals(settings, list(versions_of)))
    wrong = sum(1 for session, n in versions_of.items() if cached.get(session) != n)
    verdict.add("valkey state cache", wrong=wrong)

    (dead,) = query(settings, "SELECT count() FROM dead_letters_latest")[0]
    verdict.add("dead_letters_latest", wrong=int(dead))
    verdict.notes.append(
        f"compared {len(seen):,}/{len(event_ids):,} raw events, {len(got):,}/{len(want):,} transitions, "
        f"{sum(v[0] for v in have.values()):,}/{sum(versions_of.values()):,} state versions, "
        f"{sum(1 for v in cached.values() if v is not None)}/{len(cached)} cached sessions"
    )
    return verdict


def _without_deltas(step: Step) -> Step:
    return Step(step.session_id, step.step, step.logical_event_id, [e for e in step.events if e[0] != STATE_DELTA])


async def cache_ordinals(settings: Settings, sessions: list[str]) -> dict[str, int | None]:
    """The ordinal of each session's last version in the Valkey state cache (processors.state.cache's layout)."""
    from processors.state.cache import connect

    client = connect(settings)
    try:
        async with client.pipeline(transaction=False) as pipe:
            for session in sessions:
                pipe.hget(f"{settings.topic_prefix}:state:{session}:meta", "ordinal")
            values = await pipe.execute()
    finally:
        await client.aclose()
    return {s: int(v) if v is not None else None for s, v in zip(sessions, values, strict=True)}


# --- the run --------------------------------------------------------------------------------------------------------


def cluster_settings(home: Path, run_id: str, partitions: int) -> Settings:
    """bench_settings with a local 3-broker cluster: its three addresses and 3 replicas (Settings' own rule)."""
    values = bench_settings(home, run_id, partitions).model_dump()
    values.pop("replication_factor")
    values.update(kafka_brokers=3, processors=("steps", "state"), sink_flush_seconds=0.5)
    if "TREADLE_KAFKA_HEAP" not in os.environ:
        values["kafka_heap"] = "256m"  # three JVMs on a laptop-sized machine
    return Settings(**values)


@dataclass
class Outcome:
    verdict: Verdict
    events: int
    injected: list[str]
    failed_sends: int


def run(events: int, faults: int, seed: int, sessions: int, duration_s: float) -> Outcome:
    codec = AvroCodec()
    rng = random.Random(seed)
    steps = with_state_deltas(make_steps(events, sessions, seed=seed))
    events = encoded(steps, codec)
    home = Path(tempfile.mkdtemp(prefix="treadle-chaos-"))
    settings = cluster_settings(home, f"chaos{uuid.uuid4().hex[:6]}", partitions=6)
    log(machine_facts())
    log(f"{len(events):,} events ({len(steps):,} steps, {sessions} sessions) over {duration_s:.0f} s, "
        f"{faults} faults, seed {seed}, home {home}")  # fmt: skip
    with local_stack(settings) as startup_s:
        log(f"3 brokers and Valkey up in {startup_s:.0f} s")
        from streams.runtime.worker import prepare_cluster

        asyncio.run(prepare_cluster(settings))
        worker = WorkerProcess(settings, settings.logs_dir / "worker.log", env={"TREADLE_SINK": "off"})
        sink = Sink(settings)
        try:
            sink.start().wait_ready(300)
            worker.start().wait_ready(300)
            chaos = Chaos(settings, worker, sink, schedule(rng, faults, duration_s), rng)
            thread = threading.Thread(target=chaos.run, name="chaos", daemon=True)
            thread.start()
            failed = asyncio.run(produce(settings, events, duration_s))
            log(f"all events sent ({failed} sends failed); waiting for the remaining faults")
            thread.join()
            if chaos.error is not None:
                raise chaos.error
            deadline = time.monotonic() + SETTLE_S
            while time.monotonic() < deadline and not settled(settings, steps):
                time.sleep(2)
            verdict = check(settings, steps, codec)
            verdict.notes.append(f"faults: {','.join(chaos.injected)}")
            return Outcome(verdict, len(events), chaos.injected, failed)
        finally:
            worker.stop()
            sink.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=50_000, help="input events to send (>= this many)")
    parser.add_argument("--faults", type=int, default=12, help="faults to inject, kinds in turn")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--duration", type=float, default=0.0, help="seconds to spread the events over")
    parser.add_argument("--quick", action="store_true", help="bench-smoke size: 4,000 events, 4 faults (one each)")
    args = parser.parse_args(argv)
    if args.quick:
        args.events, args.faults, args.sessions = 4_000, 4, 40
    duration = args.duration or max(30.0, 12.0 * args.faults)
    started = time.monotonic()
    outcome = run(args.events, args.faults, args.seed, args.sessions, duration)
    v = outcome.verdict
    kinds = ", ".join(f"{k} {outcome.injected.count(k)}" for k in KINDS)
    for note in v.notes:
        log(note)
    print(
        f"chaos: events {outcome.events:,}, faults injected {len(outcome.injected)} ({kinds}), lost {v.lost}, "
        f"duplicated {v.duplicated}, wrong {v.wrong} (seed {args.seed}, {time.monotonic() - started:.0f} s, "
        f"failed sends {outcome.failed_sends}, load avg {loadavg()})"
    )
    return 0 if (v.lost, v.duplicated, v.wrong, outcome.failed_sends) == (0, 0, 0, 0) else 1


if __name__ == "__main__":
    sys.exit(main())
