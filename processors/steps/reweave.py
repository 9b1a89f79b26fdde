"""Re-weaving: the final rows of past steps under a reward policy, from their events, with the live worker's core.

The live worker folds each event into its step as it arrives and settles the step's windows as the watermark moves
(StepProcessor); a step's rows are a function of the *set* of its events and its policy, and its final rows are the
ones it has once every event is in and the watermark has passed every window (StepAssembler's docstring). For the
past that moment has come: re-weaving folds every event of a step with the same StepAssembler.fold, settles with
the watermark at +infinity (every window passed, so the rows are final, never `pending`) and takes
StepAssembler.outputs. With the live policy this is exactly the live worker's final rows (highest revision), whatever
order the events arrived in; the intermediate revisions the worker published on the way are timing, not content.

What cannot be reproduced from the events alone, and so differs from the live rows by design:
- `rolling_mean` imputation: the live value is the mean of what that worker had seen when the window passed;
  re-weaving takes the mean of the source's last `rolling_count` rewards among the re-woven events
  (docs/reward-weaving.md says the same of replays);
- ORPHAN_RESOLVED late-rewards rows: whether a reward waited past the orphan wait for its dispatch is arrival
  timing. A re-weave weaves it (as the live worker did in the end) and writes no late row for it; a reward whose
  dispatch never came is an ORPHAN in both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from processors.steps.assembler import STEP_INPUTS, StepAssembler, StepState, is_episode_reward
from processors.steps.policy import Imputation, PolicyBook, RewardPolicy
from processors.steps.recent_values import RecentValues
from topics.names import LATE_REWARD

END_OF_TIME_US = 2**63 - 1  # the watermark once every window of the past has passed

Row = tuple[str, dict[str, Any]]  # (schema name, record): what the live worker publishes


@dataclass(slots=True)
class Reweave:
    """The final rows of the re-woven steps, in the live worker's record shapes."""

    rows: list[Row] = field(default_factory=list)
    steps: int = 0  # steps with a dispatch (each has one Transition row)
    events: int = 0  # step events folded (duplicates by event_id count once)
    orphans: int = 0  # rewards whose step never had a dispatch


def policy_book(policy: RewardPolicy) -> PolicyBook:
    """A book where `policy` applies to every step, whatever its dispatch time: a re-weave asks "what if this
    policy had always been the one"."""
    return PolicyBook([policy.model_copy(update={"effective_from_us": 0})])


def reweave(events: Iterable[tuple[str, dict[str, Any]]], policies: PolicyBook) -> Reweave:
    """The final rows of every step among `events` ((schema name, record) of dispatches, tool results and rewards;
    other records and episode rewards are skipped, as the live step processor skips them)."""
    assembler = StepAssembler(policies)
    states: dict[str, StepState] = {}
    result = Reweave()
    for schema_name, record in events:
        if schema_name not in STEP_INPUTS or is_episode_reward(schema_name, record):
            continue
        lid = record["envelope"]["logical_event_id"]
        state = states.get(lid)
        if state is None:
            state = states[lid] = StepState(lid)
        if assembler.fold(state, schema_name, record):
            result.events += 1
    recent = _recent_values(policies, states.values())
    for lid in sorted(states):
        state = states[lid]
        if state.dispatch is None:
            for event_id in sorted(state.rewards):
                result.rows.append((LATE_REWARD, assembler.orphan(state, event_id)))
                result.orphans += 1
            continue
        assembler.settle_windows(state, END_OF_TIME_US, recent)
        result.rows += assembler.outputs(state)
        result.steps += 1
    return result


def _recent_values(policies: PolicyBook, states: Iterable[StepState]) -> RecentValues | None:
    """For rolling-mean imputation: the rewards of the re-woven steps, in event-time order (the live worker's values
    depend on what it had seen; see the module docstring)."""
    if not policies.imputes_rolling_means:
        return None
    recent = RecentValues()
    rewards = sorted(
        (r["envelope"]["event_time"], r["envelope"]["event_id"], r) for s in states for r in s.rewards.values()
    )
    for _, _, reward in rewards:
        policy = policies.for_dispatch(reward["envelope"]["event_time"])
        spec = policy.spec_for(reward["source"], reward["name"])
        if spec.imputation is Imputation.ROLLING_MEAN:
            recent.add(spec.key, float(reward["value"]), spec.rolling_count)
    return recent
