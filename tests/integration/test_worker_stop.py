"""Stopping always works, and the sink child does not stay gone (issue 25, items 3 and 4). Real Kafka, chDB, worker."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from sinks.sql_client import run_sql
from streams.runtime.run_info import SqlEndpoint
from tests.factories import RawProducer, dispatch, result, wait_for
from tests.integration.test_poison_pills import plugin_path
from tests.poison_plugin import MARK
from topics.ids import uuid7
from topics.settings import Settings
from treadle.devstack.worker_process import WorkerProcess


async def send_step(settings: Settings, session: str, output: str = "fine") -> str:
    lid = uuid7()
    async with RawProducer(settings) as producer:
        await producer.send("treadle.events.ActionDispatched", dispatch(session, lid, 0, 1))
        tool_result = result(session, lid, 2)
        tool_result["output"] = output
        await producer.send("treadle.events.ToolResult", tool_result)
        await producer.flush()
    return lid


def test_sigterm_stops_a_worker_stuck_on_a_batch(deployment: Settings, tmp_path: Path) -> None:
    settings = deployment.model_copy(update={"processors": ("steps", "hangs"), "sink": "off"})
    worker = WorkerProcess(settings, settings.home / "worker.log", env={"PYTHONPATH": str(plugin_path(tmp_path))})
    worker.start().wait_ready()
    try:
        asyncio.run(send_step(settings, f"s-hang-{uuid7()[:8]}", output=f"{MARK} forever"))
        time.sleep(3)  # the batch reaches the plugin, which never returns
        assert worker.proc is not None and worker.proc.poll() is None
        started = time.monotonic()
        os.killpg(worker.proc.pid, signal.SIGTERM)
        worker.proc.wait(50)  # raises TimeoutExpired if SIGTERM is ignored
        took = time.monotonic() - started
    finally:
        worker.kill()
    assert took < 30, f"stopping took {took:.0f} s\n{worker.log_tail()}"


def test_the_worker_starts_its_sink_child_again_when_it_dies(deployment: Settings, worker_factory) -> None:
    worker = worker_factory(deployment).start()
    worker.wait_ready()
    first = SqlEndpoint.read(deployment)
    assert first is not None
    os.kill(first.pid, signal.SIGKILL)

    def restarted() -> bool:
        endpoint = SqlEndpoint.read(deployment)
        return endpoint is not None and endpoint.pid != first.pid

    wait_for(restarted, 90, "a new sink child serving SQL", explain=worker.log_tail)
    session = f"s-sink-{uuid7()[:8]}"
    lid = asyncio.run(send_step(deployment, session))
    query = f"SELECT logical_event_id FROM transitions_latest WHERE session_id = '{session}'"
    wait_for(
        lambda: run_sql(deployment, query)[1] == [[lid]], 90, "the step, via the new sink", explain=worker.log_tail
    )
    assert worker.proc is not None and worker.proc.poll() is None
    assert "starting it again" in worker.log_tail(300)


def test_a_sigterm_to_the_process_group_does_not_start_the_sink_child_again(
    deployment: Settings, tmp_path: Path
) -> None:
    """A terminal's signal reaches the sink child and the worker together; while the worker winds down (here slowly:
    a batch that never returns), its sink child must stay stopped."""
    settings = deployment.model_copy(update={"processors": ("steps", "hangs")})
    worker = WorkerProcess(settings, settings.home / "worker.log", env={"PYTHONPATH": str(plugin_path(tmp_path))})
    worker.start().wait_ready()
    try:
        first = SqlEndpoint.read(settings)
        assert first is not None and worker.proc is not None
        asyncio.run(send_step(settings, f"s-hang-{uuid7()[:8]}", output=f"{MARK} forever"))
        time.sleep(3)  # the batch reaches the plugin, which never returns: stopping waits for its deadline
        os.killpg(worker.proc.pid, signal.SIGTERM)
        worker.proc.wait(50)
    finally:
        worker.kill()
    log = worker.log_tail(300)
    assert "starting it again" not in log, log
    endpoint = SqlEndpoint.read(settings)
    assert endpoint is None or endpoint.pid == first.pid, "a new sink child was started while the worker stopped"
