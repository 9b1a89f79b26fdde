"""After a workload, the worker's /metrics has the counters the workload implies, with exact values."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from aiokafka import AIOKafkaConsumer, TopicPartition
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest

from streams.runtime.metrics import JOIN_LATENCY_BUCKETS, METRIC_FAMILIES, GpuMetrics, SinkMetrics, WorkerMetrics
from tests.factories import KIND_OF, RawProducer, scrape, total, wait_for
from tests.integration.test_pipeline import REWARD, complete, make_workload, produce, revision_diff
from topics.catalog import TopicCatalog
from topics.settings import Settings

GARBAGE = b"\x00\x01 not avro"


async def records_on(settings: Settings, kind: str) -> int:
    """Records on a topic: the worker is its only producer, so this is what it sent."""
    topic = TopicCatalog(settings)[kind].name
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(settings.partitions)]
        ends = await consumer.end_offsets(tps)
        starts = await consumer.beginning_offsets(tps)
        return sum(ends[tp] - starts[tp] for tp in tps)
    finally:
        await consumer.stop()


async def send_garbage(settings: Settings) -> None:
    async with RawProducer(settings) as producer:
        await producer.send_bytes("actions", GARBAGE)
        await producer.flush()


def test_metrics_after_a_workload(deployment: Settings, worker_factory) -> None:
    expected = make_workload(random.Random(5), sessions=4, steps=5)
    events = [e for step in expected for e in step.events]
    # Young collections every 700 allocations, CPython's default, so this small workload has some to count (the
    # default waits for 100,000).
    worker = worker_factory(deployment.model_copy(update={"gc_thresholds": (700, 10, 100)})).start()
    worker.wait_ready()
    asyncio.run(produce(deployment, events))
    asyncio.run(send_garbage(deployment))
    wait_for(
        complete(deployment, expected),
        90,
        "all transitions",
        explain=lambda: revision_diff(deployment, expected, worker),
    )

    catalog = TopicCatalog(deployment)
    sent = Counter((catalog[KIND_OF[name]].name, name) for name, _ in events)
    distinct_rewards = {r["envelope"]["event_id"] for name, r in events if name == REWARD}

    def settled() -> dict | None:
        samples = scrape(deployment)
        raw_rows = total(samples, "treadle_sink_batch_rows_sum", table="raw_events")
        # Watermark lag and open steps are set by the window timer (every TREADLE_WINDOW_TICK_S), which may
        # not have run since the last batch.
        ticked = any(n == "treadle_watermark_lag_seconds" for n, _ in samples)
        return samples if raw_rows == len(events) and ticked else None

    samples = wait_for(settled, 60, "the sink's raw_events inserts in /metrics")
    for (topic, schema), n in sent.items():
        assert total(samples, "treadle_events_in_total", topic=topic, type=schema) == n, (topic, schema)
    actions = catalog["actions"].name
    assert total(samples, "treadle_events_in_total", topic=actions, type="unknown") == 1  # the garbage
    assert total(samples, "treadle_dead_letters_total", stage="DECODE", schema="unknown") == 1
    dead_letters = catalog["dead_letters"].name
    assert total(samples, "treadle_events_out_total", topic=dead_letters) == 1
    transitions = catalog["transitions"].name
    assert total(samples, "treadle_events_out_total", topic=transitions) == asyncio.run(
        records_on(deployment, "transitions")
    )
    assert total(samples, "treadle_reward_join_latency_seconds_count") == len(distinct_rewards)
    assert total(samples, "treadle_producer_errors_total") == 0
    lags = {dict(ls)["topic"]: v for (n, ls), v in samples.items() if n == "treadle_consumer_lag"
            and dict(ls)["group"] == deployment.app_id}  # fmt: skip
    assert set(lags) >= {actions, catalog["rewards"].name} and not any(lags.values())
    watermark_lags = [v for (n, _), v in samples.items() if n == "treadle_watermark_lag_seconds"]
    assert watermark_lags and all(lag > 0 for lag in watermark_lags)  # the workload's event times are in 2025
    assert total(samples, "treadle_open_steps") == 0  # the default policy requires no source
    rocksdb = {dict(ls)["kind"]: v for (n, ls), v in samples.items() if n == "treadle_rocksdb_memory_bytes"}
    assert rocksdb["limit"] == deployment.table_memory_mb * 2**20
    assert 0 < rocksdb["memtables"] <= rocksdb["cache"] <= rocksdb["limit"]  # the steps written, charged to the cache
    assert total(samples, "treadle_sink_batch_rows_count", table="transitions") >= 1
    assert total(samples, "treadle_sink_batch_seconds_count", table="transitions") >= 1
    for family in ("treadle_gc_seconds_total", "treadle_sink_gc_seconds_total"):  # each watched in its own process
        assert total(samples, family, generation="0") > 0, family


def test_registries_are_separate_and_families_match_the_catalogue() -> None:
    """Two workers in one process never share series; every declared family is registered by someone."""
    a, b = WorkerMetrics(), WorkerMetrics()
    a.events_in.labels("t", "x").inc()
    assert b"treadle_events_in_total{" not in b.exposition()
    sink = SinkMetrics()
    GpuMetrics(sink.registry)
    names = set()
    for registry in (a.registry, sink.registry):
        for family in registry.collect():
            suffix = "_total" if family.type == "counter" else ""
            names.add(family.name + suffix)
    assert names == set(METRIC_FAMILIES)


@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), max_size=50))
def test_the_lock_free_join_histogram_exposes_what_prometheus_clients_histogram_would(values: list[float]) -> None:
    registry = CollectorRegistry()
    reference = Histogram("treadle_reward_join_latency_seconds", "x", buckets=JOIN_LATENCY_BUCKETS, registry=registry)
    metrics = WorkerMetrics()
    for value in values:
        reference.observe(value)
        metrics.reward_join_latency.observe(value)

    def samples(page: bytes) -> list[str]:
        name = "treadle_reward_join_latency_seconds_"
        return [line for line in page.decode().splitlines() if line.startswith(name) and "_created" not in line]

    assert samples(metrics.exposition()) == samples(generate_latest(registry))
