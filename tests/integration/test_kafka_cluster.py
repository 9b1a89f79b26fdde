"""A local 3-broker KRaft cluster (`treadle up --brokers 3`): a partition leader killed with -9 while the SDK produces
and while a worker processes, then restarted, costs no event and duplicates none in the `_latest` views.

The cluster is this module's own (module-scoped, 127.0.0.1 on TREADLE_TEST_PORT_BASE+112..117), not the session's
single broker, so its topics have 3 replicas and need 2 in sync.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from sinks.sql_client import run_sql
from streams.runtime.app import build_pipeline
from streams.sdk import AgentStream
from streams.sdk.producer import create_producer, producer_config
from tests.factories import isolated_deployment, wait_for
from tests.paths import REPO_ROOT
from topics.catalog import TopicCatalog
from topics.settings import KAFKA_MAX_MESSAGE_BYTES, Settings
from treadle.devstack.kafka import LocalKafkaCluster
from treadle.devstack.stack import LocalStack
from treadle.devstack.worker_process import WorkerProcess

PORT_BASE = int(os.environ.get("TREADLE_TEST_PORT_BASE", "31000"))
_COUNTER = itertools.count()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """Three local brokers and a Valkey server, started for this module and stopped after it."""
    base = Settings(
        home=tmp_path_factory.mktemp("cluster-home"),
        kafka_bootstrap_servers=f"127.0.0.1:{PORT_BASE + 112}",  # nodes on +112, +114, +116 (controllers +1)
        kafka_controller_port=PORT_BASE + 113,
        kafka_brokers=3,
        kafka_heap="256m",
        valkey_port=PORT_BASE + 381,
        cache=REPO_ROOT / ".treadle" / "cache",
        partitions=3,
    )
    local = LocalStack(base)
    try:
        local.up()
        yield base
    finally:
        local.down()


@pytest.fixture
def deployment(cluster: Settings, tmp_path: Path) -> Settings:
    n = next(_COUNTER)
    return isolated_deployment(
        cluster, tmp_path / "home", f"c{os.getpid()}x{n}", PORT_BASE - 300 + n, PORT_BASE - 250 + n
    )


@pytest.fixture
def workers(deployment: Settings) -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        worker.stop()


@pytest.fixture
def brokers(cluster: Settings) -> Iterator[LocalKafkaCluster]:
    """The cluster's nodes; any a test killed runs again afterwards, for the next test."""
    nodes = LocalKafkaCluster(cluster)
    yield nodes
    nodes.up()


def start_worker(settings: Settings, started: list[WorkerProcess]) -> WorkerProcess:
    worker = WorkerProcess(settings, settings.home / "worker.log").start()
    started.append(worker)
    worker.wait_ready()
    return worker


async def leader_of(settings: Settings, topic: str, partition: int = 0) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
        return next(p["leader"] for p in described["partitions"] if p["partition"] == partition)
    finally:
        await admin.close()


class Agents:
    """SDK sessions producing steps (dispatch, tool result, reward), remembering what each step must become."""

    def __init__(self, settings: Settings, sessions: int, steps: int, seed: int) -> None:
        self.settings = settings
        self.sessions = sessions
        self.steps = steps
        self.rng = random.Random(seed)
        self.expected: dict[tuple[str, int], float] = {}  # (session, step) -> reward

    async def run(self, on_progress: dict[float, object] | None = None, pause_s: float = 0.005) -> None:
        """Every session's steps, interleaved; at each fraction in `on_progress` its callable (or coroutine
        function) runs, e.g. a broker kill."""
        hooks = sorted((on_progress or {}).items())
        producer = create_producer(self.settings)
        await producer.start()
        try:
            streams = [
                AgentStream(self.settings, agent_id=f"agent-{i}", producer=producer) for i in range(self.sessions)
            ]
            for stream in streams:
                await stream.start()
            total = self.sessions * self.steps
            done = 0
            for _ in range(self.steps):
                for stream in streams:
                    ref = await stream.dispatch("search", {"q": "x"})
                    await stream.tool_result(ref, "OK", output="found")
                    value = round(self.rng.uniform(-1, 1), 3)
                    await stream.reward(ref, value, source="judge")
                    self.expected[(stream.session_id, ref.step)] = value
                    done += 1
                    while hooks and done >= hooks[0][0] * total:
                        hook = hooks.pop(0)[1]
                        outcome = hook()  # type: ignore[operator]
                        if asyncio.iscoroutine(outcome):
                            await outcome
                    await asyncio.sleep(pause_s)
            for stream in streams:
                await stream.close()
        finally:
            await producer.stop()

    def check(self) -> tuple[int, int, int]:
        """(lost, duplicated, wrong) steps in transitions_latest, and events in raw_events_latest."""
        _, rows = run_sql(self.settings, "SELECT session_id, step, revision, reward FROM transitions_latest")
        seen: dict[tuple[str, int], list[tuple[int, float | None]]] = {}
        for session, step, revision, reward in rows:
            seen.setdefault((session, step), []).append((revision, reward))
        lost = sum(1 for key in self.expected if key not in seen)
        duplicated = sum(len(v) - 1 for v in seen.values()) + sum(1 for key in seen if key not in self.expected)
        wrong = sum(
            1
            for key, value in self.expected.items()
            if key in seen and (seen[key][0][0] != 3 or seen[key][0][1] is None or abs(seen[key][0][1] - value) > 1e-9)
        )
        _, events = run_sql(self.settings, "SELECT count(), uniqExact(event_id) FROM raw_events_latest")
        want = 3 * len(self.expected)
        lost += max(0, want - events[0][1])
        duplicated += events[0][0] - events[0][1] + max(0, events[0][1] - want)
        return lost, duplicated, wrong

    def complete(self) -> bool:
        """Every step at its final revision and every event in raw_events: the sink inserts both from one consumer,
        but a table's rows become visible only with its own insert, so neither implies the other."""
        _, rows = run_sql(
            self.settings,
            "SELECT (SELECT count() FROM transitions_latest WHERE revision = 3),"
            " (SELECT uniqExact(event_id) FROM raw_events_latest)",
        )
        steps, events = rows[0]
        return steps >= len(self.expected) and events >= 3 * len(self.expected)

    def diagnosis(self, worker: WorkerProcess) -> str:
        """(lost, duplicated, wrong), what the sink refused or dead-lettered, and the worker's log tail."""
        _, rows = run_sql(
            self.settings,
            "SELECT (SELECT count() FROM raw_events), (SELECT count() FROM transitions),"
            " (SELECT count() FROM rejected_rows), (SELECT count() FROM dead_letters)",
        )
        raw, transitions, rejected, dead = rows[0]
        return (
            f"(lost, duplicated, wrong) = {self.check()}; rows: raw_events {raw}, transitions {transitions},"
            f" rejected_rows {rejected}, dead_letters {dead}\n{worker.log_tail()}"
        )


async def topic_configs(settings: Settings, topic: str) -> dict[str, str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers)
    await admin.start()
    try:
        (response,) = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
        (resource,) = response.resources
        return {entry[0]: entry[1] for entry in resource[4]}
    finally:
        await admin.close()


def test_the_cluster_has_three_replicas_two_in_sync_and_one_record_limit(deployment: Settings) -> None:
    catalog = TopicCatalog(deployment)
    for spec in (catalog["actions"], catalog["rewards"]):
        configs = asyncio.run(topic_configs(deployment, spec.name))
        assert configs["min.insync.replicas"] == "2"
        assert configs["max.message.bytes"] == str(KAFKA_MAX_MESSAGE_BYTES)
        assert spec.replication_factor == 3
    assert deployment.kafka_bootstrap_servers.count(",") == 2  # clients bootstrap from any of the three


def test_the_sdk_and_the_worker_produce_with_acks_all_and_idempotence(deployment: Settings) -> None:
    assert producer_config(deployment)["acks"] == "all"
    assert producer_config(deployment)["enable_idempotence"] is True

    async def worker_producer_settings() -> tuple[object, bool]:
        """What the worker's Faust producer hands aiokafka (BatchingProducer): acks -1 is "all"."""
        producer = build_pipeline(deployment, processors=[]).app.producer._new_producer()
        return producer._sender._acks, producer._txn_manager is not None

    acks, idempotent = asyncio.run(worker_producer_settings())
    assert acks == -1 and idempotent


def test_killing_the_leader_while_the_sdk_produces_loses_and_duplicates_nothing(
    deployment: Settings, brokers: LocalKafkaCluster, workers: list[WorkerProcess]
) -> None:
    agents = Agents(deployment, sessions=12, steps=40, seed=3)
    actions = TopicCatalog(deployment)["actions"].name
    killed: list[int] = []

    async def kill_leader() -> None:
        node = await leader_of(deployment, actions)
        brokers.node(node).kill()
        killed.append(node)

    async def restart() -> None:
        await asyncio.to_thread(brokers.node(killed[0]).up)

    asyncio.run(agents.run({0.3: kill_leader, 0.7: restart}))
    assert killed, "the leader was not killed"
    worker = start_worker(deployment, workers)
    wait_for(agents.complete, 180, "every step at revision 3 and every event", explain=lambda: agents.diagnosis(worker))
    assert agents.check() == (0, 0, 0), agents.diagnosis(worker)


def test_killing_the_leader_while_a_worker_processes_loses_and_duplicates_nothing(
    deployment: Settings, brokers: LocalKafkaCluster, workers: list[WorkerProcess]
) -> None:
    agents = Agents(deployment, sessions=12, steps=40, seed=5)
    transitions = TopicCatalog(deployment)["transitions"].name
    worker = start_worker(deployment, workers)
    killed: list[int] = []

    async def kill_leader_once_rows_land() -> None:
        await asyncio.to_thread(
            wait_for, lambda: run_sql(deployment, "SELECT count() FROM transitions")[1][0][0] > 0, 90, "first rows"
        )
        node = await leader_of(deployment, transitions)  # where the worker writes its outputs
        brokers.node(node).kill()
        killed.append(node)

    async def restart() -> None:
        await asyncio.to_thread(brokers.node(killed[0]).up)

    asyncio.run(agents.run({0.4: kill_leader_once_rows_land, 0.8: restart}))
    assert killed, "the leader was not killed"
    wait_for(agents.complete, 180, "every step at revision 3 and every event", explain=lambda: agents.diagnosis(worker))
    assert agents.check() == (0, 0, 0), agents.diagnosis(worker)
    assert worker.proc is not None and worker.proc.poll() is None  # the worker rode out the failover
