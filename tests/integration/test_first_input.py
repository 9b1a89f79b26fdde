"""FirstInput: a worker leaves when it read its first input record, where a benchmark's clock starts."""

from __future__ import annotations

import asyncio
import time

from streams.runtime.run_info import FirstInput
from tests.factories import RawProducer, dispatch, wait_for
from topics.ids import uuid7
from topics.settings import Settings


async def send_one(settings: Settings) -> None:
    async with RawProducer(settings) as producer:
        await producer.send("treadle.events.ActionDispatched", dispatch(f"s-first-{uuid7()[:8]}", uuid7(), 0, 1))
        await producer.flush()


def test_the_worker_marks_its_first_input_record_once_it_reads_it(deployment: Settings, worker_factory) -> None:
    worker = worker_factory(deployment).start()
    worker.wait_ready()
    assert FirstInput.read(deployment) is None, "no input yet, so no mark"
    sent_at = time.time()
    asyncio.run(send_one(deployment))
    first = wait_for(lambda: FirstInput.read(deployment), 60, "first-input.json", explain=worker.log_tail)
    assert first.pid == worker.pid
    assert first.read_at >= sent_at  # read after it was sent: the mark is the read, not the start
    assert first.cpu_s > 0
