"""The names of the event contract's records: one home for every schema name code refers to.

Input records (`treadle.events.*`) are what agents and reward sources write; derived records
(`treadle.derived.*`) are what processors write. The .avsc files define them; code names them here.
"""

from __future__ import annotations

DISPATCH = "treadle.events.ActionDispatched"
TOOL_RESULT = "treadle.events.ToolResult"
REWARD = "treadle.events.RewardSignal"
STATE_DELTA = "treadle.events.StateDelta"
LIFECYCLE = "treadle.events.LifecycleEvent"
LLM_CALL = "treadle.events.LlmCall"

TRANSITION = "treadle.derived.Transition"
WOVEN_REWARD = "treadle.derived.WovenReward"
LATE_REWARD = "treadle.derived.LateReward"
DEAD_LETTER = "treadle.derived.DeadLetter"
STATE_VERSION = "treadle.derived.StateVersion"
EVALUATION_METRIC = "treadle.derived.EvaluationMetric"
RESOURCE_SAMPLE = "treadle.derived.ResourceSample"
CONTRACT_CHECK = "treadle.derived.ContractCheck"
STEP_EVIDENCE = "treadle.derived.StepEvidence"

INPUT_SCHEMAS = (DISPATCH, TOOL_RESULT, REWARD, STATE_DELTA, LIFECYCLE, LLM_CALL)

# Plans as events (docs/plans.md): what submitters and executors write, and what the plans scheduler decides.
PLAN_SUBMITTED = "treadle.events.PlanSubmitted"
SUBGOAL_STATUS = "treadle.events.SubgoalStatus"
EXECUTOR_HEARTBEAT = "treadle.events.ExecutorHeartbeat"
SCHEDULER_ADVICE = "treadle.events.SchedulerAdvice"  # written by the plan_diagnosis evaluator, read back
RELEASE_DELIVERED = "treadle.events.ReleaseDelivered"  # written by the plans processor: a release went out
SUBGOAL_RELEASED = "treadle.derived.SubgoalReleased"
SUBGOAL_RETRIED = "treadle.derived.SubgoalRetried"
SUBGOAL_REROUTED = "treadle.derived.SubgoalRerouted"
SUBGOAL_TIMED_OUT = "treadle.derived.SubgoalTimedOut"
SUBGOAL_ESCALATED = "treadle.derived.SubgoalEscalated"
PLAN_FINISHED = "treadle.derived.PlanFinished"

# The plans scheduler's input is one ordered log (the plan_events topic, all three schemas, one key): capacity is
# shared by every plan, and its decisions must be a function of the log, so the log must have one order.
PLAN_INPUT_SCHEMAS = (PLAN_SUBMITTED, SUBGOAL_STATUS, EXECUTOR_HEARTBEAT, SCHEDULER_ADVICE, RELEASE_DELIVERED)
PLAN_DECISION_SCHEMAS = (
    SUBGOAL_RELEASED, SUBGOAL_RETRIED, SUBGOAL_REROUTED, SUBGOAL_TIMED_OUT, SUBGOAL_ESCALATED, PLAN_FINISHED,
)  # fmt: skip
PLAN_SCHEMAS = PLAN_INPUT_SCHEMAS + PLAN_DECISION_SCHEMAS
PLAN_EVENTS_KEY = "plans"  # the message key of every plan_events record: one partition, one order
