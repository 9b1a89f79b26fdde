"""Step assembly and reward weaving: a step's dispatch, tool results and rewards become its rows.

How a StepState is stored: processors/steps/state_codec.py.

What a step's rows say is a pure function of the *set* of events seen and the reward policy, never
of their arrival order, so a replay after a crash ends in exactly the rows of an uninterrupted run:
- a result or reward that arrives before its dispatch waits in the step's state;
- duplicates (same event_id) change nothing; they re-emit the current rows, in case a crash lost
  the first emission, unless this process has emitted them itself (then a crash would have restarted it);
- a reward is *late* when its event_time is after dispatch + window + grace of its source (event
  time, see processors/steps/policy.py): it goes to late rewards, never into the step;
- the first WovenReward comes once every required source has a reward in time, or once the
  watermark has passed the window of every required source still missing (status `partial`, or
  `imputed` where the spec imputes a value); every later reward in time is a new revision. Only
  *when* that happens depends on the watermark, not what is finally emitted;
- Transition.revision counts the distinct events in the step (dispatch, results, rewards in
  time) plus a window term: the number of required sources once none is waiting any more (each
  is in, or its window passed), else the required windows the watermark has passed while their
  source was missing. WovenReward.revision counts its rewards in time. Every change raises them,
  and the final rows (all events in, all windows passed) have the highest revision, whatever the
  timing, so they win in ReplacingMergeTree. A window passing over a source that is already in
  changes nothing, so it needs no timer, no write and no new revision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from processors.steps.fusion import Component, fuse
from processors.steps.policy import Imputation, PolicyBook, RewardPolicy, RewardSpec, seconds_to_us
from processors.steps.recent_values import RecentValues
from topics.names import DISPATCH, LATE_REWARD, REWARD, TOOL_RESULT, TRANSITION, WOVEN_REWARD

STEP_INPUTS = (DISPATCH, TOOL_RESULT, REWARD)


@dataclass(slots=True)  # one per step, ~10,000 kept parsed: no per-instance __dict__ to build, read and free
class StepState:
    """Everything known about one step (one logical_event_id) so far; stored in the step table."""

    logical_event_id: str
    dispatch: dict[str, Any] | None = None
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    rewards: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra_dispatches: list[str] = field(default_factory=list)
    partition: int | None = None  # of the session, so timers can find the step again after a restart
    reward_policy: str | None = None  # version, fixed when the dispatch is folded
    passed: list[str] = field(default_factory=list)  # required spec keys whose window passed while it was missing
    imputed: dict[str, float] = field(default_factory=dict)  # spec key -> value, fixed when its window passed
    orphans: list[str] = field(default_factory=list)  # rewards reported as orphans (no dispatch in time)
    # event_id -> the Avro bytes the event arrived with, where the worker has them: storing the state then encodes
    # nothing again (processors/steps/state_codec.py). A cache, never part of what the state says.
    raw: dict[str, bytes] = field(default_factory=dict, compare=False, repr=False)
    # Whether this process published every row of the step as it stands (never stored: a step read from the table
    # has not been). A duplicate then has nothing to re-emit (processors/steps/processor.py, publishes_all).
    emitted: bool = field(default=False, compare=False, repr=False)

    @property
    def event_ids(self) -> set[str]:
        ids = set(self.results) | set(self.rewards) | set(self.extra_dispatches)
        if self.dispatch is not None:
            ids.add(self.dispatch["envelope"]["event_id"])
        return ids

    def has_event(self, event_id: str) -> bool:
        """event_id in event_ids, without building the set (asked for every event folded)."""
        return (
            event_id in self.results
            or event_id in self.rewards
            or (self.dispatch is not None and self.dispatch["envelope"]["event_id"] == event_id)
            or event_id in self.extra_dispatches
        )

    @property
    def session_key(self) -> bytes:
        """The Kafka key of every row of the step: its session."""
        any_event = self.dispatch or next(iter(self.rewards.values()), None) or next(iter(self.results.values()))
        return any_event["envelope"]["session_id"].encode()

    @property
    def dispatched_us(self) -> int | None:
        return None if self.dispatch is None else self.dispatch["envelope"]["event_time"]


@dataclass(slots=True)  # not frozen: built for every step touched, and frozen costs ~4x (never change one)
class Weave:
    """How a step's rewards stand under its policy (derived, never stored)."""

    on_time: list[tuple[str, dict[str, Any], RewardSpec]]  # (event_id, reward, spec), by event_id
    late: list[tuple[str, dict[str, Any], RewardSpec, int]]  # (event_id, reward, spec, lateness in us)
    missing: list[RewardSpec]  # required specs without a reward in time
    waiting: list[RewardSpec]  # missing specs whose window the watermark has not passed yet
    next_window_us: int | None  # end of the first waiting window: when passing it changes the rows


class StepAssembler:
    """Folds input events into a StepState and derives the step's rows under its reward policy."""

    def __init__(self, policies: PolicyBook | None = None) -> None:
        self.policies = policies or PolicyBook()
        self._specs: dict[tuple[str, str, str], RewardSpec] = {}  # (policy version, source, name) -> spec
        self._latest_deadline_us: dict[str, int] = {}  # policy version -> its latest window + grace

    def spec_for(self, policy: RewardPolicy, source: str, name: str) -> RewardSpec:
        """policy.spec_for, remembered: policy versions are immutable and this runs for every reward."""
        key = (policy.version, source, name)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = policy.spec_for(source, name)
        return spec

    # --- folding -------------------------------------------------------------------------------------------------

    def fold(self, state: StepState, schema_name: str, record: dict[str, Any], raw: bytes | None = None) -> bool:
        """Add one event to the step; False when it was already folded in (a duplicate) or is not the step's.
        `raw`: the event's single-object Avro bytes, if the caller has them (kept to store the state)."""
        event_id = record["envelope"]["event_id"]
        if state.has_event(event_id) or is_episode_reward(schema_name, record):
            return False
        if schema_name == DISPATCH:
            self._add_dispatch(state, record)
        elif schema_name == TOOL_RESULT:
            state.results[event_id] = record
        elif schema_name == REWARD:
            state.rewards[event_id] = record
        else:
            raise ValueError(f"step assembler does not take {schema_name}")
        if raw is not None and (schema_name != DISPATCH or state.dispatch is record):
            state.raw[event_id] = raw
        return True

    def _add_dispatch(self, state: StepState, record: dict[str, Any]) -> None:
        # Two dispatches for one step is a producer bug; the earliest (seq, event_id) wins either way.
        current = state.dispatch
        if current is None or _order_key(record) < _order_key(current):
            state.dispatch = record
            if current is not None:
                state.extra_dispatches.append(current["envelope"]["event_id"])
                state.raw.pop(current["envelope"]["event_id"], None)
        else:
            state.extra_dispatches.append(record["envelope"]["event_id"])
        state.extra_dispatches.sort()
        state.reward_policy = self.policies.for_dispatch(state.dispatch["envelope"]["event_time"]).version

    def policy_of(self, state: StepState) -> RewardPolicy:
        if state.reward_policy is not None:
            return self.policies.get(state.reward_policy)
        anchor = state.dispatched_us if state.dispatched_us is not None else 0
        return self.policies.for_dispatch(anchor)

    # --- weaving -------------------------------------------------------------------------------------------------

    def weave(self, state: StepState) -> Weave:
        policy = self.policy_of(state)
        dispatched = state.dispatched_us
        on_time, late = [], []
        present: set[tuple[str, str]] = set()  # (source, name) of the rewards in time
        for event_id, reward in sorted(state.rewards.items()):
            source, name = reward["source"], reward["name"]
            spec = self.spec_for(policy, source, name)
            if dispatched is not None:  # else undecided until the dispatch comes
                lateness = reward["envelope"]["event_time"] - (dispatched + spec.deadline_us)
                if lateness > 0:
                    late.append((event_id, reward, spec, lateness))
                    continue
            on_time.append((event_id, reward, spec))
            present.add((source, name))
        sources = {source for source, _ in present}
        missing = [s for s in policy.required if not _present(s, sources, present)]
        waiting = [s for s in missing if s.key not in state.passed]
        ends = [s.window_us for s in waiting]
        next_window = dispatched + min(ends) if ends and dispatched is not None else None
        return Weave(on_time, late, missing, waiting, next_window)

    def pass_windows(self, state: StepState, watermark_us: int, recent: RecentValues | None = None) -> bool:
        """Mark the windows of missing sources the watermark passed, imputing where the spec says; True if any.

        Only a missing source's window changes the rows (partial or imputed): passing the window of a source
        already in changes nothing, so it is not recorded (see the revision in the module docstring).
        """
        return self.settle_windows(state, watermark_us, recent)[0]

    def settle_windows(
        self, state: StepState, watermark_us: int, recent: RecentValues | None = None
    ) -> tuple[bool, Weave | None]:
        """pass_windows, and the weave it made to find what is due when nothing was: the state is as it was, so a
        caller about to weave it takes this one (a step whose windows passed with its sources in would be woven
        twice for every change)."""
        if state.dispatch is None:
            return False, None
        dispatched = state.dispatch["envelope"]["event_time"]
        passed = state.passed
        if all(
            spec.key in passed or dispatched + spec.window_us > watermark_us for spec in self.policy_of(state).required
        ):
            # No unrecorded required window has passed: nothing can be due, skip the weave (this runs for every
            # step a batch touches). Windows of sources already in are never recorded, so after they pass, the
            # weave below runs and finds nothing due.
            return False, None
        weave = self.weave(state)
        due = [spec for spec in weave.waiting if dispatched + spec.window_us <= watermark_us]
        if not due:
            return False, weave
        for spec in due:
            state.passed.append(spec.key)
            if spec.imputation is Imputation.DEFAULT:
                state.imputed[spec.key] = float(spec.default_value)  # type: ignore[arg-type]
            elif spec.imputation is Imputation.ROLLING_MEAN and recent is not None:
                mean = recent.mean(spec.key, spec.rolling_count)  # the step's own spec's count
                if mean is not None:
                    state.imputed[spec.key] = mean
        state.passed.sort()
        return True, None

    # --- rows ----------------------------------------------------------------------------------------------------

    def next_window_us(self, state: StepState, weave: Weave | None = None) -> int | None:
        """When the step next needs the watermark: the end of the first window of a required source still missing
        (passing it changes the rows: partial or imputed); None when no source is waiting. `weave`: the state's, if
        the caller has it already."""
        if state.dispatch is None:
            return None
        return (weave or self.weave(state)).next_window_us

    def horizon_us(self, state: StepState) -> int:
        """Event time after which no reward can be woven into the step any more: the latest deadline of its
        policy (unknown sources get the default window and grace); with no dispatch, its latest orphan deadline."""
        if state.dispatch is not None:
            policy = self.policy_of(state)
            latest = self._latest_deadline_us.get(policy.version)
            if latest is None:
                deadlines = [spec.deadline_s for spec in policy.specs]
                deadlines.append(policy.default_window_s + policy.default_grace_s)
                latest = self._latest_deadline_us[policy.version] = seconds_to_us(max(deadlines))
            return state.dispatch["envelope"]["event_time"] + latest
        events = [*state.rewards.values(), *state.results.values()]
        return max(self.orphan_deadline_us(event) for event in events)

    def outputs(self, state: StepState, weave: Weave | None = None) -> list[tuple[str, dict[str, Any]]]:
        """The step's current rows: late rewards, then its woven reward (once due), then its transition."""
        if state.dispatch is None:
            return []
        weave = weave or self.weave(state)
        records = self.late_rows(state, weave)
        woven = self.woven_reward(state, weave)
        if woven is not None:
            records.append((WOVEN_REWARD, woven))
        records.append((TRANSITION, self.transition(state, weave, woven)))
        return records

    def late_rows(self, state: StepState, weave: Weave) -> list[tuple[str, dict[str, Any]]]:
        """The step's late-rewards rows: rewards after grace, and orphans its dispatch came for after all."""
        records: list[tuple[str, dict[str, Any]]] = [
            (LATE_REWARD, self.late_reward(state, event_id, reward, spec, lateness))
            for event_id, reward, spec, lateness in weave.late
        ]
        records += [
            (LATE_REWARD, self.resolved_orphan(state, event_id, reward, spec))
            for event_id, reward, spec in weave.on_time
            if event_id in state.orphans
        ]
        return records

    def components(self, state: StepState, weave: Weave) -> list[Component]:
        dispatched = state.dispatched_us
        assert dispatched is not None
        components = [
            Component(
                event_id=event_id,
                source=r["source"],
                name=r["name"],
                value=float(r["value"]),
                confidence=float(r["confidence"]),
                weight=spec.weight,
                annotator=r["annotator"],
                attributes=r["envelope"].get("attributes") or {},
                evidence=r.get("evidence"),
                # in grace: how far past its window (event time) the reward came
                lateness_ms=max(0, r["envelope"]["event_time"] - dispatched - spec.window_us) // 1000,
                event_time=r["envelope"]["event_time"],
            )
            for event_id, r, spec in weave.on_time
        ]
        if not weave.waiting:
            components += [
                Component(
                    event_id=f"imputed:{spec.key}",
                    source=spec.source,
                    name=spec.name,
                    value=state.imputed[spec.key],
                    confidence=1.0,
                    weight=spec.weight,
                    evidence=f"{spec.imputation} imputation: no {spec.key} reward within {spec.window_s:g} s",
                    imputed=True,
                    event_time=dispatched + spec.window_us,
                )
                for spec in weave.missing
                if spec.key in state.imputed
            ]
        return components

    def woven_reward(self, state: StepState, weave: Weave) -> dict[str, Any] | None:
        if state.dispatch is None or weave.waiting:
            return None  # still waiting for a required source
        policy = self.policy_of(state)
        fused = fuse(self.components(state, weave), policy.fusion)
        if fused is None:
            return None
        if not weave.missing:
            status = "complete"
        elif any(spec.key in state.imputed for spec in weave.missing):
            status = "imputed"
        else:
            status = "partial"
        env = state.dispatch["envelope"]
        return {
            "logical_event_id": state.logical_event_id,
            "session_id": env["session_id"],
            "episode_id": env["episode_id"],
            "step": state.dispatch["step"],
            "revision": len(weave.on_time),
            "value": fused.value,
            "status": status,
            "fusion": policy.fusion.name,
            "policy_version": env["policy_version"],
            "reward_policy_version": policy.version,
            "components": fused.component_records(),
            **fused.explanation(),
            "woven_at": max(c.component.event_time for c in fused.contributions),
        }

    def transition(self, state: StepState, weave: Weave, woven: dict[str, Any] | None) -> dict[str, Any]:
        dispatch = state.dispatch
        assert dispatch is not None
        env = dispatch["envelope"]
        result = max(state.results.values(), key=_order_key) if state.results else None
        times = [env["event_time"]]
        times += [r["envelope"]["event_time"] for r in state.results.values()]
        times += [r["envelope"]["event_time"] for _, r, _ in weave.on_time]
        # Once no source is waiting, the window term is final (every required window counts as passed).
        windows = len(state.passed) if weave.waiting else len(self.policy_of(state).required)
        if woven is not None:
            reward_status = woven["status"]
        else:
            reward_status = "partial" if weave.missing and not weave.waiting else "pending"
        return {
            "session_id": env["session_id"],
            "step": dispatch["step"],
            "logical_event_id": state.logical_event_id,
            "revision": 1 + len(state.extra_dispatches) + len(state.results) + len(weave.on_time) + windows,
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
            "reward_status": reward_status,
            "reward_revision": woven["revision"] if woven else 0,
            "reward_components": woven["components"] if woven else [],
            "updated_at": max(times),
            "truncated_bytes": 0,  # processors/output_size.py cuts output/params_json/error if the row would not fit
        }

    # --- late rewards --------------------------------------------------------------------------------------------

    def late_reward(
        self, state: StepState, event_id: str, reward: dict[str, Any], spec: RewardSpec, lateness_us: int
    ) -> dict[str, Any]:
        assert state.dispatched_us is not None
        return _late_record(
            reward,
            reason="AFTER_GRACE",
            detail=f"{lateness_us / 1e6:.3f} s after window {spec.window_s:g} s + grace {spec.grace_s:g} s "
            f"of {spec.key} (policy {state.reward_policy})",
            lateness_us=lateness_us,
            deadline_us=state.dispatched_us + spec.deadline_us,
            revision=2 if event_id in state.orphans else 1,
            policy=state.reward_policy or "",
        )

    def resolved_orphan(self, state: StepState, event_id: str, reward: dict[str, Any], spec: RewardSpec) -> dict:
        """An orphan whose dispatch came after all: it is woven now, and its late-rewards row says so."""
        assert state.dispatched_us is not None
        return _late_record(
            reward,
            reason="ORPHAN_RESOLVED",
            detail=f"its dispatch arrived after the orphan wait; woven into step {state.dispatch['step']}",  # type: ignore[index]
            lateness_us=0,
            deadline_us=state.dispatched_us + spec.deadline_us,
            revision=2,
            policy=state.reward_policy or "",
        )

    def orphan_deadline_us(self, event: dict[str, Any]) -> int:
        """When a reward (or tool result) with no dispatch stops waiting for one, in event time."""
        policy = self.policies.for_dispatch(event["envelope"]["event_time"])
        return event["envelope"]["event_time"] + seconds_to_us(policy.orphan_wait_s)

    def orphan(self, state: StepState, event_id: str) -> dict[str, Any]:
        """Report a reward whose dispatch did not come within the orphan wait (marks it in the state)."""
        reward = state.rewards[event_id]
        policy = self.policies.for_dispatch(reward["envelope"]["event_time"])
        if event_id not in state.orphans:
            state.orphans.append(event_id)
            state.orphans.sort()
        return _late_record(
            reward,
            reason="ORPHAN",
            detail=f"no dispatch for logical_event_id {state.logical_event_id} within {policy.orphan_wait_s:g} s",
            lateness_us=seconds_to_us(policy.orphan_wait_s),
            deadline_us=self.orphan_deadline_us(reward),
            revision=1,
            policy=policy.version,
        )


def is_episode_reward(schema_name: str, record: dict[str, Any]) -> bool:
    """Episode-level rewards (attribute scope=episode) judge no single step: credit assignment spreads them."""
    if schema_name != REWARD:
        return False
    attributes = record["envelope"].get("attributes")  # asked twice for every input event: no `or {}` dict
    return attributes is not None and attributes.get("scope") == "episode"


def _late_record(
    reward: dict[str, Any], *, reason: str, detail: str, lateness_us: int, deadline_us: int, revision: int, policy: str
) -> dict[str, Any]:
    env = reward["envelope"]
    return {
        "event_id": env["event_id"],
        "logical_event_id": env["logical_event_id"],
        "session_id": env["session_id"],
        "episode_id": env["episode_id"],
        "agent_id": env["agent_id"],
        "policy_version": env["policy_version"],
        "source": reward["source"],
        "name": reward["name"],
        "value": float(reward["value"]),
        "confidence": float(reward["confidence"]),
        "annotator": reward["annotator"],
        "reason": reason,
        "detail": detail,
        "lateness_ms": lateness_us // 1000,
        "deadline": deadline_us,
        "event_time": env["event_time"],
        "reward_policy_version": policy,
        "revision": revision,
    }


def _present(spec: RewardSpec, sources: set[str], present: set[tuple[str, str]]) -> bool:
    """spec.matches any present (source, name), as set lookups (this runs for every step touched)."""
    return spec.source in sources if spec.name == "*" else (spec.source, spec.name) in present


def _order_key(record: dict[str, Any]) -> tuple[int, str]:
    env = record["envelope"]
    return (env["seq"], env["event_id"])
