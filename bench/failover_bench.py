"""How long a worker group takes to recover from a worker's kill -9: `python -m bench.failover_bench`.

Two `treadle worker`s (TREADLE_SINK=off: this measures processing, not inserts) share one group on a private local
stack. A dispatch goes to every input partition every TICK_S, each with a session of its own; its Transition read
back from the transitions topic says it was processed. Then one worker gets SIGKILL, and two times are taken from
the kill: until the group is stable again with the survivor alone (it then holds every partition), and until a
dispatch sent after the kill has been processed on every partition (the dead worker's included). The killed worker
is started again before the next run. TREADLE_SESSION_TIMEOUT_S (and any TREADLE_* variable) reaches the workers, so

    TREADLE_SESSION_TIMEOUT_S=15 python -m bench.failover_bench --runs 3
    TREADLE_SESSION_TIMEOUT_S=6 python -m bench.failover_bench --runs 3

compare settings in the same conditions. The numbers move with the machine's load; compare runs made together.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from bench.common import bench_settings, local_stack, machine_facts
from bench.workload import _envelope, dispatch_record, partition_keys
from streams.runtime.worker import prepare_cluster
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.settings import Settings
from treadle.devstack.worker_process import WorkerProcess

TICK_S = 0.25
ACTION = "treadle.events.ActionDispatched"
TRANSITIONS = "transitions"


@dataclass
class Run:
    """One kill: seconds from the kill until the group is stable with the survivor alone, and until every partition
    processed a dispatch sent after the kill; the survivor's latency before the kill, for scale."""

    stable_s: float
    processed_s: float
    latency_before_s: float
    per_partition_s: list[float] = field(default_factory=list)


class Traffic:
    """Dispatches to every partition each tick, and when each one's Transition came back."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        catalog = TopicCatalog(settings)
        self.actions = catalog.for_schema(ACTION).name
        self.transitions = catalog[TRANSITIONS].name
        self.codec = AvroCodec()
        self.sent: dict[bytes, tuple[int, float]] = {}  # session key -> (partition, sent at)
        self.done: dict[bytes, float] = {}
        self._tick = 0

    async def produce(self, stop: asyncio.Event) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=self.settings.kafka_bootstrap_servers, acks="all")
        await producer.start()
        try:
            while not stop.is_set():
                self._tick += 1
                for partition, session in enumerate(partition_keys(self.settings.partitions, f"fo{self._tick}")):
                    key = f"{session}-{uuid.uuid4().hex[:6]}".encode()
                    record = dispatch_record(_Rng(), _envelope(key.decode(), uuid.uuid4().hex, 1, "fo"), 0, "search")
                    await producer.send(self.actions, self.codec.encode(ACTION, record), key=key, partition=partition)
                    self.sent[key] = (partition, time.monotonic())
                await asyncio.sleep(TICK_S)
        finally:
            await producer.stop()

    async def consume(self, stop: asyncio.Event) -> None:
        consumer = AIOKafkaConsumer(
            self.transitions, bootstrap_servers=self.settings.kafka_bootstrap_servers, auto_offset_reset="latest"
        )
        await consumer.start()
        try:
            while not stop.is_set():
                batches = await consumer.getmany(timeout_ms=100)
                now = time.monotonic()
                for messages in batches.values():
                    for message in messages:
                        if message.key in self.sent:
                            self.done.setdefault(message.key, now)
        finally:
            await consumer.stop()

    def first_processed_after(self, t: float) -> dict[int, float]:
        """Per partition, when the first dispatch sent after `t` was processed (partitions still waiting: absent)."""
        first: dict[int, tuple[float, float]] = {}
        for key, (partition, sent_at) in self.sent.items():
            if sent_at > t and key in self.done and (partition not in first or sent_at < first[partition][0]):
                first[partition] = (sent_at, self.done[key])
        return {p: done for p, (_, done) in first.items()}

    def latency_between(self, start: float, end: float) -> float:
        lags = [self.done[k] - at for k, (_, at) in self.sent.items() if start <= at <= end and k in self.done]
        return statistics.median(lags) if lags else float("nan")


class _Rng:
    """The two random calls dispatch_record makes, fixed: the bench needs no variety in params."""

    def randrange(self, n: int) -> int:
        return 1

    def randint(self, a: int, b: int) -> int:
        return a


async def group_state(settings: Settings) -> tuple[str, int]:
    """(state, members) of the worker group (Faust's consumer group is the app id)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers)
    await admin.start()
    try:
        (response,) = await admin.describe_consumer_groups([settings.app_id])
        _, _, state, _, _, members = response.groups[0][:6]
        return state, len(members)
    finally:
        await admin.close()


async def wait_group(settings: Settings, members: int, timeout: float) -> float:
    """Monotonic time when the group was first seen Stable with `members` members."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state, count = await group_state(settings)
        if state == "Stable" and count == members:
            return time.monotonic()
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the group was not stable with {members} member(s) within {timeout:.0f} s")


async def one_run(settings: Settings, victim: WorkerProcess, traffic: Traffic, warmup_s: float) -> Run:
    await wait_group(settings, 2, 120)
    await asyncio.sleep(warmup_s)
    before_end = time.monotonic()
    latency = traffic.latency_between(before_end - warmup_s, before_end - 1.0)
    victim.kill()
    killed = time.monotonic()
    stable = await wait_group(settings, 1, 120)
    deadline = killed + 120
    while len(first := traffic.first_processed_after(killed)) < settings.partitions:
        if time.monotonic() > deadline:
            raise TimeoutError(f"partitions {sorted(set(range(settings.partitions)) - set(first))} never recovered")
        await asyncio.sleep(0.1)
    per_partition = [first[p] - killed for p in range(settings.partitions)]
    return Run(stable - killed, max(per_partition), latency, per_partition)


async def measure(settings: Settings, runs: int, warmup_s: float) -> list[Run]:
    await prepare_cluster(settings)
    workers = [
        WorkerProcess(
            settings.model_copy(update={"home": settings.home / name, "web_port": settings.web_port + i * 2}),
            settings.home / f"{name}.log",
        )
        for i, name in enumerate(("survivor", "victim"))
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        await asyncio.to_thread(worker.wait_ready, 180)
    traffic, stop = Traffic(settings), asyncio.Event()
    tasks = [asyncio.create_task(traffic.consume(stop)), asyncio.create_task(traffic.produce(stop))]
    results = []
    try:
        for i in range(runs):
            if i > 0:
                workers[1].start()
                await asyncio.to_thread(workers[1].wait_ready, 180)
            results.append(await one_run(settings, workers[1], traffic, warmup_s))
            r = results[-1]
            print(f"run {i + 1}: stable after {r.stable_s:.1f} s, every partition processing after "
                  f"{r.processed_s:.1f} s (per partition {', '.join(f'{s:.1f}' for s in r.per_partition_s)}); "
                  f"latency before the kill {r.latency_before_s * 1000:.0f} ms", flush=True)  # fmt: skip
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker in workers:
            worker.stop()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.failover_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="kills, one after another (3)")
    parser.add_argument("--partitions", type=int, default=4, help="partitions per topic (4)")
    parser.add_argument("--warmup", type=float, default=6.0, help="seconds of traffic before each kill (6)")
    args = parser.parse_args(argv)
    print(machine_facts())
    with tempfile.TemporaryDirectory(prefix="treadle-failover-") as tmp:
        run_id = f"fo{uuid.uuid4().hex[:6]}"
        settings = bench_settings(Path(tmp), run_id, args.partitions).model_copy(update={"sink": "off"})
        print(f"TREADLE_SESSION_TIMEOUT_S={settings.session_timeout_s:g} (heartbeat every "
              f"{settings.session_timeout_s / 5:g} s), {args.partitions} partitions, 2 workers")  # fmt: skip
        with local_stack(settings):
            results = asyncio.run(measure(settings, args.runs, args.warmup))
    stable = statistics.median(r.stable_s for r in results)
    processed = statistics.median(r.processed_s for r in results)
    print(f"median of {len(results)}: group stable after {stable:.1f} s; every partition processing after "
          f"{processed:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
