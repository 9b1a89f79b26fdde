"""A rebalance stuck behind an unacked batch says what every task awaits (streams/runtime/faust_transport.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from types import SimpleNamespace
from typing import Any

import pytest

from streams.runtime.faust_transport import ResumingConsumer, task_stacks


async def folding_a_batch(never: asyncio.Event) -> None:
    await never.wait()


async def stacks_while_parked(coro: Coroutine[Any, Any, None], name: str) -> str:
    """task_stacks() while a task named `name` runs `coro` and waits forever."""
    stuck = asyncio.create_task(coro, name=name)
    await asyncio.sleep(0)
    try:
        return task_stacks()
    finally:
        stuck.cancel()


async def test_task_stacks_show_where_each_task_awaits() -> None:
    text = await stacks_while_parked(folding_a_batch(asyncio.Event()), "fold-batch-7")
    assert "--- fold-batch-7: <coroutine object folding_a_batch" in text
    assert "await never.wait()" in text  # the line the task is parked on
    assert "test_task_stacks_show_where_each_task_awaits" in text  # the running task is listed too


async def parked_in_a_service(never: asyncio.Event) -> None:
    await folding_a_batch(never)


async def test_task_stacks_follow_the_awaits_to_the_innermost_coroutine() -> None:
    text = await stacks_while_parked(parked_in_a_service(asyncio.Event()), "service-3")
    listing = text.split("--- service-3:", 1)[1].split("\n--- ", 1)[0]
    assert "await folding_a_batch(never)" in listing and "await never.wait()" in listing
    assert "in wait" in listing and "await fut" in listing  # asyncio.Event.wait's own frame, innermost


async def test_a_long_wait_for_acks_is_reported_once_with_the_task_stacks(caplog: pytest.LogCaptureFixture) -> None:
    consumer = SimpleNamespace(_unacked_messages={"m1", "m2", "m3"})
    never = asyncio.Event()
    stuck = asyncio.create_task(folding_a_batch(never), name="fold-batch-8")
    try:
        with caplog.at_level(logging.WARNING, logger="streams.runtime.faust_transport"):
            await ResumingConsumer._report_stall(consumer, 0.01)  # type: ignore[arg-type]
    finally:
        stuck.cancel()
    [record] = caplog.records
    assert record.getMessage().startswith("waited 0 s for 3 handed-out input batches or messages to be acked")
    assert "fold-batch-8" in record.getMessage() and "await never.wait()" in record.getMessage()
