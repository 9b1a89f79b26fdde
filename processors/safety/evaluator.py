"""The safety evaluator: PII, leaked secrets and destructive commands, as evaluation_metrics rows.

Stateless on purpose: each metric depends only on the event it judges (ids from the event_id, event_time copied
from it), so a replay or a duplicate re-publishes identical rows that the ReplacingMergeTree table collapses, and
no Faust table or changelog is needed. The rules live in processors/safety/rules.py, shared with reward sources.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import faust

from processors.evaluation import metric_record
from processors.safety.rules import DEFAULT_RULES, Category, Finding, Rule, Severity, Target, params_texts, scan
from streams.runtime.processor import InputEvent, ProcessingContext
from topics.names import DISPATCH, EVALUATION_METRIC, TOOL_RESULT
from topics.settings import Settings

SAFETY_ALERT = "safety_alert"
PII_LEAK = "pii_leak"
PII_LEAK_RULE = "any_pii"
_SEVERITY_ORDER = (Severity.LOW, Severity.MEDIUM, Severity.HIGH)


def findings_for(schema_name: str, record: dict[str, Any], rules: Sequence[Rule] = DEFAULT_RULES) -> list[Finding]:
    """What the rules find in one input record: a tool's output and error, or a dispatch's params."""
    if schema_name == TOOL_RESULT:
        return scan([record.get("output") or "", record.get("error") or ""], Target.TOOL_RESULT, rules)
    if schema_name == DISPATCH:
        return scan(params_texts(record.get("params_json") or ""), Target.ACTION_PARAMS, rules)
    return []


def judge(
    schema_name: str, record: dict[str, Any], evaluator: str = "safety", rules: Sequence[Rule] = DEFAULT_RULES
) -> list[dict[str, Any]]:
    """Every metric for one input record: a safety_alert per rule that fired, and a pii_leak per tool result."""
    findings = findings_for(schema_name, record, rules)
    metrics = [
        metric_record(evaluator, SAFETY_ALERT, f.rule.name, 1.0, f.rule.severity, record, f.summary) for f in findings
    ]
    if schema_name == TOOL_RESULT:
        pii = [f for f in findings if f.rule.category is Category.PII]
        severity = max((f.rule.severity for f in pii), key=_SEVERITY_ORDER.index, default=Severity.LOW)
        evidence = ",".join(f.rule.name for f in pii) or None
        value = 1.0 if pii else 0.0
        metrics.append(metric_record(evaluator, PII_LEAK, PII_LEAK_RULE, value, severity, record, evidence))
    return metrics


class SafetyEvaluator:
    """PII, leaked secrets and destructive commands in tool results and dispatched params (rule-based)."""

    name = "safety"
    kind = "evaluator"
    inputs = frozenset({TOOL_RESULT, DISPATCH})

    def __init__(self, rules: Sequence[Rule] = DEFAULT_RULES) -> None:
        self.rules = tuple(rules)

    def setup(self, app: faust.App, settings: Settings) -> None:
        """Nothing to set up: the evaluator keeps no state."""

    async def process(self, events: list[InputEvent], ctx: ProcessingContext) -> None:
        for event in events:
            try:
                metrics = judge(event.schema_name, event.record, self.name, self.rules)
            except Exception as exc:  # a rule that blows up on odd input: dead-letter the event, keep going
                await ctx.failed(self.name, event, exc)
                continue
            for metric in metrics:
                await ctx.publish(EVALUATION_METRIC, metric, key=event.session_key)
