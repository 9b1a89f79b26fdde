"""Fusion policies: how a step's reward components become one number.

A policy is a pure function of the components, so the fused value is the same whatever order the
components arrived in. Reward specs, rules and imputation plug in here as further policies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class FusedReward:
    value: float
    status: str
    weights: dict[str, float]


class FusionPolicy(Protocol):
    name: str

    def fuse(self, components: list[dict[str, Any]]) -> FusedReward | None:
        """None when there is nothing to fuse yet."""
        ...


class ConfidenceWeightedMean:
    """Mean of component values weighted by each source's confidence (equal weights if all are 0)."""

    name = "confidence_weighted_mean"

    def fuse(self, components: list[dict[str, Any]]) -> FusedReward | None:
        if not components:
            return None
        total = sum(max(c["confidence"], 0.0) for c in components)
        if total > 0:
            weights = {c["event_id"]: max(c["confidence"], 0.0) / total for c in components}
        else:
            weights = {c["event_id"]: 1.0 / len(components) for c in components}
        value = sum(c["value"] * weights[c["event_id"]] for c in components)
        return FusedReward(value=value, status="complete", weights=weights)
