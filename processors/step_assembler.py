"""Step assembly: fold a step's dispatch, tool result and reward signals into a Transition.

The fold is a pure function of the *set* of events seen, never of their order:
- a result or reward that arrives before its dispatch is kept in the step's state and used when the
  dispatch arrives (arrival order across topics is not guaranteed);
- duplicates (same event_id) change nothing; they re-emit the current rows so that output lost in a
  crash between the state write and the send is produced again, byte for byte;
- `revision` counts the distinct events folded in, so replay after a crash yields the same final
  revision with the same values, and ReplacingMergeTree keeps exactly that row.
Event-time windows and lateness (reward weaving) decide *when* to emit; they wrap this fold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from processors.fusion import ConfidenceWeightedMean, FusionPolicy

DISPATCH = "treadle.events.ActionDispatched"
RESULT = "treadle.events.ToolResult"
REWARD = "treadle.events.RewardSignal"
STEP_INPUTS = (DISPATCH, RESULT, REWARD)


@dataclass
class StepState:
    """Everything known about one step (one logical_event_id) so far."""

    logical_event_id: str
    dispatch: dict[str, Any] | None = None
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    rewards: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra_dispatches: list[str] = field(default_factory=list)

    @property
    def event_ids(self) -> set[str]:
        ids = set(self.results) | set(self.rewards) | set(self.extra_dispatches)
        if self.dispatch is not None:
            ids.add(self.dispatch["envelope"]["event_id"])
        return ids

    @property
    def revision(self) -> int:
        return len(self.event_ids)

    def to_bytes(self) -> bytes:
        return orjson.dumps(
            {
                "l": self.logical_event_id,
                "d": self.dispatch,
                "t": self.results,
                "r": self.rewards,
                "x": self.extra_dispatches,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> StepState:
        doc = orjson.loads(data)
        return cls(
            logical_event_id=doc["l"],
            dispatch=doc["d"],
            results=doc["t"],
            rewards=doc["r"],
            extra_dispatches=doc["x"],
        )


@dataclass(frozen=True)
class StepOutput:
    """Records to publish after an event was folded in: (schema name, record) pairs."""

    records: list[tuple[str, dict[str, Any]]]
    changed: bool


class StepAssembler:
    """Applies one input event to a StepState and says which derived records to publish."""

    def __init__(self, fusion: FusionPolicy | None = None) -> None:
        self.fusion = fusion or ConfidenceWeightedMean()

    def fold(self, state: StepState, schema_name: str, record: dict[str, Any]) -> bool:
        """Add one event to the step; False when it was already folded in (a duplicate)."""
        event_id = record["envelope"]["event_id"]
        if event_id in state.event_ids:
            return False
        if schema_name == DISPATCH:
            self._add_dispatch(state, record)
        elif schema_name == RESULT:
            state.results[event_id] = record
        elif schema_name == REWARD:
            state.rewards[event_id] = record
        else:
            raise ValueError(f"step assembler does not take {schema_name}")
        return True

    def apply(self, state: StepState, schema_name: str, record: dict[str, Any]) -> StepOutput:
        """Fold one event and return the step's current rows (re-emitted for duplicates too)."""
        changed = self.fold(state, schema_name, record)
        return StepOutput(records=self.outputs(state), changed=changed)

    @staticmethod
    def _add_dispatch(state: StepState, record: dict[str, Any]) -> None:
        # Two dispatches for one step is a producer bug; the earliest (seq, event_id) wins either way.
        if state.dispatch is None:
            state.dispatch = record
            return
        current = state.dispatch
        if _order_key(record) < _order_key(current):
            state.dispatch = record
            state.extra_dispatches.append(current["envelope"]["event_id"])
        else:
            state.extra_dispatches.append(record["envelope"]["event_id"])
        state.extra_dispatches.sort()

    def outputs(self, state: StepState) -> list[tuple[str, dict[str, Any]]]:
        """The current derived records of the step; empty until its dispatch has arrived."""
        if state.dispatch is None:
            return []
        woven = self.woven_reward(state)
        records: list[tuple[str, dict[str, Any]]] = []
        if woven is not None:
            records.append(("treadle.derived.WovenReward", woven))
        records.append(("treadle.derived.Transition", self.transition(state, woven)))
        return records

    def components(self, state: StepState) -> list[dict[str, Any]]:
        return [
            {
                "event_id": event_id,
                "source": r["source"],
                "name": r["name"],
                "value": float(r["value"]),
                "confidence": float(r["confidence"]),
                "weight": 1.0,
                "annotator": r["annotator"],
                "event_time": r["envelope"]["event_time"],
            }
            for event_id, r in sorted(state.rewards.items())
        ]

    def woven_reward(self, state: StepState) -> dict[str, Any] | None:
        components = self.components(state)
        fused = self.fusion.fuse(components)
        if fused is None or state.dispatch is None:
            return None
        for c in components:
            c["weight"] = fused.weights[c["event_id"]]
        env = state.dispatch["envelope"]
        return {
            "logical_event_id": state.logical_event_id,
            "session_id": env["session_id"],
            "episode_id": env["episode_id"],
            "step": state.dispatch["step"],
            "revision": len(components),
            "value": fused.value,
            "status": fused.status,
            "fusion": self.fusion.name,
            "policy_version": env["policy_version"],
            "components": components,
            "woven_at": max(c["event_time"] for c in components),
        }

    def transition(self, state: StepState, woven: dict[str, Any] | None) -> dict[str, Any]:
        dispatch = state.dispatch
        assert dispatch is not None
        env = dispatch["envelope"]
        result = max(state.results.values(), key=_order_key) if state.results else None
        times = [env["event_time"]]
        times += [r["envelope"]["event_time"] for r in state.results.values()]
        times += [r["envelope"]["event_time"] for r in state.rewards.values()]
        return {
            "session_id": env["session_id"],
            "step": dispatch["step"],
            "logical_event_id": state.logical_event_id,
            "revision": state.revision,
            "agent_id": env["agent_id"],
            "episode_id": env["episode_id"],
            "trace_id": env["trace_id"],
            "policy_version": env["policy_version"],
            "tool": dispatch["tool"],
            "params_json": dispatch["params_json"],
            "dispatched_at": env["event_time"],
            "tool_status": result["status"] if result else None,
            "output": result["output"] if result else None,
            "error": result["error"] if result else None,
            "latency_ms": float(result["latency_ms"]) if result else None,
            "cost_usd": float(result["cost_usd"]) if result else 0.0,
            "tokens_in": result["tokens_in"] if result else 0,
            "tokens_out": result["tokens_out"] if result else 0,
            "result_at": result["envelope"]["event_time"] if result else None,
            "reward": woven["value"] if woven else None,
            "reward_status": woven["status"] if woven else "pending",
            "reward_revision": woven["revision"] if woven else 0,
            "reward_components": woven["components"] if woven else [],
            "updated_at": max(times),
        }


def _order_key(record: dict[str, Any]) -> tuple[int, str]:
    env = record["envelope"]
    return (env["seq"], env["event_id"])
