"""Offset commits of the worker's fetch loop (ResumingApp): what a commit covers, and that the loop
starts one without waiting for it. The kill -9 and rebalance tests in test_pipeline.py run the same code against a
real broker; these pin the order of its steps, which a crash test only catches by chance."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from streams.runtime.faust_transport import ResumingConsumer


class CommitRecorder:
    """The parts of a ResumingConsumer its commit steps touch, recording what they were given."""

    def __init__(self, acked: dict[str, int], during_hooks: dict[str, int]) -> None:
        self.acked = acked
        self.committed: list[dict[str, int]] = []
        self.written_out_at: dict[str, int] | None = None

        async def before_commit() -> None:
            self.written_out_at = dict(self.acked)
            await asyncio.sleep(0)  # a hook awaits (producer room): input goes on meanwhile
            self.acked.update(during_hooks)  # a batch acked while the hook ran

        self.app = SimpleNamespace(_before_commit=before_commit)

    def _filter_committable_offsets(self, tps: Any) -> dict[str, int]:
        return dict(self.acked)

    async def _handle_attached(self, offsets: dict[str, int]) -> None:
        return None

    async def _commit_offsets(self, offsets: dict[str, int], start_new_transaction: bool = True) -> bool:
        self.committed.append(dict(offsets))
        return True


async def test_a_commit_covers_the_offsets_acked_before_its_write_out_not_those_acked_during_it() -> None:
    consumer = CommitRecorder({"inputs-0": 100, "inputs-1": 40}, during_hooks={"inputs-0": 250, "inputs-2": 7})
    assert await ResumingConsumer._commit_tps(consumer, ["inputs-0", "inputs-1"], True)  # type: ignore[arg-type]
    # The write-out saw everything acked up to 100/40; what was acked while it ran waits for the next commit.
    assert consumer.written_out_at == {"inputs-0": 100, "inputs-1": 40}
    assert consumer.committed == [{"inputs-0": 100, "inputs-1": 40}]


async def test_the_hooks_run_even_when_there_is_nothing_to_commit() -> None:
    consumer = CommitRecorder({}, during_hooks={"inputs-0": 3})
    assert not await ResumingConsumer._commit_tps(consumer, [], True)  # type: ignore[arg-type]
    assert consumer.written_out_at == {} and consumer.committed == []


class FetchLoop:
    """The parts of a ResumingConsumer `_commit_in_background` touches; `commit()` waits until released."""

    _background_commit = None
    _commit_crash = None
    _commit_fut = None

    def __init__(self, fail: BaseException | None = None) -> None:
        self._n_acked = 10_000
        self.started = 0
        self.release = asyncio.Event()
        self.fail = fail
        self.crashed: list[BaseException] = []

    async def commit(self) -> bool:
        self.started += 1
        await self.release.wait()
        if self.fail is not None:
            raise self.fail
        return True

    async def crash(self, exc: BaseException) -> None:
        self.crashed.append(exc)

    def _on_background_commit(self, task: asyncio.Future[Any]) -> None:
        ResumingConsumer._on_background_commit(self, task)  # type: ignore[arg-type]

    def start(self) -> None:
        ResumingConsumer._commit_in_background(self)  # type: ignore[arg-type]


async def test_the_fetch_loop_starts_one_commit_at_a_time_without_waiting_for_it() -> None:
    loop = FetchLoop()
    loop.start()
    await asyncio.sleep(0)
    assert loop.started == 1 and loop._n_acked == 0  # under way, and the loop went on
    loop._n_acked = 10_000
    loop.start()  # due again while the first still flushes: not a second one
    await asyncio.sleep(0)
    assert loop.started == 1 and loop._n_acked == 10_000
    loop.release.set()
    await asyncio.sleep(0)
    loop.start()
    await asyncio.sleep(0)
    assert loop.started == 2


async def test_a_commit_already_under_way_elsewhere_is_not_doubled() -> None:
    loop = FetchLoop()
    loop._commit_fut = asyncio.get_running_loop().create_future()  # Faust's commit timer is committing
    loop.start()
    await asyncio.sleep(0)
    assert loop.started == 0 and loop._n_acked == 10_000


async def test_a_failed_background_commit_crashes_the_worker() -> None:
    loop = FetchLoop(fail=RuntimeError("coordinator gone"))
    loop.start()
    loop.release.set()
    for _ in range(3):
        await asyncio.sleep(0)
    assert [str(exc) for exc in loop.crashed] == ["coordinator gone"]
