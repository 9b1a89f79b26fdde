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
