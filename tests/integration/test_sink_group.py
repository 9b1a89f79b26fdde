"""One sink per embedded database: a second worker's sink in the same group is refused, and no row goes missing."""

from __future__ import annotations

import asyncio

from sinks.sql_client import run_sql
from tests.factories import RawProducer, dispatch, treadle, wait_for
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
