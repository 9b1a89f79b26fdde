"""One sink per embedded database: a second worker's sink in the same group is refused, and no row goes missing."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient

from sinks.sink_group import SinkGroupAssignor, SinkIdentity, StoreOwner
from sinks.sql_client import run_sql
from tests.factories import RawProducer, dispatch, treadle, wait_for
from topics.catalog import TopicCatalog
from topics.ids import uuid7
from topics.settings import Settings

SESSIONS = 24  # spread over every partition


def test_a_second_embedded_sink_is_refused_and_all_rows_land_in_one_database(
    deployment: Settings, worker_factory, tmp_path
) -> None:
    first = worker_factory().start()
    first.wait_ready()
    # Started with its defaults on another machine: its own home, hence its own embedded chDB and sink child.
    other = deployment.model_copy(
        update={
            "home": tmp_path / "second",
            "web_port": deployment.web_port + 400,
            "sql_port": deployment.sql_port - 1000,
        }
    )
    second = worker_factory(other).start()
    second.wait_ready()
    refused = wait_for(
        lambda: "this sink stops: refused:" in second.log_tail(200) and second.log_tail(200), 90, "the refusal"
    )
    assert "already consumes this sink group" in refused and "CLICKHOUSE_URL" in refused
    assert str((deployment.home / "chdb").resolve()) in refused  # it names the owner's database
    wait_for(lambda: "this worker runs without a sink" in second.log_tail(200), 30, "the worker to say so")
    assert "refused" not in first.log_tail(400)

    prefix = f"s-group-{uuid7()[:8]}"

    async def send() -> None:
        async with RawProducer(deployment) as producer:
            for i in range(SESSIONS):
                await producer.send("treadle.events.ActionDispatched", dispatch(f"{prefix}-{i}", uuid7(), 0, 1))
            await producer.flush()

    asyncio.run(send())
    count = f"SELECT count() FROM transitions_latest WHERE startsWith(session_id, '{prefix}')"
    wait_for(lambda: run_sql(deployment, count)[1] == [[SESSIONS]], 90, f"{SESSIONS} transitions in the first database")
    done = treadle(other, "sql", count)  # on the refused worker's home: where the rows are, not "retry shortly"
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "runs without a sink" in done.stderr and "query where that sink runs" in done.stderr
    second.stop()
    assert run_sql(other, count)[1] == [[0]]  # the refused sink wrote nothing to its own database


def test_a_newcomer_starting_while_the_embedded_owner_is_down_is_refused(
    deployment: Settings, worker_factory, tmp_path
) -> None:
    owner = worker_factory().start()
    owner.wait_ready()
    prefix = f"s-down-{uuid7()[:8]}"

    async def send(first: int, last: int) -> None:
        async with RawProducer(deployment) as producer:
            for i in range(first, last):
                await producer.send("treadle.events.ActionDispatched", dispatch(f"{prefix}-{i}", uuid7(), 0, 1))
            await producer.flush()

    count = f"SELECT count() FROM transitions_latest WHERE startsWith(session_id, '{prefix}')"
    asyncio.run(send(0, SESSIONS))
    wait_for(lambda: run_sql(deployment, count)[1] == [[SESSIONS]], 90, "the owner's rows")
    owner.stop()  # the owner is down: the group has no member that could tell a newcomer no

    other = deployment.model_copy(update={"home": tmp_path / "newcomer", "sql_port": deployment.sql_port - 1000})
    newcomer = worker_factory(other).start()
    newcomer.wait_ready()
    refused = wait_for(
        lambda: "this sink stops: refused:" in newcomer.log_tail(200) and newcomer.log_tail(200), 90, "the refusal"
    )
    assert str((deployment.home / "chdb").resolve()) in refused and "CLICKHOUSE_URL" in refused
    asyncio.run(send(SESSIONS, 2 * SESSIONS))  # arrives while only the refused newcomer runs
    newcomer.stop()
    assert run_sql(other, count)[1] == [[0]]

    back = worker_factory().start()  # the owner again, same database: it is not refused and gets the rest
    back.wait_ready()
    wait_for(lambda: run_sql(deployment, count)[1] == [[2 * SESSIONS]], 90, "every row in the owner's database")
    assert "refused" not in back.log_tail(400)


async def recorded_owners(settings: Settings, group: str) -> set[StoreOwner]:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers)
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return {o for m in committed.values() if (o := StoreOwner.decode(m.metadata or "")) is not None}


def test_an_owner_killed_before_its_first_insert_is_still_the_owner(
    deployment: Settings, worker_factory, tmp_path
) -> None:
    owner = worker_factory().start()
    owner.wait_ready()
    group = f"{deployment.app_id}-clickhouse-sink"
    recorded = wait_for(lambda: asyncio.run(recorded_owners(deployment, group)), 90, "the owner's record")
    assert {o.store for o in recorded} == {str((deployment.home / "chdb").resolve())}
    owner.kill()  # no event was ever sent: nothing inserted, nothing committed but the record

    other = deployment.model_copy(update={"home": tmp_path / "newcomer", "sql_port": deployment.sql_port - 1000})
    newcomer = worker_factory(other).start()
    newcomer.wait_ready()
    refused = wait_for(
        lambda: "this sink stops: refused:" in newcomer.log_tail(200) and newcomer.log_tail(200), 90, "the refusal"
    )
    assert "may be down now" in refused and str((deployment.home / "chdb").resolve()) in refused


def test_the_recorded_owner_is_the_database_not_the_host(tmp_path) -> None:
    settings = Settings(home=tmp_path / "a")
    mine = StoreOwner.of(settings)
    assert StoreOwner.decode(mine.encode()) == mine
    assert mine.same_database(replace(mine, host="another-container"))  # same files, recreated container
    assert not mine.same_database(StoreOwner.of(Settings(home=tmp_path / "b")))
    assert StoreOwner.decode("") is None and StoreOwner.decode("not json") is None


# --- the assignor alone, against the real broker: which member consumes ---------------------------------------------


def identity(name: str, embedded: bool) -> SinkIdentity:
    return SinkIdentity(instance=uuid7(), host=name, pid=0, embedded=embedded, store=f"/data/{name}")


class Member:
    """A consumer of the sink group's kind (SinkGroupAssignor) on one topic, polled until it has its verdict."""

    def __init__(self, settings: Settings, group: str, who: SinkIdentity) -> None:
        self.assignor = SinkGroupAssignor(who)
        self.consumer = AIOKafkaConsumer(
            TopicCatalog(settings)["actions"].name,
            bootstrap_servers=settings.kafka_bootstrap_servers,
            group_id=group,
            partition_assignment_strategy=(self.assignor,),
        )

    async def settle(self, seconds: float = 3.0) -> None:
        """Poll for `seconds` (rebalances complete inside getmany)."""
        deadline = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < deadline:
            await self.consumer.getmany(timeout_ms=200)

    @property
    def partitions(self) -> set[int]:
        return {tp.partition for tp in self.consumer.assignment()}


async def _members(settings: Settings, *whos: SinkIdentity, stagger: bool) -> list[Member]:
    group = f"{settings.app_id}-assignor-{uuid7()[:8]}"
    members = [Member(settings, group, who) for who in whos]
    if stagger:  # the first joins and settles before the next: it is the incumbent
        started: list[Member] = []
        for member in members:
            await member.consumer.start()
            started.append(member)
            await asyncio.gather(*(m.settle() for m in started))
    else:
        await asyncio.gather(*(m.consumer.start() for m in members))
    await asyncio.gather(*(m.settle(4.0) for m in members))
    return members


async def _stop(members: list[Member]) -> None:
    await asyncio.gather(*(m.consumer.stop() for m in members))


def test_sinks_that_all_write_a_server_share_the_partitions(deployment: Settings) -> None:
    async def run() -> None:
        members = await _members(deployment, identity("a", False), identity("b", False), stagger=True)
        try:
            assert all(m.assignor.refusal is None and m.partitions for m in members)
            assert members[0].partitions | members[1].partitions == set(range(deployment.partitions))
        finally:
            await _stop(members)

    asyncio.run(run())


def test_next_to_an_embedded_sink_the_first_one_keeps_every_partition(deployment: Settings) -> None:
    async def run() -> None:
        for first_embedded, second_embedded in ((True, True), (False, True), (True, False)):
            first, second = identity("first", first_embedded), identity("second", second_embedded)
            members = await _members(deployment, first, second, stagger=True)
            try:
                assert members[0].assignor.refusal is None
                assert members[0].partitions == set(range(deployment.partitions))
                assert members[1].partitions == set()
                assert members[1].assignor.refusal is not None and "the sink on first" in members[1].assignor.refusal
            finally:
                await _stop(members)

    asyncio.run(run())


def test_two_embedded_sinks_starting_at_once_leave_exactly_one_consuming(deployment: Settings) -> None:
    async def run() -> None:
        members = await _members(deployment, identity("a", True), identity("b", True), stagger=False)
        try:
            consuming = [m for m in members if m.assignor.refusal is None]
            assert len(consuming) == 1
            assert consuming[0].partitions == set(range(deployment.partitions))
        finally:
            await _stop(members)

    asyncio.run(run())
