"""Reward specs as data: per reward source, its window, grace, weight, whether it is required, imputation.

A `RewardPolicy` is one version of the specs. Policies are effective from an *event time*: a step uses
the newest policy whose `effective_from_us` is not after its dispatch's event_time, and keeps it for
life (its state records the version). That makes the choice a function of the events, not of when
a worker happened to learn about a policy, so a replay weaves exactly what the first run wove.

Vocabulary (as in Kafka Streams): a source's *window* ends `window_s` after the dispatch; *grace* is
how much later its rewards are still accepted. Lateness is measured in event time: a reward whose
event_time is after dispatch + window + grace is *late* and goes to the late-rewards table instead
of into the step. The watermark (processors/steps/watermarks.py) decides only *when* a step stops waiting
for its required sources.
"""

from __future__ import annotations

import bisect
import json
import logging
from enum import StrEnum
from functools import cached_property
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from processors.steps.fusion import FusionPolicy
from topics.model_errors import field_errors

DAY_S = 86_400.0


def seconds_to_us(seconds: float) -> int:
    """Event times are integer microseconds; spec durations are float seconds."""
    return round(seconds * 1_000_000)


class Imputation(StrEnum):
    """What stands in for a required source that has not arrived when its step's window closes."""

    NONE = "none"  # the step's reward is `partial`
    DEFAULT = "default"  # `default_value`; the reward is `imputed`
    ROLLING_MEAN = "rolling_mean"  # mean of the source's last `rolling_count` values on this worker


class RewardSpec(BaseModel):
    """How one reward source (and optionally one reward name of it) is woven into steps."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str = Field(description="RewardSignal.source this spec is for, e.g. llm_judge.")
    name: str = Field(default="*", description="RewardSignal.name, or * for every name of the source.")
    window_s: float = Field(default=DAY_S, ge=0, description="Expected delay: the window ends this long after dispatch")
    grace_s: float = Field(default=0.0, ge=0, description="Allowed lateness after the window, in event time.")
    weight: float = Field(default=1.0, ge=0, description="Weight in fusion, multiplied by the signal's confidence.")
    required: bool = Field(default=False, description="A step waits for required sources before its first reward.")
    imputation: Imputation = Imputation.NONE
    default_value: float | None = Field(default=None, description="The imputed value when imputation is default.")
    rolling_count: int = Field(default=100, ge=1, description="Values averaged when imputation is rolling_mean.")
    annotator: str | None = Field(default=None, description="Kind of annotator expected: LLM, CODE or HUMAN.")

    @model_validator(mode="after")
    def _default_needs_a_value(self) -> RewardSpec:
        if self.imputation is Imputation.DEFAULT and self.default_value is None:
            raise ValueError(f"spec {self.key}: imputation 'default' needs a default_value")
        return self

    # Cached: read for every reward of every step touched; the model is frozen.
    @cached_property
    def key(self) -> str:
        return f"{self.source}/{self.name}"

    @property
    def deadline_s(self) -> float:
        """Seconds after dispatch past which this source's rewards are late."""
        return self.window_s + self.grace_s

    @cached_property
    def window_us(self) -> int:
        return seconds_to_us(self.window_s)

    @cached_property
    def deadline_us(self) -> int:
        return seconds_to_us(self.deadline_s)

    def matches(self, source: str, name: str) -> bool:
        return self.source == source and self.name in ("*", name)


class RewardPolicy(BaseModel):
    """One version of the reward specs. Sources without a spec get `default_spec` (optional)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: str = "default"
    effective_from_us: int = Field(default=0, description="Steps dispatched at or after this event time use it.")
    specs: tuple[RewardSpec, ...] = ()
    default_window_s: float = Field(default=DAY_S, ge=0)
    default_grace_s: float = Field(default=0.0, ge=0)
    fusion: FusionPolicy = Field(default_factory=FusionPolicy, description="How components become one value.")
    orphan_wait_s: float = Field(
        default=300.0, ge=0, description="A reward with no dispatch waits this long (event time), then is an orphan."
    )

    @model_validator(mode="after")
    def _one_spec_per_key(self) -> RewardPolicy:
        keys = [spec.key for spec in self.specs]
        duplicates = sorted({k for k in keys if keys.count(k) > 1})
        if duplicates:
            raise ValueError(f"policy {self.version}: more than one spec for {', '.join(duplicates)}")
        return self

    def spec_for(self, source: str, name: str) -> RewardSpec:
        """The exact (source, name) spec, else the source's `*` spec, else an optional default."""
        exact = [s for s in self.specs if s.source == source and s.name == name]
        if exact:
            return exact[0]
        wildcard = [s for s in self.specs if s.source == source and s.name == "*"]
        if wildcard:
            return wildcard[0]
        return RewardSpec(source=source, window_s=self.default_window_s, grace_s=self.default_grace_s)

    @cached_property  # read for every step touched; the model is frozen
    def required(self) -> tuple[RewardSpec, ...]:
        return tuple(s for s in self.specs if s.required)


class PolicyError(ValueError):
    """A policy file or record that cannot be used; the message says where and why."""


log = logging.getLogger(__name__)

_BUILT_IN = RewardPolicy()


class PolicyBook:
    """Every known policy version; picks the one a step uses from its dispatch's event time."""

    def __init__(self, policies: list[RewardPolicy] | None = None) -> None:
        self._policies: dict[str, RewardPolicy] = {}
        self._unknown: set[str] = set()  # versions steps recorded that this book does not know (warned once each)
        for policy in policies or [RewardPolicy()]:
            self.add(policy)

    def add(self, policy: RewardPolicy) -> None:
        known = self._policies.get(policy.version)
        if known is not None and known != policy:
            raise PolicyError(f"policy version {policy.version} already exists with other content; use a new version")
        self._policies[policy.version] = policy
        self._order = sorted(self._policies.values(), key=lambda p: (p.effective_from_us, p.version))
        self._starts = [p.effective_from_us for p in self._order]
        # whether any version imputes a rolling mean (else a worker need not keep recent values)
        self.imputes_rolling_means = any(
            spec.imputation is Imputation.ROLLING_MEAN for p in self._order for spec in p.specs
        )

    def for_dispatch(self, dispatch_us: int) -> RewardPolicy:
        """The newest policy effective at `dispatch_us` (runs for every event: a bisect, not a scan)."""
        newest = bisect.bisect_right(self._starts, dispatch_us)
        return self._order[newest - 1] if newest else _BUILT_IN

    def get(self, version: str) -> RewardPolicy:
        """The version a step recorded; the built-in default if it is unknown here (a warning once per version)."""
        policy = self._policies.get(version)
        if policy is not None:
            return policy
        if version != _BUILT_IN.version and version not in self._unknown:
            self._unknown.add(version)
            log.warning("reward policy %r, recorded by steps dispatched under it, is unknown to this worker: they are "
                        "woven with the built-in default policy (every source optional, a day's window) until it is "
                        "known again: push it with `treadle policy push` or name its file in TREADLE_REWARD_POLICY",
                        version)  # fmt: skip
        return _BUILT_IN

    def __contains__(self, version: str) -> bool:
        return version in self._policies

    @property
    def versions(self) -> list[str]:
        return sorted(self._policies, key=lambda v: (self._policies[v].effective_from_us, v))


def parse_policy(text: str, origin: str) -> RewardPolicy:
    """A policy from JSON or YAML text; errors name `origin` and the field."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PolicyError(f"{origin}: neither JSON nor YAML ({exc})") from exc
    try:
        return RewardPolicy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(f"{origin}: {field_errors(exc, 'policy')[0]}") from exc


def load_policy_file(path: Path) -> RewardPolicy:
    try:
        text = path.read_text()
    except OSError as exc:
        raise PolicyError(f"cannot read reward policy {path}: {exc.strerror}") from exc
    return parse_policy(text, str(path))
