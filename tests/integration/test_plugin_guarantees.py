"""What the worker guarantees a plugin, on the real broker, worker and chDB (issue 30): an event a plugin raises on
costs only itself and nothing it published is sent twice; a required reward source that nothing emits is warned
about (log + metric); the start log names the processors with their versions."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition

from sinks.sql_client import run_sql
from tests.factories import RawProducer, dispatch, result, scrape, total, wait_for
from tests.poison_plugin import MARK
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.ids import uuid7
from topics.settings import Settings

DISPATCH, RESULT = "treadle.events.ActionDispatched", "treadle.events.ToolResult"


def plugin_site(tmp_path: Path) -> Path:
    """A folder whose dist-info declares tests.poison_plugin:PublishesThenExplodes, as an installed plugin would look
    to importlib.metadata; the worker gets it on PYTHONPATH."""
    site = tmp_path / "site"
    info = site / "late_plugin-0.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: late-plugin\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(
        "[treadle.processors]\nexplodes_late = tests.poison_plugin:PublishesThenExplodes\n"
    )
    return site


async def send_session(settings: Settings, session: str) -> list[dict]:
    """Five steps on one session, the middle tool result marked; returns the tool results."""
    results = []
    async with RawProducer(settings) as producer:
        for step in range(5):
            lid = uuid7()
            await producer.send(DISPATCH, dispatch(session, lid, step, 2 * step + 1))
            record = result(session, lid, 2 * step + 2)
            record["output"] = f"{MARK} here" if step == 2 else f"fine {step}"
            await producer.send(RESULT, record)
            results.append(record)
        await producer.flush()
    return results


async def metric_records(settings: Settings) -> list[dict]:
    """Every record on the evaluation-metrics topic, duplicates included (the table would hide them)."""
    topic = TopicCatalog(settings)["evaluation_metrics"].name
    codec = AvroCodec()
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in range(settings.partitions)]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        records = []
        while True:
            positions = {tp: await consumer.position(tp) for tp in partitions}
            if all(positions[tp] >= end for tp, end in ends.items()):
                return records
            for batch in (await consumer.getmany(timeout_ms=1000)).values():
                records += [codec.decode(message.value)[1] for message in batch]
    finally:
        await consumer.stop()


def test_a_raising_plugin_costs_one_event_sends_nothing_twice_and_a_silent_required_source_is_warned(
    deployment: Settings, worker_factory, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"version": "needs-nobody", "specs": [
        {"source": "nobody_sends_this", "window_s": 2, "required": True}]}))  # fmt: skip
    settings = deployment.model_copy(update={"processors": ("steps", "explodes_late"), "reward_policy": policy})
    session = f"late-{uuid7()[-12:]}"
    results = asyncio.run(send_session(settings, session))  # before the worker starts: one batch
    worker = worker_factory(settings)
    worker.env = {"PYTHONPATH": str(plugin_site(tmp_path))}
    worker.start().wait_ready()
    good = [r for r in results if MARK not in r["output"]]

    def letters() -> list[tuple[str, str]]:
        return run_sql(settings, "SELECT stage, reason FROM dead_letters_latest")[1]

    [(stage, reason)] = wait_for(letters, 60, "the marked event's dead letter")
    assert stage == "PROCESS" and reason.startswith('processor explodes_late failed: RuntimeError("cannot judge')
    expected = {f"explodes_late:seen:any:{r['envelope']['event_id']}" for r in good}
    wait_for(lambda: len(run_sql(settings, "SELECT metric_id FROM evaluation_metrics_latest")[1]) == 4, 60, "4 rows")
    sent = Counter(r["metric_id"] for r in asyncio.run(metric_records(settings)))
    assert set(sent) == expected and set(sent.values()) == {1}, f"each good event's metric once on the topic: {sent}"

    samples = scrape(settings)
    assert total(samples, "treadle_processor_events_in_total", processor="explodes_late") >= 5
    assert total(samples, "treadle_isolated_failures_total", processor="explodes_late") == 1
    assert total(samples, "treadle_processor_records_out_total", processor="explodes_late") == 4
    # Sent before the worker started, the five came in one batch: the flags of the two before the mark were sent by
    # the failed attempt and skipped on the retry.
    assert total(samples, "treadle_processor_duplicates_skipped_total", processor="explodes_late") == 2
    assert total(samples, "treadle_processor_info", processor="explodes_late", version="0.3") == 1

    warning = "reward source 'nobody_sends_this' is required by reward policy 'needs-nobody' but has sent nothing"
    wait_for(lambda: warning in worker.log_tail(400), 30, "the silent-source warning", explain=worker.log_tail)
    assert total(scrape(settings), "treadle_required_source_silent", source="nobody_sends_this") == 1
    log = worker.log_tail(400)
    assert "processors enabled (TREADLE_PROCESSORS): steps (core, treadle " in log
    assert "explodes_late (evaluator, late-plugin 0.3)" in log
