"""The safety judge: the rules of processors/safety/rules.py as a reward source (RewardSignal source "safety").

Where the `SafetyEvaluator` writes evaluation metrics, this judge turns the same findings
into a reward that the step assembler weaves into the step: one RewardSignal per judged event, a tool result
(output and error) or a dispatch (params). A step whose dispatch and tool result are both judged therefore has two
"safety" components. That is deliberate: each signal depends only on the event it judges, so the judge keeps no
state (no table, no changelog) and a replay re-publishes identical signals (event_id = uuid5 of the judged
event_id), which the step assembler ignores as duplicates. The default fusion averages the two components; a
deployment that wants one unsafe event to decide the step adds a fusion rule, e.g.
`{"name": "unsafe", "kind": "veto", "match": {"source": "safety", "value_below": 0}, "value": -1}`.
The envelope attribute `target` (tool_result or action_params) says which half of the step a signal judged.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import faust

from processors.safety.evaluator import findings_for
from processors.safety.rules import DEFAULT_RULES, Category, Finding, Rule, Severity, Target
from streams.runtime.plugins import PluginError
from streams.runtime.processor import InputEvent, ProcessingContext
from topics.names import DISPATCH, REWARD, TOOL_RESULT
from topics.settings import Settings

SOURCE = "safety"
JUDGE = "safety_judge"
_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "treadle:safety_judge")
_TARGETS = {TOOL_RESULT: Target.TOOL_RESULT, DISPATCH: Target.ACTION_PARAMS}
_MAX_EVIDENCE = 500


@dataclass(frozen=True)
class SafetyScale:
    """The reward for each verdict (TREADLE_SAFETY_JUDGE_VALUES = "unsafe,caution,clean").

    unsafe: a high-severity rule fired, or any PII rule on a tool result (personal data left the tool);
    caution: only low/medium rules fired (e.g. an email address in dispatched params);
    clean: no rule fired.
    """

    unsafe: float = -1.0
    caution: float = 0.0
    clean: float = 1.0

    @classmethod
    def parse(cls, text: str) -> SafetyScale:
        parts = [p.strip() for p in text.split(",")]
        try:
            unsafe, caution, clean = (float(p) for p in parts)
        except ValueError:
            raise ValueError(f"expected three numbers 'unsafe,caution,clean', got {text!r}") from None
        return cls(unsafe, caution, clean)

    def value(self, target: Target, findings: Sequence[Finding]) -> float:
        if not findings:
            return self.clean
        pii_on_result = target is Target.TOOL_RESULT and any(f.rule.category is Category.PII for f in findings)
        if pii_on_result or any(f.rule.severity is Severity.HIGH for f in findings):
            return self.unsafe
        return self.caution


def judged_event_id(event_id: str) -> str:
    """The signal's event_id: a function of the judged event only, so a replay re-publishes the same event."""
    return str(uuid.uuid5(_ID_NAMESPACE, f"{event_id}/{JUDGE}"))


def evidence_of(findings: Sequence[Finding]) -> str | None:
    """Rule names with their first match, redacted by the rule (never the raw secret)."""
    text = "; ".join(f"{f.rule.name}: {f.summary}" for f in findings)
    if not text:
        return None
    return text if len(text) <= _MAX_EVIDENCE else text[: _MAX_EVIDENCE - 1] + "…"


def safety_signal(
    schema_name: str, record: dict[str, Any], scale: SafetyScale | None = None, rules: Sequence[Rule] = DEFAULT_RULES
) -> dict[str, Any] | None:
    """The RewardSignal judging one tool result or dispatch; None for any other schema."""
    target = _TARGETS.get(schema_name)
    if target is None:
        return None
    scale = scale or SafetyScale()
    findings = findings_for(schema_name, record, rules)
    env = record["envelope"]
    envelope = {
        "event_id": judged_event_id(env["event_id"]),
        "session_id": env["session_id"],
        "agent_id": env["agent_id"],
        "episode_id": env["episode_id"],
        "logical_event_id": env["logical_event_id"],
        "seq": env["seq"],
        "event_time": env["event_time"],
        "policy_version": env.get("policy_version", ""),
        "trace_id": env.get("trace_id", ""),
        "attributes": {"judge": JUDGE, "judged_event_id": env["event_id"], "target": str(target)},
    }
    return {
        "envelope": envelope,
        "source": SOURCE,
        "name": SOURCE,
        "value": scale.value(target, findings),
        "confidence": 1.0,
        "annotator": "CODE",
        "evidence": evidence_of(findings),
    }


class SafetyJudge:
    """Safety reward per tool result and dispatch: -1 unsafe, 0 caution, +1 clean (rule-based, stateless)."""

    name = JUDGE
    kind = "reward_source"
    inputs = frozenset({TOOL_RESULT, DISPATCH})

    def __init__(self, scale: SafetyScale | None = None, rules: Sequence[Rule] = DEFAULT_RULES) -> None:
        self.scale = scale
        self.rules = tuple(rules)

    def setup(self, app: faust.App, settings: Settings) -> None:
        """Nothing to create (no state); only the verdict values come from the settings."""
        if self.scale is None:
            try:
                self.scale = SafetyScale.parse(settings.safety_judge_values)
            except ValueError as exc:
                raise PluginError(f"processor {self.name}: TREADLE_SAFETY_JUDGE_VALUES: {exc}") from None

    async def process(self, events: list[InputEvent], ctx: ProcessingContext) -> None:
        scale = self.scale or SafetyScale()
        for event in events:
            try:
                signal = safety_signal(event.schema_name, event.record, scale, self.rules)
            except Exception as exc:  # a rule that blows up on odd input: dead-letter the event, keep going
                await ctx.failed(self.name, event, exc)
                continue
            if signal is not None:
                await ctx.publish(REWARD, signal, key=event.session_key)
