"""treadle.Executor and AgentStream.submit_plan against a real Kafka broker.

The scheduler's releases are real ones: the tests fold plan events with `PlanScheduler` (the plans processor's pure
core) and write its SubgoalReleased records to the work topic themselves; what the executor reports is read back
from plan_events and decoded. Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from processors.plans.dag import PlanScheduler
from streams.sdk.plans import plan_subgoals
from topics.admin import ensure_topics
from topics.catalog import TopicCatalog, topic_expectation
from topics.codec import AvroCodec
from topics.ids import now_micros, uuid7
from topics.names import (
    DISPATCH,
    EXECUTOR_HEARTBEAT,
    PLAN_EVENTS_KEY,
    PLAN_FINISHED,
    PLAN_SUBMITTED,
    SUBGOAL_RELEASED,
    SUBGOAL_STATUS,
)
from topics.settings import Settings
from treadle import (
    AgentStream,
    AgentStreamSync,
    AttemptContext,
    Executor,
    PlanRefused,
    ResourceProfile,
    RetryPolicy,
    Subgoal,
    SubgoalWork,
)

WAIT_S = 60.0  # an upper bound for the slow shared test machine, not a timing assertion
KEY = PLAN_EVENTS_KEY.encode()


@pytest.fixture(scope="module")
def settings(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """This module's deployment: its own topic prefix, the catalog's topics created."""
    s = stack.model_copy(
        update={"home": tmp_path_factory.mktemp("executor-home"), "topic_prefix": f"ex{uuid.uuid4().hex[:8]}"}
    )
    asyncio.run(ensure_topics(TopicCatalog(s), s.kafka_bootstrap_servers))
    return s


@dataclass(frozen=True)
class PlanEvent:
    key: bytes
    schema: str
    record: dict[str, Any]


class Topic:
    """Reads one topic from its beginning, decoded, and waits for what a test expects to see."""

    def __init__(self, settings: Settings, name: str, expect: str | frozenset[str] | None) -> None:
        self.settings, self.name, self.expect = settings, name, expect
        self.codec = AvroCodec()
        self.events: list[PlanEvent] = []
        self.consumer: AIOKafkaConsumer | None = None

    async def __aenter__(self) -> Topic:
        self.consumer = AIOKafkaConsumer(bootstrap_servers=self.settings.kafka_bootstrap_servers)
        await self.consumer.start()
        partitions = [TopicPartition(self.name, p) for p in sorted(self.consumer.partitions_for_topic(self.name) or [])]
        if not partitions:  # metadata not fetched yet
            await self.consumer._client.force_metadata_update()
            partitions = [TopicPartition(self.name, p) for p in sorted(self.consumer.partitions_for_topic(self.name))]
        self.consumer.assign(partitions)
        await self.consumer.seek_to_beginning(*partitions)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.consumer is not None
        await self.consumer.stop()

    async def wait_for(self, predicate: Callable[[list[PlanEvent]], Any], what: str) -> Any:
        """Read until `predicate(events)` is truthy; return its value."""
        assert self.consumer is not None
        deadline = time.monotonic() + WAIT_S
        while not (found := predicate(self.events)):
            assert time.monotonic() < deadline, f"gave up waiting for {what}; saw {len(self.events)} events"
            for messages in (await self.consumer.getmany(timeout_ms=200)).values():
                for m in messages:
                    schema, record = self.codec.decode(m.value, expect=self.expect)
                    self.events.append(PlanEvent(m.key, schema, record))
        return found

    def statuses(self, attempt_key: str | None = None) -> list[dict[str, Any]]:
        out = [e.record for e in self.events if e.schema == SUBGOAL_STATUS]
        if attempt_key is not None:
            out = [r for r in out if _key_of(r) == attempt_key]
        return out

    def heartbeats(self, executor_id: str) -> list[dict[str, Any]]:
        return [
            e.record for e in self.events if e.schema == EXECUTOR_HEARTBEAT and e.record["executor_id"] == executor_id
        ]


def _key_of(status: dict[str, Any]) -> str:
    return f"{status['envelope']['session_id']}/{status['plan_id']}/{status['subgoal_id']}/{status['attempt']}"


def plan_events(settings: Settings) -> Topic:
    spec = TopicCatalog(settings)["plan_events"]
    return Topic(settings, spec.name, topic_expectation(spec))


@contextlib.asynccontextmanager
async def work_writer(settings: Settings) -> AsyncIterator[Callable[..., Any]]:
    """Writes SubgoalReleased records to their work topic, keyed by session, as the plans processor does; `sent_at`
    (UTC micros) backdates the record's timestamp, as for work written long ago."""
    codec = AvroCodec()
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap_servers, acks="all")
    await producer.start()

    async def write(record: dict[str, Any], sent_at: int | None = None) -> None:
        value = codec.encode(SUBGOAL_RELEASED, record)
        timestamp_ms = sent_at // 1000 if sent_at is not None else None
        await producer.send_and_wait(record["work_topic"], value, key=record["session_id"].encode(),
                                     timestamp_ms=timestamp_ms)  # fmt: skip

    try:
        yield write
    finally:
        await producer.stop()


def plan_record(session_id: str, plan_id: str, subgoals: list[Subgoal], event_time: int) -> dict[str, Any]:
    env = {
        "event_id": uuid7(),
        "session_id": session_id,
        "agent_id": "planner",
        "episode_id": "ep-1",
        "logical_event_id": plan_id,
        "seq": 0,
        "event_time": event_time,
        "policy_version": "",
        "trace_id": "",
        "attributes": {},
    }
    return {"envelope": env, "plan_id": plan_id, "goal": "", "subgoals": plan_subgoals(plan_id, subgoals)}


def heartbeat(executor_id: str, resource_class: str, sent_at: int, *, cpu: int = 4, valid_for_s: float = 3600.0):
    return {
        "executor_id": executor_id,
        "resource_class": resource_class,
        "free_gpu_memory_mb": 0,
        "free_gpus": 0,
        "free_cpu": cpu,
        "running": [],
        "valid_for_s": valid_for_s,
        "host": "",
        "sent_at": sent_at,
    }


def stopped(events: Topic, executor_id: str) -> bool:
    """Whether the executor's last heartbeat (the one it sends when it stops: no capacity, nothing running) is in."""
    return any(not h["running"] and not h["free_cpu"] for h in events.heartbeats(executor_id))


def releases(decisions: list[Any]) -> list[dict[str, Any]]:
    return [d.record for d in decisions if d.schema == SUBGOAL_RELEASED]


async def scheduler_loop(settings: Settings, scheduler: PlanScheduler, finished: asyncio.Event) -> None:
    """The plans processor in miniature: fold plan_events in log order and write the releases to the work topics."""
    async with plan_events(settings) as events, work_writer(settings) as write:
        seen = 0
        while not finished.is_set():
            await events.wait_for(lambda evs, seen=seen: len(evs) > seen, "plan events")
            for event in events.events[seen:]:
                for decision in scheduler.apply(event.schema, event.record):
                    if decision.schema == SUBGOAL_RELEASED:
                        await write(decision.record)
                    if decision.schema == PLAN_FINISHED:
                        finished.set()
            seen = len(events.events)


class FlakyToolError(RuntimeError):
    """What the handler raises on a subgoal's first attempt."""


async def test_a_submitted_plan_runs_on_an_executor_with_statuses_heartbeats_and_step_attributes(
    settings: Settings,
) -> None:
    """submit_plan -> scheduler -> executor -> statuses back: retries on a failure, output refs, HEARTBEATs while
    a handler runs, capacity less the running attempt, step-path events carrying the plan and subgoal."""
    holding = asyncio.Event()  # the handler of "slow" waits for it
    calls: list[tuple[str, int]] = []
    received: list[tuple[int, int | None, int]] = []  # released_at, received_at, the handler's call

    async def handle(work: SubgoalWork, ctx: AttemptContext) -> str:
        calls.append((work.subgoal_id, work.attempt))
        received.append((work.released_at, work.received_at, now_micros()))
        step = await ctx.stream.dispatch(work.tool or "noop", work.params)
        await ctx.stream.tool_result(step, "OK", output="done")
        if work.subgoal_id == "flaky" and work.attempt == 1:
            raise FlakyToolError("first try fails")
        if work.subgoal_id == "slow":
            await holding.wait()
        return f"ref://{work.subgoal_id}/{work.attempt}"

    scheduler = PlanScheduler(work_topic_prefix=f"{settings.topic_prefix}.work")
    finished = asyncio.Event()
    loop_task = asyncio.create_task(scheduler_loop(settings, scheduler, finished))
    executor = Executor(
        resource_class="cpu",
        handler=handle,
        settings=settings,
        executor_id="ex-main",
        cpu=4,
        gpu_memory_mb=1000,
        gpus=1,
        heartbeat_interval_s=0.2,
        valid_for_s=30.0,
        gpu_free_mb=lambda: 10**6,
    )
    subgoals = [
        Subgoal(id="fetch", tool="fetch", params={"url": "u"}, deadline_s=30),
        Subgoal(id="flaky", tool="parse", depends_on=["fetch"], deadline_s=30, retry=RetryPolicy(max_attempts=2)),
        Subgoal(
            id="slow",
            tool="train",
            depends_on=["fetch"],
            deadline_s=30,
            profile=ResourceProfile(gpu_memory_mb=400, gpus=1, cpu=2),
        ),
        Subgoal(id="report", tool="write", depends_on=["flaky", "slow"], deadline_s=30),
    ]
    try:
        async with executor, plan_events(settings) as events:
            async with AgentStream(settings, agent_id="planner") as planner:
                await planner.submit_plan("plan-1", subgoals, goal="summarise the page")
            session = planner.session_id
            slow_key = f"{session}/plan-1/slow/1"
            await events.wait_for(
                lambda evs: any(s["state"] == "HEARTBEAT" for s in events.statuses(slow_key)),
                "a HEARTBEAT of the slow attempt",
            )
            ad = await events.wait_for(
                lambda evs: next((h for h in events.heartbeats("ex-main") if slow_key in h["running"]), None),
                "a heartbeat listing the slow attempt",
            )
            # the budget less what the attempts it holds take (the slow one, maybe flaky's retry or "report")
            held = [k for k in ad["running"]]
            cpu_held = sum(2 if k == slow_key else 1 for k in held)
            assert (ad["free_gpu_memory_mb"], ad["free_gpus"], ad["free_cpu"]) == (600, 0, 4 - cpu_held)
            holding.set()
            await asyncio.wait_for(finished.wait(), WAIT_S)
    finally:
        finished.set()
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)
    async with plan_events(settings) as events:  # everything, up to the executor's last heartbeat (at its stop)
        await events.wait_for(lambda evs: stopped(events, "ex-main"), "the executor's last heartbeat")

    states = scheduler.subgoal_states(session, "plan-1")
    assert {s: str(v) for s, v in states.items()} == dict.fromkeys(["fetch", "flaky", "slow", "report"], "SUCCEEDED")
    assert sorted(calls) == [("fetch", 1), ("flaky", 1), ("flaky", 2), ("report", 1), ("slow", 1)]
    # the executor stamps when it read each release: after the scheduler's event time, before the handler's call
    assert all(r is not None and released <= r <= called for released, r, called in received), received
    submitted = [e for e in events.events if e.schema == PLAN_SUBMITTED]
    assert [e.key for e in submitted] == [KEY] and submitted[0].record["goal"] == "summarise the page"
    assert all(e.key == KEY for e in events.events)
    by_attempt: dict[str, list[dict[str, Any]]] = {}
    for status in events.statuses():
        by_attempt.setdefault(_key_of(status), []).append(status)
        assert status["executor_id"] == "ex-main"
    for key, statuses in by_attempt.items():
        states_seen = [s["state"] for s in statuses]
        assert states_seen[0] == "RUNNING" and states_seen[-1] in ("SUCCEEDED", "FAILED"), (key, states_seen)
        assert set(states_seen[1:-1]) <= {"HEARTBEAT"}, (key, states_seen)
        last = statuses[-1]
        if last["state"] == "SUCCEEDED":
            assert last["output_ref"] == f"ref://{last['subgoal_id']}/{last['attempt']}"
        else:
            assert (key, last["error_class"], last["error"]) == (
                f"{session}/plan-1/flaky/1",
                "FlakyToolError",
                "first try fails",
            )
    sent_at = [h["sent_at"] for h in events.heartbeats("ex-main")]
    assert sent_at == sorted(set(sent_at)), "heartbeats' sent_at must strictly increase"
    last_ad = events.heartbeats("ex-main")[-1]
    assert (last_ad["free_gpu_memory_mb"], last_ad["free_gpus"], last_ad["free_cpu"], last_ad["running"]) == (
        0,
        0,
        0,
        [],
    ), "the last heartbeat (stop) advertises nothing"

    # the handlers' dispatches went through the normal step path, tagged with their plan and subgoal
    async with Topic(settings, TopicCatalog(settings)["actions"].name, DISPATCH) as actions:
        tagged = await actions.wait_for(
            lambda evs: (
                [e for e in evs if e.record["envelope"]["attributes"].get("plan_session_id") == session]
                if len([e for e in evs if e.record["envelope"]["attributes"].get("plan_session_id") == session]) == 5
                else None
            ),
            "the five dispatches of the plan's attempts",
        )
    tags = sorted(
        (e.record["envelope"]["attributes"]["subgoal_id"], e.record["envelope"]["attributes"]["attempt"])
        for e in tagged
    )
    assert tags == [("fetch", "1"), ("flaky", "1"), ("flaky", "2"), ("report", "1"), ("slow", "1")]
    for e in tagged:
        attrs = e.record["envelope"]["attributes"]
        assert attrs["plan_id"] == "plan-1" and attrs["executor_id"] == "ex-main"
        assert e.record["envelope"]["episode_id"] == planner.episode_id
        assert e.record["envelope"]["session_id"] != session  # an attempt's session of its own (one seq writer)


async def test_an_executor_runs_only_its_own_work_once_and_drops_expired_work(settings: Settings) -> None:
    """Two executors of one class read the whole work topic: each runs the releases counted against it, a re-sent
    release once, and reports work whose deadline passed before it could start as FAILED `expired`, unrun."""
    ran: list[tuple[str, str]] = []

    async def handle_a(work: SubgoalWork, ctx: AttemptContext) -> None:
        ran.append(("ex-a", work.attempt_key))

    def handle_b(work: SubgoalWork, ctx: AttemptContext) -> dict[str, Any]:  # a sync handler, in a thread
        ctx.stream.dispatch(work.tool or "noop", work.params)
        ran.append(("ex-b", work.attempt_key))
        return {"rows": 3}

    cls = "shared"
    now = now_micros()
    session = f"s-{uuid.uuid4().hex[:8]}"
    scheduler = PlanScheduler(work_topic_prefix=f"{settings.topic_prefix}.work")
    scheduler.apply(EXECUTOR_HEARTBEAT, heartbeat("ex-a", cls, now, cpu=2))
    scheduler.apply(EXECUTOR_HEARTBEAT, heartbeat("ex-b", cls, now, cpu=2))
    subgoals = [Subgoal(id=f"g{i}", tool="t", resource_class=cls, deadline_s=60) for i in range(4)]
    released = releases(scheduler.apply(PLAN_SUBMITTED, plan_record(session, "p", subgoals, now)))
    assert sorted(r["executor_id"] for r in released) == ["ex-a", "ex-a", "ex-b", "ex-b"]
    # an old release (its deadline long past) for each executor, from another scheduler's earlier run, written then
    # (an executor's deadline runs from when the work was written, as the scheduler's does from its delivery marker)
    old = now - 600 * 1_000_000
    stale = PlanScheduler(work_topic_prefix=f"{settings.topic_prefix}.work")
    for eid in ("ex-a", "ex-b"):
        stale.apply(EXECUTOR_HEARTBEAT, heartbeat(eid, cls, old, cpu=1))
    expired = releases(stale.apply(PLAN_SUBMITTED, plan_record(session, "old", subgoals[:2], old)))
    last = PlanScheduler(work_topic_prefix=f"{settings.topic_prefix}.work")
    for eid in ("ex-a", "ex-b"):
        last.apply(EXECUTOR_HEARTBEAT, heartbeat(eid, cls, now, cpu=1))
    sentinels = releases(last.apply(PLAN_SUBMITTED, plan_record(session, "last", subgoals[:2], now)))
    assert {r["executor_id"] for r in expired} == {r["executor_id"] for r in sentinels} == {"ex-a", "ex-b"}
    # a release larger than ex-a's whole budget (a scheduler that believed an older, larger advertisement)
    big = PlanScheduler(work_topic_prefix=f"{settings.topic_prefix}.work")
    big.apply(EXECUTOR_HEARTBEAT, heartbeat("ex-a", cls, now, cpu=8))
    huge = Subgoal(id="huge", resource_class=cls, profile=ResourceProfile(cpu=5), deadline_s=60)
    (too_big,) = releases(big.apply(PLAN_SUBMITTED, plan_record(session, "big", [huge], now)))

    a = Executor(resource_class=cls, handler=handle_a, settings=settings, executor_id="ex-a", cpu=2)
    b = Executor(resource_class=cls, handler=handle_b, settings=settings, executor_id="ex-b", cpu=2)
    async with a, b, plan_events(settings) as events, work_writer(settings) as write:
        # one session, so one partition: the executors read these in this order
        for record in [*released, *released, *expired, too_big, *sentinels]:
            await write(record, old if record in expired else None)
        sentinel_keys = {f"{session}/last/{r['subgoal_id']}/{r['attempt']}" for r in sentinels}
        await events.wait_for(
            lambda evs: sentinel_keys <= {_key_of(s) for s in events.statuses() if s["state"] == "SUCCEEDED"},
            "the sentinels' SUCCEEDED",
        )
    (refused,) = events.statuses(f"{session}/big/huge/1")
    assert (refused["state"], refused["error_class"]) == ("FAILED", "over_capacity")
    expected = sorted((r["executor_id"], f"{session}/p/{r['subgoal_id']}/1") for r in released)
    assert sorted(x for x in ran if "/p/" in x[1]) == expected, "each release ran once, on its own executor"
    assert not [x for x in ran if "/old/" in x[1]], "expired work must not run"
    for r in expired:
        key = f"{session}/old/{r['subgoal_id']}/{r['attempt']}"
        assert [(s["state"], s["error_class"], s["executor_id"]) for s in events.statuses(key)] == [
            ("FAILED", "expired", r["executor_id"])
        ]
    for r in released:
        key = f"{session}/p/{r['subgoal_id']}/1"
        done = [s for s in events.statuses(key) if s["state"] == "SUCCEEDED"]
        assert len(done) == 1
        assert done[0]["output_ref"] == (None if r["executor_id"] == "ex-a" else '{"rows":3}')

    # the sync handler's dispatches (a blocking stream over the executor's own) carry their attempt's tags
    by_b = sorted(key for eid, key in ran if eid == "ex-b")
    async with Topic(settings, TopicCatalog(settings)["actions"].name, DISPATCH) as actions:

        def from_b(evs: list[PlanEvent]) -> list[str] | None:
            tags = [e.record["envelope"]["attributes"] for e in evs]
            keys = sorted(
                f"{t['plan_session_id']}/{t['plan_id']}/{t['subgoal_id']}/{t['attempt']}"
                for t in tags
                if t.get("plan_session_id") == session and t.get("executor_id") == "ex-b"
            )
            return keys if len(keys) >= len(by_b) else None

        assert await actions.wait_for(from_b, "ex-b's dispatches") == by_b


async def test_stop_finishes_or_abandons_running_work_and_advertises_no_capacity(settings: Settings) -> None:
    """Capacity advertised = budget less the running attempt's profile, capped by the GPU probe; a graceful stop
    lets the running attempt finish, `abandon=True` reports it FAILED `abandoned`; the last heartbeat is empty."""
    cls = "gpu"
    started: dict[str, asyncio.Event] = {"ex-g1": asyncio.Event(), "ex-g2": asyncio.Event()}
    release_handler = asyncio.Event()

    async def handle(work: SubgoalWork, ctx: AttemptContext) -> str:
        started[ctx.executor_id].set()
        await release_handler.wait()
        return "finished"

    now = now_micros()
    session = f"s-{uuid.uuid4().hex[:8]}"
    scheduler = PlanScheduler(work_topic_prefix=f"{settings.topic_prefix}.work")
    profile = ResourceProfile(gpu_memory_mb=3000, gpus=1, cpu=1)
    out = {}
    for eid in started:
        hb = heartbeat(eid, cls, now, cpu=4) | {"free_gpu_memory_mb": 8000, "free_gpus": 2}
        scheduler.apply(EXECUTOR_HEARTBEAT, hb)
        plan = plan_record(
            session, f"plan-{eid}", [Subgoal(id="g", resource_class=cls, profile=profile, deadline_s=60)], now
        )
        out[eid] = releases(scheduler.apply(PLAN_SUBMITTED, plan))
        scheduler.apply(EXECUTOR_HEARTBEAT, hb | {"sent_at": now + 1, "free_gpu_memory_mb": 0, "executor_id": eid})
    assert [r["executor_id"] for rs in out.values() for r in rs] == ["ex-g1", "ex-g2"]

    def executor(eid: str) -> Executor:
        return Executor(
            resource_class=cls,
            handler=handle,
            settings=settings,
            executor_id=eid,
            gpu_memory_mb=8000,
            gpus=2,
            cpu=4,
            heartbeat_interval_s=0.2,
            gpu_free_mb=lambda: 4000,
        )

    g1, g2 = executor("ex-g1"), executor("ex-g2")
    running = asyncio.create_task(g1.run())  # run(): until stop()
    await g2.start()
    async with plan_events(settings) as events, work_writer(settings) as write:
        await events.wait_for(lambda evs: events.heartbeats("ex-g1"), "ex-g1's first heartbeat (it reads its topic)")
        for rs in out.values():
            await write(rs[0])
        await asyncio.wait_for(asyncio.gather(started["ex-g1"].wait(), started["ex-g2"].wait()), WAIT_S)
        key1 = f"{session}/plan-ex-g1/g/1"
        ad = await events.wait_for(
            lambda evs: next((h for h in events.heartbeats("ex-g1") if h["running"] == [key1]), None),
            "ex-g1 advertising its running attempt",
        )
        # budget 8000 MiB less 3000 held = 5000, capped by the 4000 the probe says are free
        assert (ad["free_gpu_memory_mb"], ad["free_gpus"], ad["free_cpu"]) == (4000, 1, 3)

        await g2.stop(abandon=True)
        stopping = asyncio.create_task(g1.stop())
        await events.wait_for(
            lambda evs: (
                events.heartbeats("ex-g2")[-1]["running"] == []
                and any(s["state"] == "FAILED" for s in events.statuses(f"{session}/plan-ex-g2/g/1"))
            ),
            "ex-g2's abandoned attempt and last heartbeat",
        )
        release_handler.set()
        await asyncio.wait_for(stopping, WAIT_S)
        await asyncio.wait_for(running, WAIT_S)  # run() returns once stopped
        await events.wait_for(lambda evs: events.heartbeats("ex-g1")[-1]["running"] == [], "ex-g1's last heartbeat")

    states = [s["state"] for s in events.statuses(key1)]
    assert states[0] == "RUNNING" and states[-1] == "SUCCEEDED" and set(states[1:-1]) <= {"HEARTBEAT"}, states
    assert events.statuses(key1)[-1]["output_ref"] == "finished"
    abandoned = events.statuses(f"{session}/plan-ex-g2/g/1")[-1]
    assert (abandoned["state"], abandoned["error_class"]) == ("FAILED", "abandoned")
    for eid in started:
        last = events.heartbeats(eid)[-1]
        assert (last["free_gpu_memory_mb"], last["free_gpus"], last["free_cpu"], last["running"]) == (0, 0, 0, [])


async def test_submit_plan_lands_on_plan_events_keyed_plans_and_a_cyclic_plan_is_refused_before_sending(
    settings: Settings,
) -> None:
    cyclic = [Subgoal(id="a", depends_on=["b"]), Subgoal(id="b", depends_on=["a"])]
    async with AgentStream(settings, agent_id="planner", episode_id="ep-9") as stream:
        with pytest.raises(PlanRefused, match=r"dependency cycle: a -> b -> a"):
            await stream.submit_plan("cyclic", cyclic)
        with pytest.raises(PlanRefused, match="depends on unknown subgoal 'zzz'"):
            await stream.submit_plan("unknown", [{"id": "a", "depends_on": ["zzz"]}])
        seq_before = stream.next_seq
        event_id = await stream.submit_plan(
            "ok", [Subgoal(id="a", tool="t", params={"x": 1}), Subgoal(id="b", agent="helper", depends_on=["a"])]
        )
        assert stream.next_seq == seq_before + 1
    with AgentStreamSync(settings, agent_id="planner-sync") as sync_stream:
        sync_stream.submit_plan("ok-sync", [Subgoal(id="only", tool="t")])
        with pytest.raises(PlanRefused, match="appears twice"):
            sync_stream.submit_plan("dup", [Subgoal(id="x"), Subgoal(id="x")])
    async with plan_events(settings) as events:
        mine = await events.wait_for(
            lambda evs: (
                [
                    e
                    for e in evs
                    if e.schema == PLAN_SUBMITTED
                    and e.record["plan_id"] in ("ok", "ok-sync")
                    and e.record["envelope"]["session_id"] in (stream.session_id, sync_stream.session_id)
                ]
                if sum(
                    e.schema == PLAN_SUBMITTED
                    and e.record["envelope"]["session_id"] in (stream.session_id, sync_stream.session_id)
                    for e in evs
                )
                >= 2
                else None
            ),
            "the two submitted plans",
        )
    assert sorted(e.record["plan_id"] for e in mine) == ["ok", "ok-sync"], "refused plans are not sent"
    assert all(e.key == KEY for e in mine)
    ok = next(e.record for e in mine if e.record["plan_id"] == "ok")
    env = ok["envelope"]
    assert (env["event_id"], env["logical_event_id"], env["episode_id"]) == (event_id, "ok", "ep-9")
    assert [s["subgoal_id"] for s in ok["subgoals"]] == ["a", "b"]
    assert ok["subgoals"][0]["params_json"] == '{"x":1}' and ok["subgoals"][1]["depends_on"] == ["a"]
    assert ok["subgoals"][1]["agent"] == "helper" and ok["subgoals"][0]["profile"] == {
        "gpu_memory_mb": 0,
        "gpus": 0,
        "cpu": 1,
    }
