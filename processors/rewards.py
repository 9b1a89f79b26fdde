"""What reward-source processors emit: a RewardSignal judging one input event's step.

Shared by reward-source plugins, so ids and times are made the same way: the event_id is a uuid5 of (source, name,
judged event_id), so a replay publishes the same signal and the step assembler weaves it once; the envelope (session,
episode, step, seq, event time) is the judged event's, so the signal lands on that step and its lateness is measured
from the judged event's time.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

from topics.ids import uuid5_text

ANNOTATORS = ("LLM", "CODE", "HUMAN")
_URL_NAMESPACE = uuid.NAMESPACE_URL.bytes


def signal_id(source: str, name: str, judged_event_id: str) -> str:
    """Deterministic: the same judgement of the same event always has the same id: str(uuid.uuid5(NAMESPACE_URL,
    name)), made from the SHA-1 directly (a few times cheaper than through UUID objects; one is made per signal)."""
    name = f"treadle-reward/{source}/{name}/{judged_event_id}"
    return uuid5_text(hashlib.sha1(_URL_NAMESPACE + name.encode(), usedforsecurity=False).hexdigest())


def reward_signal(
    source: str,
    value: float,
    judged: dict[str, Any],
    *,
    name: str = "reward",
    confidence: float = 1.0,
    annotator: str = "CODE",
    evidence: str | None = None,
) -> dict[str, Any]:
    """A RewardSignal from `source` about the input record `judged`, on its step; publish it keyed by the session
    (`event.session_key`). `annotator` is LLM, CODE or HUMAN; `evidence` is free text shown in `treadle explain`."""
    envelope = judged["envelope"]
    judged_id = str(envelope["event_id"])
    return {
        "envelope": {
            **envelope,
            "event_id": signal_id(source, name, judged_id),
            "attributes": {**(envelope.get("attributes") or {}), "judged_event_id": judged_id},
        },
        "source": source,
        "name": name,
        "value": float(value),
        "confidence": float(confidence),
        "annotator": annotator,
        "evidence": evidence,
    }
