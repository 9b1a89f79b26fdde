"""Value checks of the event contract that Avro types cannot express, shared by the SDK and the worker.

The worker dead-letters an input that fails one (topics/validation.py); the SDK raises ValueError before it
sends one, so both say the same thing in the same words. Each returns the problem, or None.
"""

from __future__ import annotations

import math
from typing import Any

MAX_NAME_CHARS = 1024  # ids and names are keys, row keys and labels: a huge one would make every derived record huge
_ENVELOPE_NAMES = ("event_id", "session_id", "agent_id", "episode_id", "logical_event_id", "trace_id", "policy_version")
_RECORD_NAMES = ("tool", "source", "name")


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


def overlong_name_problem(record: dict[str, Any]) -> str | None:
    """An envelope id, tool or reward name longer than MAX_NAME_CHARS. A record encoded in MAX_NAME_CHARS bytes or
    fewer cannot hold one, so callers that know the size skip this."""
    env = record.get("envelope") or {}
    for name in _ENVELOPE_NAMES:
        if len(env.get(name) or "") > MAX_NAME_CHARS:
            return f"envelope.{name} is {len(env[name]):,} characters long; ids are limited to {MAX_NAME_CHARS:,}"
    for name in _RECORD_NAMES:
        if len(record.get(name) or "") > MAX_NAME_CHARS:
            return f"{name} is {len(record[name]):,} characters long; names are limited to {MAX_NAME_CHARS:,}"
    return None


def llm_call_problem(record: dict) -> str | None:
    """An LlmCall's token arrays and numbers: logprobs align with the completion's token ids when both are given
    (usage counts may include hidden reasoning tokens, so they are not compared), ids are non-negative, logprobs
    are finite and at most 0 (above 0 is a caller's bug, e.g. probabilities passed as logprobs)."""
    if (problem := latency_problem(record["latency_ms"])) is not None:
        return problem
    logprobs = record["completion_logprobs"]
    completion_ids = record["completion_token_ids"]
    if logprobs and completion_ids and len(logprobs) != len(completion_ids):
        return (
            f"completion_logprobs has {len(logprobs)} values but completion_token_ids has {len(completion_ids)} "
            "tokens; they must align one to one"
        )
    for name in ("prompt_token_ids", "completion_token_ids"):
        if any(token < 0 for token in record[name]):
            return f"{name} must be non-negative token ids"
    for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        if record[name] < 0:
            return f"{name} must be >= 0, got {record[name]}"
    if any(not (lp <= 0.0) for lp in logprobs):  # catches NaN too
        bad = next(lp for lp in logprobs if not (lp <= 0.0))
        return f"completion_logprobs must be finite log-probabilities <= 0, got {bad}"
    if any(math.isinf(lp) for lp in logprobs):
        return "completion_logprobs must be finite (use a large negative number for an impossible token)"
    return None
