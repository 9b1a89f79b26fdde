"""Credit assignment: spread an episode-level reward over the episode's steps by a named rule.

An episode-level reward is either
- a RewardSignal whose envelope.attributes has scope=episode (its logical_event_id is then the episode_id), or
- the `reward` of an EPISODE_ENDED LifecycleEvent (named "return").

Rules (pure functions below), for an episode of T steps, step t = 0..T-1 in step order, reward R:
- `terminal`: R to the last step, 0 to the others;
- `uniform`: R/T to each step;
- `discounted`: gamma**(T-1-t) * R, the discounted terminal reward seen from step t (the return-to-go of a
  reward paid at the end). It is not normalised: the shares sum to R only when gamma = 1.
The deployment picks the rule (TREADLE_CREDIT_RULE, TREADLE_CREDIT_GAMMA); a reward overrides it with the envelope
attributes credit_rule=... and gamma=....

Determinism: an episode is credited only once it is complete: its EPISODE_ENDED with `steps` = T has been seen and
so have T of its dispatches (ActionDispatched.step counts per session, so the episode's steps are its dispatches
in (step, logical_event_id) order). At that moment the T steps are frozen; every episode reward, whenever it
arrives, is spread over exactly those steps with the rule resolved when the reward was first folded. Each share is
a RewardSignal (source "credit") whose event_id is a uuid5 of (episode reward id, step logical_event_id), so
replays and duplicates re-emit identical events and the step assembler folds each once. Consequences: changing the
deployment's rule affects rewards folded afterwards only; dispatches beyond T, or a second EPISODE_ENDED, are a
producer error: the earliest end (by seq, event_id) and the T lowest steps win until the episode is frozen,
after which they are ignored. An EPISODE_ENDED without `steps` never completes (its rewards wait).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from topics.names import DISPATCH, LIFECYCLE, REWARD

CREDIT_INPUTS = (DISPATCH, LIFECYCLE, REWARD)

CREDIT_SOURCE = "credit"
LIFECYCLE_REWARD_NAME = "return"
EPISODE_ENDED = "EPISODE_ENDED"
SCOPE_ATTRIBUTE, EPISODE_SCOPE = "scope", "episode"
RULE_ATTRIBUTE, GAMMA_ATTRIBUTE = "credit_rule", "gamma"
CREDIT_OF_ATTRIBUTE = "credit_of"  # on a credit signal: the event_id of the episode reward it is a share of
_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "treadle:credit")


class CreditRule(StrEnum):
    TERMINAL = "terminal"
    UNIFORM = "uniform"
    DISCOUNTED = "discounted"


def terminal(total: float, steps: int) -> list[float]:
    """All of the reward to the last step."""
    return [0.0] * (steps - 1) + [total] if steps > 0 else []


def uniform(total: float, steps: int) -> list[float]:
    """An equal share, total / steps, to each step."""
    return [total / steps] * steps if steps > 0 else []


def discounted(total: float, steps: int, gamma: float) -> list[float]:
    """Step t gets gamma**(steps-1-t) * total: the discounted terminal reward, not normalised."""
    return [gamma ** (steps - 1 - t) * total for t in range(steps)]


@dataclass(frozen=True)
class RuleChoice:
    """A rule and its gamma (used by `discounted` only)."""

    rule: CreditRule = CreditRule.DISCOUNTED
    gamma: float = 0.99

    def __post_init__(self) -> None:
        if not (0.0 <= self.gamma <= 1.0):
            raise ValueError(f"credit gamma must be in [0, 1], got {self.gamma}")

    def shares(self, total: float, steps: int) -> list[float]:
        if self.rule is CreditRule.TERMINAL:
            return terminal(total, steps)
        if self.rule is CreditRule.UNIFORM:
            return uniform(total, steps)
        return discounted(total, steps, self.gamma)

    def describe(self) -> str:
        return f"discounted(gamma={self.gamma!r})" if self.rule is CreditRule.DISCOUNTED else str(self.rule)

    def attributes(self) -> dict[str, str]:
        attrs = {RULE_ATTRIBUTE: str(self.rule)}
        if self.rule is CreditRule.DISCOUNTED:
            attrs[GAMMA_ATTRIBUTE] = repr(self.gamma)
        return attrs

    def overridden(self, attributes: Mapping[str, str]) -> RuleChoice:
        """This choice as a reward's credit_rule / gamma attributes override it; ValueError when they are invalid."""
        name = attributes.get(RULE_ATTRIBUTE, self.rule)
        try:
            rule = CreditRule(name)
        except ValueError:
            raise ValueError(f"unknown credit_rule {name!r}; expected one of {', '.join(CreditRule)}") from None
        gamma = self.gamma
        if GAMMA_ATTRIBUTE in attributes:
            try:
                gamma = float(attributes[GAMMA_ATTRIBUTE])
            except ValueError:
                raise ValueError(f"gamma attribute {attributes[GAMMA_ATTRIBUTE]!r} is not a number") from None
        return RuleChoice(rule, gamma)


def credit_event_id(reward_event_id: str, logical_event_id: str) -> str:
    """The id of the credit signal for one step: the same for every replay."""
    return str(uuid.uuid5(_ID_NAMESPACE, f"{reward_event_id}/{logical_event_id}"))


def episode_of(schema_name: str, record: dict[str, Any]) -> tuple[str, str] | None:
    """(session_id, episode_id) of an event that matters to credit, None for the rest."""
    env = record["envelope"]
    if schema_name == DISPATCH:
        return env["session_id"], env["episode_id"]
    if schema_name == LIFECYCLE:
        return (env["session_id"], env["episode_id"]) if record["kind"] == EPISODE_ENDED else None
    if schema_name == REWARD:
        scoped = (env.get("attributes") or {}).get(SCOPE_ATTRIBUTE) == EPISODE_SCOPE
        return (env["session_id"], env["logical_event_id"]) if scoped else None
    return None


def episode_key(session_id: str, episode_id: str) -> bytes:
    return orjson.dumps([session_id, episode_id])


@dataclass
class EpisodeState:
    """What credit needs of one episode: its dispatches, its end, its episode rewards, and the frozen steps."""

    session_id: str
    episode_id: str
    # logical_event_id -> the dispatch fields a credit signal copies
    dispatches: dict[str, dict[str, Any]] = field(default_factory=dict)
    end: dict[str, Any] | None = None
    rewards: dict[str, dict[str, Any]] = field(default_factory=dict)  # event_id -> reward, rule resolved
    credited: list[str] | None = None  # the T steps, in order, once the episode is complete

    @property
    def event_ids(self) -> set[str]:
        ids = {d["event_id"] for d in self.dispatches.values()} | set(self.rewards)
        if self.end is not None:
            ids.add(self.end["event_id"])
        return ids

    def reward_keys(self) -> list[str]:
        """Every episode reward: scope=episode signals, and the end event when it carries a reward."""
        keys = sorted(self.rewards)
        if self.end is not None and self.end["reward"] is not None:
            keys.append(self.end["event_id"])
        return keys

    def to_bytes(self) -> bytes:
        return orjson.dumps(
            {
                "s": self.session_id,
                "e": self.episode_id,
                "d": self.dispatches,
                "x": self.end,
                "r": self.rewards,
                "c": self.credited,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> EpisodeState:
        doc = orjson.loads(data)
        return cls(doc["s"], doc["e"], doc["d"], doc["x"], doc["r"], doc["c"])


@dataclass(frozen=True)
class Folded:
    changed: bool  # the state must be written
    emit: list[str]  # episode rewards whose credit signals to (re)publish


class EpisodeCredit:
    """Folds dispatches, episode ends and episode rewards into an EpisodeState; builds the credit signals."""

    def __init__(self, default: RuleChoice | None = None) -> None:
        self.default = default or RuleChoice()

    def fold(self, state: EpisodeState, schema_name: str, record: dict[str, Any]) -> Folded:
        """Add one event; a duplicate changes nothing but re-emits every credit (its first emission may be lost)."""
        env = record["envelope"]
        duplicate = env["event_id"] in state.event_ids
        frozen = state.credited is not None
        changed, new_reward = False, None
        if not duplicate:
            if schema_name == DISPATCH:
                changed = not frozen and _add_dispatch(state, record)
            elif schema_name == LIFECYCLE:
                changed = not frozen and self._add_end(state, record)
            elif schema_name == REWARD:
                state.rewards[env["event_id"]] = self._reward(record)
                changed, new_reward = True, env["event_id"]
            else:
                raise ValueError(f"credit does not take {schema_name}")
        if not frozen and _complete(state):
            _freeze(state)
            return Folded(True, state.reward_keys())
        if not frozen:
            return Folded(changed, [])
        if duplicate:
            return Folded(False, state.reward_keys())
        return Folded(changed, [new_reward] if new_reward else [])

    def _reward(self, record: dict[str, Any]) -> dict[str, Any]:
        env = record["envelope"]
        choice = self.default.overridden(env.get("attributes") or {})
        return {
            "name": record["name"],
            "value": float(record["value"]),
            "event_time": env["event_time"],
            "rule": str(choice.rule),
            "gamma": choice.gamma,
        }

    def _add_end(self, state: EpisodeState, record: dict[str, Any]) -> bool:
        env = record["envelope"]
        reward, steps = record.get("reward"), record.get("steps")
        if reward is not None and not math.isfinite(reward):
            raise ValueError(f"EPISODE_ENDED reward must be finite, got {reward}")
        if steps is not None and steps < 0:
            raise ValueError(f"EPISODE_ENDED steps must be >= 0, got {steps}")
        choice = self.default.overridden(env.get("attributes") or {})
        end = {
            "event_id": env["event_id"],
            "seq": env["seq"],
            "event_time": env["event_time"],
            "steps": steps,
            "reward": reward,
            "rule": str(choice.rule),
            "gamma": choice.gamma,
        }
        if state.end is not None and _order(state.end) <= _order(end):
            return False
        state.end = end
        return True

    def records(self, state: EpisodeState, reward_key: str) -> list[dict[str, Any]]:
        """The credit signals of one episode reward, one per frozen step; empty before the episode is complete."""
        if state.credited is None:
            return []
        if reward_key in state.rewards:
            reward = state.rewards[reward_key]
        else:
            assert state.end is not None and state.end["event_id"] == reward_key
            reward = {**state.end, "name": LIFECYCLE_REWARD_NAME, "value": state.end["reward"]}
        choice = RuleChoice(CreditRule(reward["rule"]), reward["gamma"])
        steps = len(state.credited)
        evidence = f"{choice.describe()} of {reward_key} over {steps} steps"
        attributes = {**choice.attributes(), CREDIT_OF_ATTRIBUTE: reward_key}
        out = []
        for lid, share in zip(state.credited, choice.shares(reward["value"], steps), strict=True):
            dispatch = state.dispatches[lid]
            envelope = {
                "event_id": credit_event_id(reward_key, lid),
                "session_id": state.session_id,
                "agent_id": dispatch["agent_id"],
                "episode_id": state.episode_id,
                "logical_event_id": lid,
                "seq": dispatch["seq"],
                "event_time": reward["event_time"],
                "policy_version": dispatch["policy_version"],
                "trace_id": dispatch["trace_id"],
                "attributes": dict(attributes),
            }
            out.append(
                {
                    "envelope": envelope,
                    "source": CREDIT_SOURCE,
                    "name": reward["name"],
                    "value": share,
                    "confidence": 1.0,
                    "annotator": "CODE",
                    "evidence": evidence,
                }
            )
        return out


def _order(item: dict[str, Any]) -> tuple[int, str]:
    return item["seq"], item["event_id"]


def _add_dispatch(state: EpisodeState, record: dict[str, Any]) -> bool:
    env = record["envelope"]
    entry = {
        "event_id": env["event_id"],
        "step": record["step"],
        "seq": env["seq"],
        "agent_id": env["agent_id"],
        "policy_version": env["policy_version"],
        "trace_id": env["trace_id"],
    }
    current = state.dispatches.get(env["logical_event_id"])
    if current is not None and _order(current) <= _order(entry):  # two dispatches of one step: earliest wins
        return False
    state.dispatches[env["logical_event_id"]] = entry
    return True


def _complete(state: EpisodeState) -> bool:
    steps = state.end["steps"] if state.end is not None else None
    return steps is not None and len(state.dispatches) >= steps


def _freeze(state: EpisodeState) -> None:
    assert state.end is not None
    ordered = sorted(state.dispatches, key=lambda lid: (state.dispatches[lid]["step"], lid))
    state.credited = ordered[: state.end["steps"]]
    state.dispatches = {lid: state.dispatches[lid] for lid in state.credited}
