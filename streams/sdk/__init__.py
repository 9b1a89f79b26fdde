"""The agent-facing SDK: emit dispatches, tool results, rewards, state deltas and lifecycle events.

`AgentStream` is what an agent loop uses, `RewardEmitter` what a reward source that only knows a step's id uses;
`AgentStreamSync` and `RewardEmitterSync` are their blocking twins. Users import them from `treadle`.
"""

from streams.sdk.llm_calls import LlmCallFields
from streams.sdk.outcomes import Outcome
from streams.sdk.plans import Fallback, ResourceProfile, RetryPolicy, Subgoal, SubgoalWork
from streams.sdk.rewards import RewardEmitter
from streams.sdk.spool import SpoolFullError
from streams.sdk.stream import AgentStream
from streams.sdk.sync import AgentStreamSync, RewardEmitterSync
from streams.sdk.types import (
    DEFAULT_DELIVERY_TIMEOUT_S,
    Annotator,
    Edge,
    EventTooLargeError,
    FailedEvent,
    LifecycleKind,
    Node,
    ProducerError,
    StepRef,
    StreamError,
    ToolCall,
    ToolStatus,
)
from topics.tool_schemas import InvalidParamsError

__all__ = [
    "DEFAULT_DELIVERY_TIMEOUT_S",
    "AgentStream",
    "AgentStreamSync",
    "Annotator",
    "Edge",
    "EventTooLargeError",
    "FailedEvent",
    "Fallback",
    "InvalidParamsError",
    "LifecycleKind",
    "LlmCallFields",
    "Node",
    "Outcome",
    "ProducerError",
    "ResourceProfile",
    "RetryPolicy",
    "RewardEmitter",
    "RewardEmitterSync",
    "SpoolFullError",
    "StepRef",
    "StreamError",
    "Subgoal",
    "SubgoalWork",
    "ToolCall",
    "ToolStatus",
]
