"""An output the broker refuses costs that output, never the partition (issue 25): real Kafka, worker and chDB.

The transitions topic is told to take smaller records (max.message.bytes, through the admin API) while a worker
runs, as an operator or a cluster policy may. A step whose transition is then too large is refused by the broker
(MESSAGE_TOO_LARGE, not retriable); the batch it was in is sent again one record at a time, so the small transitions
beside it arrive, the refused one becomes a PROCESS dead letter with the reason, and the worker keeps running and
still stops on SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import string

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from sinks.sql_client import run_sql
from tests.factories import RawProducer, dispatch, result, scrape, total, wait_for
from topics.catalog import TopicCatalog
from topics.ids import uuid7
from topics.settings import Settings

DISPATCH, RESULT = "treadle.events.ActionDispatched", "treadle.events.ToolResult"
TOPIC_LIMIT = 20_000  # bytes; a transition carrying a 60 KB incompressible output is above it even with zstd


async def shrink_topic(settings: Settings, kind: str, limit: int) -> str:
    name = TopicCatalog(settings)[kind].name
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers)
    await admin.start()
    try:
        await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, name, {"max.message.bytes": str(limit)})])
    finally:
        await admin.close()
    return name


def noise(rng: random.Random, size: int) -> str:
    return "".join(rng.choices(string.ascii_letters + string.digits, k=size))


async def send_steps(settings: Settings, session: str, outputs: list[str]) -> list[str]:
    lids = []
    async with RawProducer(settings) as producer:
        for n, output in enumerate(outputs):
            lid = uuid7()
            lids.append(lid)
            await producer.send(DISPATCH, dispatch(session, lid, n, 2 * n + 1))
            await producer.send(RESULT, {**result(session, lid, 2 * n + 2), "output": output})
        await producer.flush()
    return lids


def test_a_transition_the_broker_refuses_is_a_dead_letter_and_the_rest_arrive(
    deployment: Settings, worker_factory
) -> None:
    rng = random.Random(5)
    worker = worker_factory(deployment).start()
    worker.wait_ready()
    # A warm-up step lands first, so the limit changes under a worker that is already producing.
    warm_session = f"warm-{uuid7()[-8:]}"
    [warm] = asyncio.run(send_steps(deployment, warm_session, ["warm"]))
    wait_for(
        lambda: run_sql(deployment, f"SELECT 1 FROM transitions_latest WHERE logical_event_id = '{warm}'")[1],
        120, "the warm-up transition", explain=worker.log_tail,
    )  # fmt: skip
    topic = asyncio.run(shrink_topic(deployment, "transitions", TOPIC_LIMIT))

    session = f"refused-{uuid7()[-8:]}"
    big = {3, 7}
    outputs = [noise(rng, 60_000) if n in big else f"small {n}" for n in range(10)]
    # The broker applies a config change a moment after the controller took it: send until a step is refused.
    lids: list[str] = []
    for _ in range(20):
        lids = asyncio.run(send_steps(deployment, session, outputs))
        probe = f"SELECT 1 FROM transitions_latest WHERE logical_event_id = '{lids[3]}'"
        refused = wait_for(
            lambda probe=probe: total(scrape(deployment), "treadle_refused_outputs_total") >= len(big)
            or run_sql(deployment, probe)[1],
            120, "the big transitions refused or written", explain=worker.log_tail,
        )  # fmt: skip
        if refused is True:
            break
        session = f"refused-{uuid7()[-8:]}"
    else:
        raise AssertionError(f"the broker never refused a large transition on {topic}")

    def letters() -> list[dict] | None:
        columns, rows = run_sql(
            deployment,
            "SELECT stage, reason, schema_name, topic, length(value) AS kept FROM dead_letters_latest "
            f"WHERE session_id = '{session}'",
        )
        found = [dict(zip(columns, row, strict=True)) for row in rows]
        return found if len(found) >= len(big) else None

    found = wait_for(letters, 120, "a dead letter per refused transition", explain=worker.log_tail)
    assert len(found) == len(big), found
    for letter in found:
        assert (letter["stage"], letter["schema_name"], letter["topic"]) == (
            "PROCESS", "treadle.derived.Transition", topic,
        )  # fmt: skip
        assert letter["reason"].startswith(f"publish refused: {topic}[")
        assert "MessageSizeTooLargeError" in letter["reason"]
        assert letter["kept"] > 60_000, "the refused record's bytes are kept"

    def small_transitions() -> dict | None:
        _, rows = run_sql(
            deployment,
            f"SELECT logical_event_id, output FROM transitions_latest WHERE session_id = '{session}'",
        )
        got = dict((lid, output) for lid, output in rows)
        want = {lid: outputs[n] for n, lid in enumerate(lids) if n not in big}
        return got if got == want else None

    wait_for(small_transitions, 120, "every small transition", explain=worker.log_tail)
    assert worker.proc is not None and worker.proc.poll() is None, "the worker must still run"
    assert total(scrape(deployment), "treadle_refused_outputs_total") >= len(big)

    os.killpg(worker.proc.pid, signal.SIGTERM)
    assert worker.proc.wait(90) is not None  # stopping works: no hang on the refused batches
