"""treadle: the data plane for agentic reinforcement learning.

The public API. Agents emit with `AgentStream` (or `AgentStreamSync`) and await their steps' `Outcome`s, reward
sources emit with `RewardEmitter`, trainers read replay data back with `treadle.replay` (the sink extra); plugin
authors implement `EventProcessor`, publish `reward_signal(...)` and `metric_record(...)` records, and test with
`treadle.testing`. Planners submit plans of `Subgoal`s (`AgentStream.submit_plan`) that `Executor`s run. Everything
else is internal and may move.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from processors.evaluation import metric_record
from processors.rewards import reward_signal
from streams.sdk import (
    Annotator,
    Edge,
    EventTooLargeError,
    FailedEvent,
    Fallback,
    LifecycleKind,
    Node,
    Outcome,
    ProducerError,
    ResourceProfile,
    RetryPolicy,
    RewardEmitter,
    RewardEmitterSync,
    SpoolFullError,
    StepRef,
    StreamError,
    Subgoal,
    SubgoalWork,
    ToolCall,
    ToolStatus,
)
from topics.plan_checks import PlanRefused
from topics.settings import Settings
from topics.tool_schemas import InvalidParamsError, ToolSchemas
from treadle.agent import AgentStream, AgentStreamSync
from treadle.executor import AttemptContext, Executor, ExecutorConfig

if TYPE_CHECKING:
    from streams.runtime.processor import EventProcessor, InputEvent, ProcessingContext

__all__ = [
    "AgentStream",
    "AgentStreamSync",
    "Annotator",
    "AttemptContext",
    "Edge",
    "EventProcessor",
    "EventTooLargeError",
    "Executor",
    "ExecutorConfig",
    "FailedEvent",
    "Fallback",
    "InputEvent",
    "InvalidParamsError",
    "LifecycleKind",
    "Node",
    "Outcome",
    "PlanRefused",
    "ProcessingContext",
    "ProducerError",
    "ResourceProfile",
    "RetryPolicy",
    "RewardEmitter",
    "RewardEmitterSync",
    "Settings",
    "SpoolFullError",
    "StepRef",
    "StreamError",
    "Subgoal",
    "SubgoalWork",
    "ToolCall",
    "ToolSchemas",
    "ToolStatus",
    "metric_record",
    "reward_signal",
]

# The plugin interface needs the worker extra (Faust); the SDK alone must import without it.
_WORKER_EXPORTS = {"EventProcessor", "InputEvent", "ProcessingContext"}


def __getattr__(name: str) -> Any:
    if name in _WORKER_EXPORTS:
        from streams.runtime import processor

        return getattr(processor, name)
    raise AttributeError(f"module 'treadle' has no attribute {name!r}")
