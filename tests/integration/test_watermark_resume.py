"""The resume case of docs/weaving-reference.md (W27) end to end: real broker, worker and topics.

After a silence longer than the idle timeout, one burst arrives on the three step topics, one topic after the other.
Before W27 the topic read first set the partition's watermark alone: with the rewards topic first, its newest event
time (20 s) moved the watermark past the judge window of step X (dispatched at 10 s, window 3 s), whose dispatch came
on the actions topic a moment later, so X was written `partial`; with the actions topic first, X stayed `pending`.
"""

from __future__ import annotations

import asyncio
import time

from aiokafka import AIOKafkaConsumer, TopicPartition

from tests.factories import RawProducer, dispatch, result, reward, wait_for
from tests.integration.test_weaving_pipeline import DISPATCH, RESULT, REWARD, weaving_settings
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.ids import uuid7
from topics.settings import Settings

S = 1_000_000
IDLE_S = 4.0
POLICY = {
    "version": "resume-1",
    "orphan_wait_s": 60,
    "specs": [{"source": "judge", "window_s": 3, "grace_s": 30, "required": True}],
}
OUTPUTS = ("transitions", "woven_rewards", "late_rewards")


async def published(settings: Settings, session: str) -> dict[str, list[tuple]]:
    """Per step (logical_event_id): every row of the session on the output topics, per topic in offset order."""
    catalog = TopicCatalog(settings)
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(catalog[kind].name, p) for kind in OUTPUTS for p in range(settings.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        codec, rows = AvroCodec(), {}
        while [tp for tp, end in ends.items() if await consumer.position(tp) < end]:
            for tp, messages in (await consumer.getmany(timeout_ms=500)).items():
                kind = catalog.by_name(tp.topic).kind
                for m in messages:
                    record = codec.decode(m.value)[1]
                    if record["session_id"] == session:
                        status = record.get("reward_status") or record.get("status") or record.get("reason")
                        rows.setdefault(record["logical_event_id"], []).append((kind, record["revision"], status))
        return {lid: sorted(r, key=lambda row: OUTPUTS.index(row[0])) for lid, r in rows.items()}  # stable sort
    finally:
        await consumer.stop()


async def send_in_topic_order(settings: Settings, by_topic: dict[str, list[tuple[str, dict]]], order: tuple) -> None:
    """Each topic's records, one topic after the other, a moment apart (well within the idle timeout)."""
    async with RawProducer(settings) as producer:
        for topic in order:
            for name, record in by_topic[topic]:
                await producer.send(name, record)
            await producer.flush()
            await asyncio.sleep(0.4)


def run_after_a_silence(settings: Settings, order: tuple[str, ...]) -> dict[str, list[tuple]]:
    """Warm the session's partition up on all three topics, stay silent past the idle timeout, then send the burst
    in `order`; the rows of steps X and Y, named x and y."""
    session = f"resume-{uuid7()[-10:]}"
    base = int(time.time() * S) + 600 * S  # ahead of the processing-time watermark a silence leaves

    def at(record: dict, seconds: float) -> dict:
        record["envelope"]["event_time"] = base + int(seconds * S)
        return record

    warm, x, y = uuid7(), uuid7(), uuid7()
    warm_up = [(DISPATCH, at(dispatch(session, warm, 0, 1), 0)), (RESULT, at(result(session, warm, 2), 0.2)),
               (REWARD, at(reward(session, warm, 3, 0.5, "judge"), 0.5))]  # fmt: skip
    asyncio.run(send_in_topic_order(settings, {"all": warm_up}, ("all",)))
    wait_for(lambda: warm in asyncio.run(published(settings, session)), 60, "the warm-up step's rows")
    time.sleep(IDLE_S + 1.5)  # a silence: every topic of the partition idles
    burst = {
        "actions": [(DISPATCH, at(dispatch(session, y, 1, 4), 9.5)), (DISPATCH, at(dispatch(session, x, 2, 6), 10))],
        "tool_results": [(RESULT, at(result(session, y, 5), 9.7)), (RESULT, at(result(session, x, 7), 10.2))],
        "rewards": [(REWARD, at(reward(session, y, 8, 1.0, "judge"), 20))],  # in Y's grace; X's judge never comes
    }
    asyncio.run(send_in_topic_order(settings, burst, order))

    def settled() -> dict | None:
        rows = asyncio.run(published(settings, session))
        return rows if x in rows and ("woven_rewards", 1, "complete") in rows.get(y, []) else None

    wait_for(settled, 60, "rows for both steps of the burst")
    time.sleep(IDLE_S + 1.5)  # every hold and idle period is over: whatever else would come has come
    rows = asyncio.run(published(settings, session))
    return {"x": rows[x], "y": rows[y]}


def test_W27_after_a_silence_the_burst_gives_the_same_rows_in_any_topic_order(
    deployment: Settings, worker_factory, tmp_path
) -> None:
    settings_ = weaving_settings(deployment, tmp_path, POLICY).model_copy(
        update={"idle_timeout_s": IDLE_S, "catch_up_backlog": 0}
    )
    worker = worker_factory(settings_).start()
    worker.wait_ready()
    rewards_first = run_after_a_silence(settings_, ("rewards", "tool_results", "actions"))
    actions_first = run_after_a_silence(settings_, ("actions", "tool_results", "rewards"))
    worker.stop()
    # X: dispatch + result, its judge window (13 s) not passed by the burst's watermark (min over the topics - 1 s)
    assert rewards_first["x"] == actions_first["x"] == [("transitions", 2, "pending")]
    # Y: complete at once, with no pending row first
    complete = [("transitions", 4, "complete"), ("woven_rewards", 1, "complete")]
    assert rewards_first["y"] == actions_first["y"] == complete
