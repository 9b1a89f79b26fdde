"""Fusion as data: how a step's reward components become one number, and the record of why.

`fuse(components, policy)` is a pure function of the *set* of components: they are sorted by event_id
before anything is computed (sums included), so every arrival order yields the identical `Fused`.

Semantics, in three phases (w = weight x confidence, both floored at 0; v' = a component's post-rule value):

1. Component rules (kind `scale`, and kind `override`, whose factor defaults to 1): every rule whose `match`
   holds for a component multiplies that component's value by the rule's factor. `match` always tests the
   component as it arrived (its raw value), never a scaled one, so component rules never feed each other and
   their factors simply multiply.
2. The mean. The *active* components are those matched by the first rule, in declared order, that overrides
   (kind `override`, or `scale` with `override: true`) and matches at least one component; without such a rule
   every component is active. value = sum(w * v') / sum(w) over the active components (plain mean of their v'
   when every w is 0). A component's normalized weight is w / sum(w) (0 when overridden) and its contribution
   is normalized weight x v', so the contributions sum to this value; overridden components contribute 0.
3. Result rules (kind `cap`, `veto`), in declared order, each when its match holds for at least one component
   (active or not): `cap` clamps the running value into [min, max], `veto` replaces it with the rule's `value`.
   Each that acted records an `Adjustment(rule, delta)`, so value == sum(contributions) + sum(adjustment deltas).

Composition: component rules act before result rules whatever their position in the list (a cap declared
before a scale still clamps the scaled result). Declared order decides which override wins and how result
rules chain: veto-then-cap caps the vetoed value, cap-then-veto yields the veto. A rule *fires* when it acted on
this reward: a component rule or a veto when its match holds for at least one component, a cap when it also
changed the value (a cap that clamped nothing is not listed, so `rules_fired` never names a rule that left the
reward as it was; a veto is listed even when its value equals the running one: the value is then the veto's).
`rules_fired` lists fired rules in application order (component rules in declared order, then result rules in
declared order), which is declared order when component rules come first.

Conflicts: every pair of components of different sources (overridden ones included), ordered by event_id,
whose post-rule values differ by more than `conflict_threshold` (none when it is None).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from operator import attrgetter
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_FUSION = "confidence_weighted_mean"
COMPONENT_RULES = ("scale", "override")
RESULT_RULES = ("cap", "veto")


# Component and Contribution are built for every component of every woven reward: plain slotted dataclasses,
# since a frozen one takes ~6x longer to build (measured: 1.3 against 0.22 us for 12 fields). Never change one.
@dataclass(slots=True)
class Component:
    """One reward signal as fusion sees it; weight comes from the reward spec, attributes from its envelope."""

    event_id: str
    source: str
    name: str
    value: float
    confidence: float
    weight: float = 1.0
    annotator: str = "CODE"
    attributes: Mapping[str, str] = field(default_factory=dict)
    evidence: str | None = None
    lateness_ms: int = 0
    imputed: bool = False
    event_time: int = 0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Component:
        """From the step assembler's component dicts (missing explanation fields take their defaults)."""
        return cls(
            event_id=str(data["event_id"]),
            source=data["source"],
            name=data.get("name", "reward"),
            value=float(data["value"]),
            confidence=float(data.get("confidence", 1.0)),
            weight=float(data.get("weight", 1.0)),
            annotator=str(data.get("annotator", "CODE")),
            attributes=dict(data.get("attributes") or {}),
            evidence=data.get("evidence"),
            lateness_ms=int(data.get("lateness_ms", 0)),
            imputed=bool(data.get("imputed", False)),
            event_time=int(data.get("event_time", 0)),
        )

    def sort_key(self) -> tuple[Any, ...]:
        # event_id first; the rest only breaks ties between (buggy) duplicates so the order stays total.
        return (
            self.event_id, self.source, self.name, self.value, self.confidence, self.weight, self.annotator,
            tuple(sorted(self.attributes.items())), self.evidence or "", self.lateness_ms, self.imputed,
            self.event_time,
        )  # fmt: skip


class RuleMatch(BaseModel):
    """Conditions on one component; all given ones must hold (an empty match holds for every component)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str | None = None
    name: str | None = None
    annotator: str | None = None
    attributes: dict[str, str] = Field(default_factory=dict, description="Envelope attributes that must be present.")
    value_below: float | None = Field(default=None, description="Raw value strictly below this.")
    value_above: float | None = Field(default=None, description="Raw value strictly above this.")

    def holds(self, c: Component) -> bool:
        return (
            (self.source is None or c.source == self.source)
            and (self.name is None or c.name == self.name)
            and (self.annotator is None or c.annotator == self.annotator)
            and all(c.attributes.get(k) == v for k, v in self.attributes.items())
            and (self.value_below is None or c.value < self.value_below)
            and (self.value_above is None or c.value > self.value_above)
        )


class FusionRule(BaseModel):
    """One rule of a fusion policy (see the module docstring for how rules compose)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    kind: Literal["scale", "override", "cap", "veto"]
    match: RuleMatch = Field(default_factory=RuleMatch)
    factor: float | None = Field(default=None, description="scale (required) / override: multiply matched values.")
    override: bool = Field(default=False, description="scale: matched components replace the others in the mean.")
    min: float | None = Field(default=None, description="cap: lower bound of the fused value.")
    max: float | None = Field(default=None, description="cap: upper bound of the fused value.")
    value: float | None = Field(default=None, description="veto: the fused value when the rule matches.")

    @model_validator(mode="after")
    def _fields_fit_the_kind(self) -> FusionRule:
        if self.kind == "scale" and self.factor is None:
            raise ValueError(f"rule {self.name}: a scale rule needs a factor")
        if self.kind == "cap":
            if self.min is None and self.max is None:
                raise ValueError(f"rule {self.name}: a cap rule needs min, max or both")
            if self.min is not None and self.max is not None and self.min > self.max:
                raise ValueError(f"rule {self.name}: cap min {self.min} is above max {self.max}")
        if self.kind == "veto" and self.value is None:
            raise ValueError(f"rule {self.name}: a veto rule needs a value")
        if self.kind in RESULT_RULES and (self.factor is not None or self.override):
            raise ValueError(f"rule {self.name}: factor and override belong to scale/override rules")
        if self.kind in COMPONENT_RULES and (self.min, self.max, self.value) != (None, None, None):
            raise ValueError(f"rule {self.name}: min, max and value belong to cap/veto rules")
        return self

    @property
    def overrides(self) -> bool:
        return self.kind == "override" or self.override

    @property
    def scale(self) -> float:
        return 1.0 if self.factor is None else self.factor


class FusionPolicy(BaseModel):
    """A named fusion: the default confidence-weighted mean plus rules applied as the module docstring says."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = DEFAULT_FUSION
    rules: list[FusionRule] = Field(default_factory=list)
    conflict_threshold: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _rule_names_are_unique(self) -> FusionPolicy:
        names = [r.name for r in self.rules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"fusion policy {self.name}: rule names must be unique ({', '.join(duplicates)})")
        return self


@dataclass(slots=True)
class Contribution:
    """A component's part in the fused value."""

    component: Component
    value: float  # after component rules
    weight: float  # normalized: weight x confidence / sum over active components; 0 when overridden
    contribution: float  # weight x value
    overridden: bool = False


@dataclass(frozen=True)
class Adjustment:
    """What a result rule (cap, veto) changed in the fused value."""

    rule: str
    kind: str
    delta: float


@dataclass(frozen=True)
class Conflict:
    a_event_id: str
    b_event_id: str
    a_value: float
    b_value: float
    difference: float

    def record(self) -> dict[str, Any]:
        return {
            "a_event_id": self.a_event_id,
            "b_event_id": self.b_event_id,
            "a_value": self.a_value,
            "b_value": self.b_value,
            "difference": self.difference,
        }


@dataclass(slots=True)  # not frozen, like Component: one per woven reward
class Fused:
    """The fused value with its explanation; value == sum of contributions + sum of adjustments (up to rounding)."""

    value: float
    contributions: list[Contribution]
    adjustments: list[Adjustment]
    rules_fired: list[str]
    conflicts: list[Conflict]
    imputed: list[str]
    policy: str = DEFAULT_FUSION

    @property
    def weights(self) -> dict[str, float]:
        return {c.component.event_id: c.weight for c in self.contributions}

    def component_records(self) -> list[dict[str, Any]]:
        """treadle.derived.RewardComponent records, by event_id; `weight` is the normalized weight."""
        return [
            {
                "event_id": c.component.event_id,
                "source": c.component.source,
                "name": c.component.name,
                "value": c.component.value,
                "confidence": c.component.confidence,
                "weight": c.weight,
                "annotator": c.component.annotator,
                "event_time": c.component.event_time,
                "contribution": c.contribution,
                "adjusted_value": c.value,
                "lateness_ms": c.component.lateness_ms,
                "evidence": c.component.evidence,
                "imputed": c.component.imputed,
            }
            for c in self.contributions
        ]

    def explanation(self) -> dict[str, Any]:
        """The WovenReward fields fusion owns besides value and components."""
        return {
            "rules_fired": list(self.rules_fired),
            "conflicts": [c.record() for c in self.conflicts],
            "imputed": list(self.imputed),
        }


def fuse(components: Iterable[Component], policy: FusionPolicy | None = None) -> Fused | None:
    """The fused reward of `components` under `policy`; None when there is nothing to fuse."""
    policy = policy or FusionPolicy()
    ordered = sorted(components, key=attrgetter("event_id"))
    if not ordered:
        return None
    if any(a.event_id == b.event_id for a, b in pairwise(ordered)):
        ordered.sort(key=Component.sort_key)  # (buggy) duplicates: the whole component breaks the tie
    component_rules = [r for r in policy.rules if r.kind in COMPONENT_RULES]
    result_rules = [r for r in policy.rules if r.kind in RESULT_RULES]
    fired: list[str] = []

    # 1. component rules
    matches = {r.name: [r.match.holds(c) for c in ordered] for r in policy.rules}
    values = [c.value for c in ordered]
    for rule in component_rules:
        if any(matches[rule.name]):
            fired.append(rule.name)
            values = [v * rule.scale if hit else v for v, hit in zip(values, matches[rule.name], strict=True)]

    # 2. the weighted mean over the active components
    active = [True] * len(ordered)
    for rule in component_rules:
        if rule.overrides and any(matches[rule.name]):
            active = list(matches[rule.name])
            break
    raw = [max(c.weight, 0.0) * max(c.confidence, 0.0) if on else 0.0 for c, on in zip(ordered, active, strict=True)]
    total = sum(raw)
    if total > 0:
        weights = [w / total for w in raw]
    else:
        n_active = sum(active)
        weights = [1.0 / n_active if on else 0.0 for on in active]
    contributions = [
        Contribution(component=c, value=v, weight=w, contribution=w * v, overridden=not on)
        for c, v, w, on in zip(ordered, values, weights, active, strict=True)
    ]
    value = sum(c.contribution for c in contributions)

    # 3. result rules
    adjustments: list[Adjustment] = []
    for rule in result_rules:
        if not any(matches[rule.name]):
            continue
        before = value
        if rule.kind == "cap":
            if rule.min is not None:
                value = max(value, rule.min)
            if rule.max is not None:
                value = min(value, rule.max)
            if value == before:
                continue  # it clamped nothing: listing it would say it shaped a value it left alone
        else:
            assert rule.value is not None
            value = rule.value
        fired.append(rule.name)
        adjustments.append(Adjustment(rule=rule.name, kind=rule.kind, delta=value - before))

    return Fused(
        value=value,
        contributions=contributions,
        adjustments=adjustments,
        rules_fired=fired,
        conflicts=_conflicts(contributions, policy.conflict_threshold),
        imputed=sorted({c.source for c in ordered if c.imputed}),
        policy=policy.name,
    )


def _conflicts(contributions: list[Contribution], threshold: float | None) -> list[Conflict]:
    if threshold is None:
        return []
    found = []
    for i, a in enumerate(contributions):
        for b in contributions[i + 1 :]:
            difference = abs(a.value - b.value)
            if a.component.source != b.component.source and difference > threshold:
                found.append(Conflict(a.component.event_id, b.component.event_id, a.value, b.value, difference))
    return found


# --- the interface the step assembler calls today ---------------------------------------------------------------


@dataclass(frozen=True)
class FusedReward:
    value: float
    status: str
    weights: dict[str, float]
    fused: Fused | None = None


class ConfidenceWeightedMean:
    """Adapter for the step assembler's component dicts: `fuse` under a FusionPolicy (default: no rules)."""

    def __init__(self, policy: FusionPolicy | None = None) -> None:
        self.policy = policy or FusionPolicy()
        self.name = self.policy.name

    def fuse(self, components: list[dict[str, Any]]) -> FusedReward | None:
        fused = fuse([Component.from_dict(c) for c in components], self.policy)
        if fused is None:
            return None
        return FusedReward(value=fused.value, status="complete", weights=fused.weights, fused=fused)
