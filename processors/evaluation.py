"""What evaluator processors emit: EvaluationMetric records about one input event each.

Shared by every evaluator (the shipped safety evaluator and plugins), so ids and times are made the same way:
the id is a function of (evaluator, metric, rule, judged event_id) and event_time is copied from the judged
event, so reprocessing publishes identical records and the evaluation_metrics table keeps one row per id.
"""

from __future__ import annotations

from typing import Any


def metric_id(evaluator: str, metric: str, rule: str, source_event_id: str) -> str:
    """Deterministic, readable, unique per (evaluator, metric, rule, judged event)."""
    return f"{evaluator}:{metric}:{rule}:{source_event_id}"


def metric_record(
    evaluator: str,
    metric: str,
    rule: str,
    value: float,
    severity: str,
    judged: dict[str, Any],
    evidence: str | None = None,
) -> dict[str, Any]:
    """An EvaluationMetric about the input record `judged`, carrying its envelope's identity and time.

    `evaluator`: the processor's name; `metric`: what is measured (e.g. `pii_leak`); `rule`: which check or
    variant produced the value (e.g. `email`); `value`: the measurement; `severity`: low, medium or high;
    `evidence`: optional text shown with the row. The row's id is (evaluator, metric, rule, judged event_id).
    """
    envelope = judged["envelope"]
    event_id = str(envelope["event_id"])
    return {
        "metric_id": metric_id(evaluator, metric, rule, event_id),
        "evaluator": evaluator,
        "metric": metric,
        "rule": rule,
        "value": float(value),
        "severity": str(severity),
        "session_id": envelope["session_id"],
        "episode_id": envelope["episode_id"],
        "logical_event_id": envelope["logical_event_id"],
        "agent_id": envelope["agent_id"],
        "policy_version": envelope.get("policy_version", ""),
        "source_event_id": event_id,
        "event_time": envelope["event_time"],
        "evidence": evidence,
    }
