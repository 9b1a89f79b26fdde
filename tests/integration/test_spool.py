"""The producer spool on a real broker: stopped for 30 s under a running agent, and a restart with a full spool.

A broker of the test's own (SecondBroker, on free ports) is stopped and started again; the session broker is never
touched. What the pipeline sees is checked by reading the topics back: every event of every session there, a
session's events in seq order in each topic (a resent event may come again later: the pipeline ignores a duplicate
event_id).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from streams.sdk.spool import Spool
from tests.integration.test_sdk import Read, SecondBroker, create_topics, make_settings, read_back
from topics.codec import AvroCodec
from topics.settings import Settings
from treadle import AgentStream

OUTAGE_S = 30.0


@pytest.fixture(scope="module")
def codec() -> AvroCodec:
    return AvroCodec()


def spooled_settings(bootstrap: str, tmp: Path) -> Settings:
    return make_settings(bootstrap, tmp / "home").model_copy(update={"spool_dir": tmp / "spool", "spool_after_s": 1.0})


def check_nothing_lost_and_in_order(reads: dict[str, list[Read]], emitted: dict[str, int]) -> int:
    """Every seq of every session arrived; per session and topic, first arrivals in seq order. The duplicates."""
    duplicates = 0
    for session_id, count in emitted.items():
        seen: set[int] = set()
        for rs in reads.values():
            firsts, where = [], []
            for r in rs:
                if r.env["session_id"] != session_id:
                    continue
                if r.env["seq"] in seen:
                    duplicates += 1
                    continue
                seen.add(r.env["seq"])
                firsts.append(r.env["seq"])
                where.append((r.env["seq"], r.partition, r.offset))
            assert firsts == sorted(firsts), f"session {session_id} out of order in one topic: {where[:30]}"
        assert seen == set(range(count)), f"session {session_id} lost seqs {sorted(set(range(count)) - seen)}"
    return duplicates


async def agent(stream: AgentStream, stop: asyncio.Event) -> None:
    while not stop.is_set():
        step = await stream.dispatch("search", {"q": "red shoes"})
        async with stream.tool_call(step) as call:
            call.output = "3 results"
        await stream.reward(step, 0.5, source="code")
        await asyncio.sleep(0.05)


async def test_brokers_down_for_30_s_during_an_agent_run_lose_nothing(tmp_path: Path, codec: AvroCodec) -> None:
    broker = SecondBroker(tmp_path / "kafka")
    await asyncio.to_thread(broker.start)
    try:
        s = spooled_settings(broker.bootstrap, tmp_path)
        await create_topics(s)
        streams = [AgentStream(s, agent_id="spooler", codec=codec) for _ in range(3)]
        for stream in streams:
            await stream.start()
        assert sorted(stream._spool.directory.name for stream in streams) == ["spooler-0", "spooler-1", "spooler-2"]
        stop = asyncio.Event()
        agents = [asyncio.create_task(agent(stream, stop)) for stream in streams]
        await asyncio.sleep(3)

        down = time.monotonic()
        await asyncio.to_thread(broker.stop)
        deepest = 0
        while time.monotonic() - down < OUTAGE_S:  # the agents keep going: no call blocks, nothing raises
            await asyncio.sleep(0.5)
            assert not any(task.done() for task in agents), [task.exception() for task in agents if task.done()]
            deepest = max(deepest, sum(stream.spool_depth for stream in streams))
        assert all(stream.spooling for stream in streams)
        await asyncio.to_thread(broker.start)
        await asyncio.sleep(5)
        stop.set()
        await asyncio.gather(*agents)

        for stream in streams:
            await stream.flush(timeout=120)
            assert (stream.spool_depth, stream.spooling, stream.pending) == (0, False, 0)
        emitted = {stream.session_id: stream.next_seq for stream in streams}
        for stream in streams:
            await stream.close()
        assert deepest > 3 * 100, f"the spool held at most {deepest} events"  # ~30 s of 3 agents at ~50 events/s
        reads = await read_back(s, codec, set(emitted))
        check_nothing_lost_and_in_order(reads, emitted)
        assert sum(emitted.values()) > 3 * 300
    finally:
        await asyncio.to_thread(broker.stop)


async def test_a_restart_resends_a_non_empty_spool(tmp_path: Path, codec: AvroCodec) -> None:
    broker = SecondBroker(tmp_path / "kafka")
    await asyncio.to_thread(broker.start)
    try:
        s = spooled_settings(broker.bootstrap, tmp_path)
        await create_topics(s)
        before = AgentStream(s, agent_id="restarted", codec=codec)
        await before.start()
        first = await before.dispatch("search", {"q": "before the outage"})
        await before.flush()
        await asyncio.to_thread(broker.stop)

        steps = [await before.dispatch("search", {"q": f"during {i}"}) for i in range(5)]
        await asyncio.sleep(1.5)  # past spool_after_s: the next call spools the unacknowledged events
        steps += [await before.dispatch("search", {"q": f"during {i}"}) for i in range(5, 10)]
        assert before.spooling and before.spool_depth == 10
        await before.close(timeout=1)  # the process ends with the brokers still down
        spool_dir = s.spool_dir / "restarted-0"
        left = Spool(spool_dir, s.spool_max_bytes)
        assert left.depth == 10
        left.close()

        await asyncio.to_thread(broker.start)
        after = AgentStream(s, agent_id="restarted", codec=codec)  # a new process of the same agent
        await after.start()
        assert after._spool is not None and after._spool.directory == spool_dir
        later = await after.dispatch("search", {"q": "after the restart"})  # queued behind the resent ones
        await after.flush(timeout=120)
        assert (after.spool_depth, after.spooling) == (0, False)
        await after.close()

        reads = await read_back(s, codec, {before.session_id, after.session_id})
        got = [r.env["logical_event_id"] for r in reads["actions"]]
        resent = [first.logical_event_id] + [step.logical_event_id for step in steps]
        assert [lid for lid in got if lid in set(resent)] == resent  # all ten, once each, in order
        assert later.logical_event_id in got
    finally:
        await asyncio.to_thread(broker.stop)
