"""Prometheus metrics of a worker and of its sink, each in a registry of its own.

No process-global registry: two workers in one test process, or a worker and its sink, never share
series. The worker serves its registry at `/metrics` on TREADLE_WEB_PORT and appends its sink
child's (fetched from the sink's `/metrics`), so one scrape per worker sees the whole pipeline.

Label values are bounded: topics, schema names, stages, sources and partitions, never free text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# Every family, with its Prometheus type, as exposed; deploy/grafana's dashboard and tests use this list.
METRIC_FAMILIES: dict[str, str] = {
    "treadle_events_in_total": "counter",
    "treadle_events_out_total": "counter",
    "treadle_dead_letters_total": "counter",
    "treadle_late_rewards_total": "counter",
    "treadle_open_steps": "gauge",
    "treadle_expired_steps_total": "counter",
    "treadle_watermark_lag_seconds": "gauge",
    "treadle_reward_join_latency_seconds": "histogram",
    "treadle_sink_batch_rows": "histogram",
    "treadle_sink_batch_seconds": "histogram",
    "treadle_consumer_lag": "gauge",
    "treadle_producer_errors_total": "counter",
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
        self.reward_join_latency = Histogram(
            "treadle_reward_join_latency_seconds",
            "From a step's dispatch (event time) to a reward joined to it (processing time).",
            buckets=JOIN_LATENCY_BUCKETS,
            registry=r,
        )
        self.consumer_lag = _consumer_lag(r)
        self.producer_errors = Counter(
            "treadle_producer_errors", "Records the producer could not deliver, by topic.", ["topic"], registry=r
        )

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
        self.consumer_lag = _consumer_lag(r)

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
