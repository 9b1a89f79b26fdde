"""Self-diagnosis, the pure part: repeated failures of one action, reward variance per action, stalls.

An *action* is a tool (or agent) with its parameters, named by `action_rule(tool, params_hash(params_json))`. Each
detector is a small value with a JSON form (`to_json` / `from_json`), so the plan_diagnosis processor keeps one per
key in a Faust table and a restarted worker goes on where the changelog left it. Everything is event time; nothing
reads a clock. `PlanDiagnosis` is the runtime around them; docs/plans.md has the rules.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

MICROS = 1_000_000


@functools.lru_cache(maxsize=4096)  # every status and failure of a subgoal hashes the same params again
def params_hash(params_json: str) -> str:
    """16 hex digits of SHA-256 over the canonical params (keys sorted, no spaces), so `{"b":1, "a":2}` and
    `{"a": 2, "b": 1}` are one action; text that is not JSON is hashed as it is."""
    try:
        canonical = json.dumps(json.loads(params_json), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except ValueError:
        canonical = params_json
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def action_rule(tool: str, hashed_params: str) -> str:
    """How metrics name an action in their `rule` column: `tool#params_hash`."""
    return f"{tool}#{hashed_params}"


@dataclass
class FailureWindow:
    """The failures of one action within an event-time window, deduplicated by event id.

    `add` returns how many failures fall in `(t - window, t]` for the failure at `t`, counting those that arrived out
    of order too. A failure `window` or more before the newest one is too old to count; those kept are the ones a
    failure still to count could see (less than two windows before the newest). `advised_until` is the end of the
    last advice given, so one burst of failures gives one advice.
    """

    failures: list[tuple[int, str]] = field(default_factory=list)  # (event time, event id), sorted
    advised_until: int = 0

    def add(self, at: int, event_id: str, window_us: int) -> int | None:
        """Count the failure; the failures in its window, or None for one already counted (a replay) or one too
        old to count (before the window of the newest)."""
        if any(eid == event_id for _, eid in self.failures):
            return None
        newest = max(at, self.failures[-1][0]) if self.failures else at
        if at <= newest - window_us:
            return None
        bisect.insort(self.failures, (at, event_id))
        self.failures = [f for f in self.failures if f[0] > newest - 2 * window_us]
        return sum(1 for t, _ in self.failures if at - window_us < t <= at)

    def should_advise(self, count: int, at: int, threshold: int) -> bool:
        """Whether the failure at `at` with `count` in its window calls for (new) advice."""
        return count >= threshold and at >= self.advised_until

    def to_json(self) -> dict[str, Any]:
        return {"failures": [list(f) for f in self.failures], "advised_until": self.advised_until}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FailureWindow:
        return cls([(int(t), str(e)) for t, e in data["failures"]], int(data["advised_until"]))


@dataclass
class RewardVariance:
    """Running mean and variance (Welford) of the rewards one action got, each reward counted once by event id.

    The ids are kept (a replay must not count a reward twice), so the state grows with the samples; `MAX_IDS` bounds
    them: past it the oldest ids are forgotten, and only a replay older than that could count twice.
    """

    MAX_IDS = 1000

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    seen: list[str] = field(default_factory=list)

    def add(self, value: float, event_id: str) -> bool:
        """Count one reward; False for one already counted."""
        if event_id in self.seen:
            return False
        self.n += 1
        delta = value - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (value - self.mean)
        self.seen.append(event_id)
        del self.seen[: -self.MAX_IDS]
        return True

    @property
    def variance(self) -> float:
        """The sample variance (n - 1); 0 below two samples."""
        return self.m2 / (self.n - 1) if self.n > 1 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"n": self.n, "mean": self.mean, "m2": self.m2, "seen": self.seen}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RewardVariance:
        return cls(int(data["n"]), float(data["mean"]), float(data["m2"]), list(data["seen"]))


@dataclass
class Watch:
    """Something that must show a sign of life by `due` (event time): a running subgoal attempt, a dispatched step.

    `tool` and `params_hash` name its action; `judged` is the envelope of the event the stall will be reported
    about (the last sign of life); `since` is when that was.
    """

    due: int
    since: int
    tool: str
    params_hash: str
    judged: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"due": self.due, "since": self.since, "tool": self.tool, "params_hash": self.params_hash,
                "judged": self.judged}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Watch:
        return cls(int(data["due"]), int(data["since"]), data["tool"], data["params_hash"], data["judged"])


def stalled(watches: dict[str, Watch], now: int) -> list[str]:
    """The keys of the watches due at or before `now`, in due order (ties by key): deterministic."""
    return sorted((k for k, w in watches.items() if w.due <= now), key=lambda k: (watches[k].due, k))


def subgoal_action(spec: dict[str, Any], attempt: int, fallback_from: int | None = None) -> tuple[str, str]:
    """(tool or agent, params hash) that attempt `attempt` of a subgoal runs: the subgoal until its fallback takes
    over, which is after `retry.max_attempts` attempts (the scheduler counts attempts on across the reroute), or from
    `fallback_from` when advice rerouted it earlier."""
    max_attempts = int((spec.get("retry") or {}).get("max_attempts", 1))
    first_fallback = min(max_attempts + 1, fallback_from) if fallback_from is not None else max_attempts + 1
    work = spec["fallback"] if spec.get("fallback") is not None and attempt >= first_fallback else spec
    return work_action(work)


def work_action(work: dict[str, Any]) -> tuple[str, str]:
    """(tool or agent, params hash) of a subgoal, its fallback or a released work item."""
    return (work.get("tool") or work.get("agent") or ""), params_hash(work.get("params_json") or "{}")


def severity_of_failures(count: int, threshold: int) -> str:
    """high from twice the threshold, medium from it, low below."""
    return "high" if count >= 2 * threshold else "medium" if count >= threshold else "low"
