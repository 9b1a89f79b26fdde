"""DeadLetter records: what failed, where, and the raw bytes, so nothing bad input carries is lost."""

from __future__ import annotations

from typing import Any

from topics.codec import DeadLetterStage


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
        "reason": reason,
        "topic": topic,
        "partition": partition,
        "offset": offset,
        "key": key,
        "value": value,
        "event_id": env.get("event_id") or None,
        "session_id": env.get("session_id") or (key.decode("utf-8", "replace") if key else None),
        "schema_name": schema_name,
        "failed_at": timestamp_ms * 1000,
    }
