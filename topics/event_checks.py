"""Value checks of the event contract that Avro types cannot express, shared by the SDK and the worker.

The worker dead-letters an input that fails one (topics/validation.py); the SDK raises ValueError before it
sends one, so both say the same thing in the same words. Each returns the problem, or None.
"""

from __future__ import annotations

import math


def event_time_problem(event_time_us: int) -> str | None:
    if event_time_us > 0:
        return None
    return f"envelope.event_time must be positive microseconds, got {event_time_us}"


def latency_problem(latency_ms: float) -> str | None:
    if latency_ms >= 0 and math.isfinite(latency_ms):
        return None
    return f"latency_ms must be a finite non-negative number, got {latency_ms}"


def reward_problem(value: float, confidence: float) -> str | None:
    if not math.isfinite(value):
        return f"reward value must be finite, got {value}"
    if not 0.0 <= confidence <= 1.0:
        return f"confidence must be in [0, 1], got {confidence}"
    return None
