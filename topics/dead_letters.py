"""DeadLetter records: what failed, where, and the raw bytes, so nothing bad input carries is lost."""

from __future__ import annotations

from typing import Any

from topics.codec import DeadLetterStage

MAX_REASON_CHARS = 2_000  # a reason quotes an exception, which may quote the hostile input itself
MAX_ID_CHARS = 1_024  # ids taken from a record or key that were never validated


def dead_letter(
    stage: DeadLetterStage,
    reason: str,
    *,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    timestamp_ms: int,
    schema_name: str | None = None,
    record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A DeadLetter whose id and timestamps come only from the source message (same on replay)."""
    env = (record or {}).get("envelope") or {}
    return {
        "dead_letter_id": f"{topic}/{partition}/{offset}",
        "stage": str(stage),
        "reason": reason if len(reason) <= MAX_REASON_CHARS else f"{reason[:MAX_REASON_CHARS]}… (cut)",
        "topic": topic,
        "partition": partition,
        "offset": offset,
        "key": key,
        "value": value,
        "event_id": _bounded(env.get("event_id") or None),
        "session_id": _bounded(
            env.get("session_id") or (key[:MAX_ID_CHARS].decode("utf-8", "replace") if key else None)
        ),
        "schema_name": _bounded(schema_name),
        "failed_at": timestamp_ms * 1000,
        "value_truncated_bytes": 0,  # processors/output_size.py cuts value if the record would not fit
    }


def _bounded(text: str | None) -> str | None:
    return text if text is None or len(text) <= MAX_ID_CHARS else text[:MAX_ID_CHARS]
