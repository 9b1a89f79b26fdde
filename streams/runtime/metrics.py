"""Prometheus metrics of a worker and of its sink, each in a registry of its own.

No process-global registry: two workers in one test process, or a worker and its sink, never share
series. The worker serves its registry at `/metrics` on TREADLE_WEB_PORT and appends its sink
child's (fetched from the sink's `/metrics`), so one scrape per worker sees the whole pipeline.

Label values are bounded: topics, schema names, stages, sources and partitions, never free text.
"""

from __future__ import annotations

import gc
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# Every family, with its Prometheus type, as exposed; deploy/grafana's dashboard and tests use this list.
METRIC_FAMILIES: dict[str, str] = {
    "treadle_events_in_total": "counter",
    "treadle_events_out_total": "counter",
    "treadle_dead_letters_total": "counter",
    "treadle_late_rewards_total": "counter",
    "treadle_open_steps": "gauge",
    "treadle_expired_steps_total": "counter",
    "treadle_watermark_lag_seconds": "gauge",
    "treadle_rocksdb_memory_bytes": "gauge",
    "treadle_gc_seconds_total": "counter",
    "treadle_reward_join_latency_seconds": "histogram",
    "treadle_sink_batch_rows": "histogram",
    "treadle_sink_batch_seconds": "histogram",
    "treadle_sink_gc_seconds_total": "counter",
    "treadle_consumer_lag": "gauge",
    "treadle_producer_errors_total": "counter",
    "treadle_isolated_failures_total": "counter",
    "treadle_refused_outputs_total": "counter",
    "treadle_state_limit_refusals_total": "counter",
    "treadle_state_flushes_total": "counter",
    "treadle_state_waiting_sessions": "gauge",
    "treadle_processor_info": "gauge",
    "treadle_processor_events_in_total": "counter",
    "treadle_processor_records_out_total": "counter",
    "treadle_processor_seconds_total": "counter",
    "treadle_processor_duplicates_skipped_total": "counter",
    "treadle_required_source_silent": "gauge",
    "treadle_outputs_truncated_total": "counter",
    "treadle_sink_rejected_rows_total": "counter",
    "treadle_gpu_utilization_ratio": "gauge",
    "treadle_gpu_memory_used_bytes": "gauge",
    "treadle_gpu_power_watts": "gauge",
}

# Rewards land from milliseconds (LLM judge) to a day (human label) after their step.
JOIN_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600, float("inf"))
BATCH_ROW_BUCKETS = (1, 10, 50, 100, 500, 1000, 2500, 5000, 10000, 50000, float("inf"))
BATCH_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, float("inf"))

CONTENT_TYPE = CONTENT_TYPE_LATEST


def _consumer_lag(registry: CollectorRegistry) -> Gauge:
    return Gauge(
        "treadle_consumer_lag",
        "Messages between a consumer group's processed position and the partition's end offset.",
        ["group", "topic", "partition"],
        registry=registry,
    )


class LoopHistogram(Collector):
    """A histogram observed from one thread only (the worker's event loop): plain counters, no lock.

    prometheus_client's Histogram takes a lock for the sum and again for the bucket on every observation; the
    worker observes the join latency of every reward it joins, and those locks were ~3% of its CPU (py-spy, the
    weaving bench). A scrape reads the counters between two observations, never in the middle of one.
    """

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self._bounds = [float(b) for b in buckets]
        if self._bounds[-1] != float("inf"):
            self._bounds.append(float("inf"))
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1  # the first bucket with value <= its bound
        self._sum += value

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation)
        cumulative, buckets = 0, []
        for bound, count in zip(self._bounds, self._counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric([], buckets, self._sum)
        yield family


class RocksDBMemoryGauge(Collector):
    """treadle_rocksdb_memory_bytes: the worker's RocksDB memory, read from RocksDB when scraped.

    A worker's RSS is mostly its Python heap and its tables' RocksDB memory (one budget, TREADLE_TABLE_MEMORY_MB;
    streams/runtime/rocksdb_memory.py); this shows how full the budget is, so RSS growth can be told apart from a leak.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._read: Callable[[], Mapping[str, int]] = dict
        registry.register(self)

    def watch(self, read: Callable[[], Mapping[str, int]]) -> None:
        """`read()` -> bytes by kind (cache, memtables, limit)."""
        self._read = read

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "treadle_rocksdb_memory_bytes",
            "RocksDB memory of the worker's tables: cache (data blocks and the memtables charged to "
            "it), memtables, limit (TREADLE_TABLE_MEMORY_MB).",
            labels=["kind"],
        )
        for kind, value in self._read().items():
            family.add_metric([kind], value)
        yield family


class CollectorPauses(Collector):
    """<name>: seconds this process spent in CPython's cycle collector, by generation.

    Counted only once `watch()` hooks gc.callbacks (in the worker's and the sink's own process); its rate is
    the share of a core the collector takes, the number to look at when tuning TREADLE_GC_THRESHOLDS.
    """

    def __init__(self, name: str, registry: CollectorRegistry) -> None:
        self.name = name
        self.seconds = [0.0, 0.0, 0.0]
        self._started = 0.0
        registry.register(self)

    def watch(self) -> None:
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: Mapping[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._started

    def collect(self) -> Iterator[Metric]:
        documentation = "Seconds in CPython's cycle collector, by generation (2: full collections)."
        family = CounterMetricFamily(self.name, documentation, labels=["generation"])
        for generation, seconds in enumerate(self.seconds):
            family.add_metric([str(generation)], seconds)
        yield family


@dataclass
class WorkerMetrics:
    """What the Faust worker counts: events in and out, dead letters, reward joins, lag."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.events_in = Counter(
            "treadle_events_in", "Input events read, by topic and Avro record type.", ["topic", "type"], registry=r
        )
        self.events_out = Counter(
            "treadle_events_out", "Records produced, by topic and Avro record type.", ["topic", "type"], registry=r
        )
        self.dead_letters = Counter(
            "treadle_dead_letters",
            "Inputs sent to dead letters, by stage (DECODE, SCHEMA, VALIDATE, PROCESS) and record type.",
            ["stage", "schema"],
            registry=r,
        )
        self.late_rewards = Counter(
            "treadle_late_rewards", "Rewards that arrived after their step's grace period, by source.", ["source"],
            registry=r,
        )  # fmt: skip
        self.open_steps = Gauge(
            "treadle_open_steps", "Steps waiting for the watermark to pass a required reward window.", registry=r
        )
        self.expired_steps = Counter(
            "treadle_expired_steps",
            "Step states deleted TREADLE_STEP_RETENTION_S after no reward could be woven into them any more.",
            registry=r,
        )
        self.watermark_lag = Gauge(
            "treadle_watermark_lag_seconds",
            "Processing time minus the event-time watermark, per input partition.",
            ["partition"],
            registry=r,
        )
        self.reward_join_latency = LoopHistogram(
            "treadle_reward_join_latency_seconds",
            "From a step's dispatch (event time) to a reward joined to it (processing time).",
            JOIN_LATENCY_BUCKETS,
            r,
        )
        self.consumer_lag = _consumer_lag(r)
        self.producer_errors = Counter(
            "treadle_producer_errors", "Records the producer could not deliver, by topic.", ["topic"], registry=r
        )
        self.refused_outputs = Counter(
            "treadle_refused_outputs",
            "Output records the broker refused when sent alone (e.g. above the topic's max.message.bytes): each is a "
            "PROCESS dead letter (a refused dead letter is only counted), by the topic that refused it.",
            ["topic"],
            registry=r,
        )
        self.state_limit_refusals = Counter(
            "treadle_state_limit_refusals",
            "Input events refused because they would take a per-key table value (a step, a session's state graph, an "
            "episode, a judged step) past its size limit; each is a PROCESS dead letter, by processor.",
            ["processor"],
            registry=r,
        )
        self.state_flushes = Counter(
            "treadle_state_flushes",
            "Sessions whose state reorder buffer was applied before every state topic passed its seq: after the "
            "short wait (TREADLE_STATE_IDLE_FLUSH_S, the worker had folded what was in Kafka) or the long one "
            "(TREADLE_STATE_IDLE_FLUSH_MAX_S, the worker lagged), by wait.",
            ["wait"],
            registry=r,
        )
        self.state_waiting = Gauge(
            "treadle_state_waiting_sessions",
            "Sessions whose state reorder buffer holds events not applied yet, at the last sweep: a session's latest "
            "events wait until every state topic passed their seq or TREADLE_STATE_IDLE_FLUSH_S.",
            registry=r,
        )
        self.isolated_failures = Counter(
            "treadle_isolated_failures",
            "Input records whose processing raised and cost only themselves (a PROCESS dead letter), by processor.",
            ["processor"],
            registry=r,
        )
        self.processor_info = Gauge(
            "treadle_processor_info",
            "1 per processor this worker runs, with its kind and the version of the distribution that provides it.",
            ["processor", "kind", "version"],
            registry=r,
        )
        self.processor_events_in = Counter(
            "treadle_processor_events_in", "Input events handed to a processor, by processor.", ["processor"],
            registry=r,
        )  # fmt: skip
        self.processor_records_out = Counter(
            "treadle_processor_records_out",
            "Records a processor published from its batches (reward signals, metrics, rows), by processor and type.",
            ["processor", "type"],
            registry=r,
        )
        self.processor_seconds = Counter(
            "treadle_processor_seconds",
            "Seconds in a processor's process(), retries included; over treadle_processor_events_in_total it is the "
            "seconds per event.",
            ["processor"],
            registry=r,
        )
        self.processor_duplicates_skipped = Counter(
            "treadle_processor_duplicates_skipped",
            "Records not sent again while a processor's failed batch was retried event by event (the failed attempt "
            "had sent them already), by processor.",
            ["processor"],
            registry=r,
        )
        self.required_source_silent = Gauge(
            "treadle_required_source_silent",
            "1 while a step has waited longer than its window for a reward source the active policy requires, "
            "which has sent nothing since the step arrived; else 0; by source.",
            ["source"],
            registry=r,
        )
        self.outputs_truncated = Counter(
            "treadle_outputs_truncated",
            "Derived records cut to fit TREADLE_MAX_EVENT_BYTES (the cut is recorded in the record), by type.",
            ["type"],
            registry=r,
        )
        self.rocksdb_memory = RocksDBMemoryGauge(r)
        self.gc_pauses = CollectorPauses("treadle_gc_seconds", r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class SinkMetrics:
    """What the ClickHouse sink counts: batch sizes and insert latency per table, its consumer lag."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.batch_rows = Histogram(
            "treadle_sink_batch_rows", "Rows per ClickHouse insert, by table.", ["table"],
            buckets=BATCH_ROW_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_seconds = Histogram(
            "treadle_sink_batch_seconds", "Seconds per ClickHouse insert, by table.", ["table"],
            buckets=BATCH_SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.rejected_rows = Counter(
            "treadle_sink_rejected_rows",
            "Records written to rejected_rows instead of their table (MAP: no rows could be made; INSERT: ClickHouse "
            "refused the row), by table and stage.",
            ["table", "stage"],
            registry=r,
        )
        self.consumer_lag = _consumer_lag(r)
        self.gc_pauses = CollectorPauses("treadle_sink_gc_seconds", r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class GpuMetrics:
    """Per-device NVML readings; registered only when NVML found a device (no empty GPU families)."""

    registry: CollectorRegistry

    def __post_init__(self) -> None:
        r = self.registry
        self.utilization = Gauge(
            "treadle_gpu_utilization_ratio", "GPU busy fraction over NVML's last sample period (0-1).", ["gpu"],
            registry=r,
        )  # fmt: skip
        self.memory_used = Gauge("treadle_gpu_memory_used_bytes", "GPU memory in use.", ["gpu"], registry=r)
        self.power = Gauge("treadle_gpu_power_watts", "GPU power draw.", ["gpu"], registry=r)
