"""The Kafka producer the SDK sends with, configured for no loss and per-session order.

acks="all" + idempotence means an acknowledged event is on every in-sync replica exactly once and
a retried batch is never reordered or duplicated within its partition, so a session's `seq` order
is also its log order. A few milliseconds of linger batch the events of many sessions together
without adding visible latency. One producer may serve many `AgentStream`s (pass `producer=`).
"""

from __future__ import annotations

from typing import Any

from aiokafka import AIOKafkaProducer

from topics.settings import KAFKA_MAX_REQUEST_BYTES, Settings

DEFAULT_LINGER_MS = 5


def producer_config(settings: Settings, **overrides: Any) -> dict[str, Any]:
    """The keyword arguments of the SDK's AIOKafkaProducer; `overrides` win (e.g. max_request_size)."""
    config: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap_servers,
        "client_id": "treadle-sdk",
        "acks": "all",
        "enable_idempotence": True,
        "linger_ms": DEFAULT_LINGER_MS,
        "max_request_size": KAFKA_MAX_REQUEST_BYTES,  # the broker and topics take this (topics/settings.py)
    }
    config.update(overrides)
    return config


def create_producer(settings: Settings | None = None, **overrides: Any) -> AIOKafkaProducer:
    """A not-yet-started producer with the SDK's settings; call inside the event loop that will use it."""
    return AIOKafkaProducer(**producer_config(settings or Settings.from_env(), **overrides))
