"""Topics read in batches of their own (ResumingApp.read_in_batches; the contracts processor's StateVersions): the
fetch loop hands a batch over and goes on reading, one batch of each topic is handled at a time and in order, a
failed batch stops the loop at the next hand-over, and a batch read across a rebalance is read again instead. The
contracts pipeline and kill -9 tests run the same path against a real broker; these pin its order of steps."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from streams.runtime.faust_transport import ResumingConsumer


class FetchLoop:
    """The parts of a ResumingConsumer that ResumingConsumer._hand_over_side touches, recording what happens."""

    def __init__(self) -> None:
        self._side_batches: dict[str, asyncio.Future[None]] = {}
        self._unacked_messages: set[Any] = set()
        self.revocations = 0
        self.acked: list[list[int]] = []
        self.read_again: list[list[int]] = []
        self.crashed: list[BaseException] = []

    _on_side_done = ResumingConsumer._on_side_done
    _in_flight = ResumingConsumer._in_flight

    async def crash(self, reason: BaseException) -> None:
        self.crashed.append(reason)

    def _may_deliver(self, revocations: int) -> bool:
        return revocations == self.revocations

    async def _read_again(self, batch: list[int]) -> None:
        self.read_again.append(batch)

    async def _deliver(self, handle: Any, batch: list[int]) -> None:
        await handle(batch)
        self._unacked_messages.discard(batch[0])
        self.acked.append(batch)

    async def hand_over(self, handle: Any, batch: list[int], topic: str = "versions") -> None:
        await ResumingConsumer._hand_over_side(self, topic, handle, batch, self.revocations)  # type: ignore[arg-type]


async def test_batches_are_handled_beside_the_fetch_loop_one_at_a_time_and_in_order() -> None:
    loop, events, release = FetchLoop(), [], asyncio.Event()

    async def handle(batch: list[int]) -> None:
        events.append(("start", batch[0]))
        await release.wait()
        events.append(("end", batch[0]))

    await loop.hand_over(handle, [1, 2])
    assert loop._unacked_messages == {1}  # in flight: a rebalance waits for it
    await asyncio.sleep(0)
    assert events == [("start", 1)] and loop.acked == []  # handed over; the fetch loop was not held

    second = asyncio.ensure_future(loop.hand_over(handle, [3]))
    await asyncio.sleep(0.01)
    assert not second.done() and events == [("start", 1)]  # the next batch waits for the one before it
    release.set()
    await second
    await loop._side_batches["versions"]
    assert events == [("start", 1), ("end", 1), ("start", 3), ("end", 3)]
    assert loop.acked == [[1, 2], [3]] and loop._unacked_messages == set()


async def test_two_topics_are_handled_side_by_side() -> None:
    loop, running = FetchLoop(), set()
    both = asyncio.Event()

    async def handle(batch: list[int]) -> None:
        running.add(batch[0])
        if len(running) == 2:
            both.set()
        await asyncio.wait_for(both.wait(), 5)

    await loop.hand_over(handle, [1], topic="a")
    await loop.hand_over(handle, [2], topic="b")
    await asyncio.gather(loop._side_batches["a"], loop._side_batches["b"])
    assert sorted(loop.acked) == [[1], [2]]


async def test_a_failed_batch_is_not_acked_stops_the_worker_and_the_fetch_loop_at_the_next_hand_over() -> None:
    loop = FetchLoop()

    async def handle(batch: list[int]) -> None:
        if batch[0] == 1:
            raise RuntimeError("fold failed")

    await loop.hand_over(handle, [1])
    await asyncio.sleep(0.01)
    assert [str(exc) for exc in loop.crashed] == ["fold failed"]
    with pytest.raises(RuntimeError, match="fold failed"):
        await loop.hand_over(handle, [2])
    assert loop.acked == []


async def test_a_batch_read_across_a_rebalance_is_read_again_not_handled() -> None:
    loop, handled = FetchLoop(), []

    async def handle(batch: list[int]) -> None:
        handled.append(batch)

    read_at = loop.revocations
    loop.revocations += 1  # a rebalance began after the read
    await ResumingConsumer._hand_over_side(loop, "versions", handle, [7, 8], read_at)  # type: ignore[arg-type]
    assert loop.read_again == [[7, 8]] and handled == [] and loop._unacked_messages == set()
