"""Test a processor plugin's logic in milliseconds, without Kafka, ClickHouse or a worker.

    from treadle.testing import run_sync, tool_result

    ctx = run_sync(MySource(), tool_result(output="hello", latency_ms=120))
    [signal] = ctx.rewards
    assert signal["value"] == 1.0

- Event factories (`dispatch`, `tool_result`, `reward`, `state_delta`, `lifecycle`; `input_event` for a record built
  by hand) make the InputEvents the worker hands a processor: valid by default, every field overridable; one the
  worker would dead-letter raises ValueError instead.
- `RecordingContext` is a ProcessingContext that records what a processor publishes and dead-letters, and checks
  each publish as the worker does (`check_publish`), so a bad record fails the test at the line that made it.
- `run` / `run_sync` hand events to a processor's `process()` with a fresh RecordingContext and return it.

It does not call `setup()` (that needs a Faust app): test stateful processors' logic apart from their tables.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from streams.runtime.metrics import WorkerMetrics
from streams.runtime.processor import EventProcessor, InputEvent, ProcessingContext
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.ids import uuid7
from topics.intake import SourceMessage
from topics.names import DISPATCH, EVALUATION_METRIC, LIFECYCLE, REWARD, STATE_DELTA, TOOL_RESULT
from topics.publish_checks import PublishError, checked_publish, publishable_topics, short_name
from topics.settings import Settings
from topics.validation import InputValidator

__all__ = [
    "BASE_EVENT_TIME",
    "Failure",
    "PublishError",
    "Published",
    "RecordingContext",
    "check_publish",
    "dispatch",
    "input_event",
    "lifecycle",
    "reward",
    "run",
    "run_sync",
    "state_delta",
    "tool_result",
]

BASE_EVENT_TIME = 1_767_225_600_000_000  # 2026-01-01T00:00:00Z in microseconds; event n is n ms later
_seq = itertools.count(1)
_offset = itertools.count()


@cache
def _codec() -> AvroCodec:
    return AvroCodec()


@cache
def _validator() -> InputValidator:
    return InputValidator()


@cache
def _catalog() -> TopicCatalog:
    return TopicCatalog(Settings())


@cache
def _publishable() -> frozenset[str]:
    """What the worker lets a processor publish (the same rule as the worker's)."""
    return frozenset(publishable_topics(_catalog()))


# --- events ----------------------------------------------------------------------------------------------------


def _envelope(
    session_id: str,
    logical_event_id: str | None,
    seq: int | None,
    event_time: int | None,
    event_id: str | None,
    episode_id: str | None,
    agent_id: str,
    policy_version: str,
    attributes: dict[str, str] | None,
) -> dict[str, Any]:
    seq = next(_seq) if seq is None else seq
    return {
        "event_id": event_id or uuid7(),
        "session_id": session_id,
        "agent_id": agent_id,
        "episode_id": episode_id or f"{session_id}-episode-0",
        "logical_event_id": logical_event_id or f"{session_id}-step-{seq}",
        "seq": seq,
        "event_time": event_time if event_time is not None else BASE_EVENT_TIME + seq * 1000,
        "policy_version": policy_version,
        "trace_id": "",
        "attributes": dict(attributes or {}),
    }


def _event(schema_name: str, record: dict[str, Any]) -> InputEvent:
    """An InputEvent as the worker builds it; raises ValueError for a record the worker would not hand over."""
    key = record["envelope"]["session_id"].encode()
    try:
        value = _codec().encode(schema_name, record)
    except Exception as exc:
        raise ValueError(f"the worker never hands a processor this {short_name(schema_name)}: {exc}") from exc
    problem = _validator().problem(schema_name, record, key, len(value))
    if problem is not None:
        raise ValueError(f"the worker never hands a processor this {short_name(schema_name)}: {problem}")
    topic = _catalog().for_schema(schema_name).name
    source = SourceMessage(topic, 0, next(_offset), key, value, record["envelope"]["event_time"] // 1000)
    return InputEvent(schema_name, record, source)


def input_event(schema_name: str, record: dict[str, Any]) -> InputEvent:
    """An InputEvent for a record built by hand (e.g. from recorded traffic); raises ValueError if the worker would
    dead-letter it instead of handing it to a processor."""
    return _event(schema_name, record)


def dispatch(
    tool: str = "search",
    params_json: str = '{"query": "treadle"}',
    *,
    step: int = 0,
    session_id: str = "session-1",
    logical_event_id: str | None = None,
    seq: int | None = None,
    event_time: int | None = None,
    event_id: str | None = None,
    episode_id: str | None = None,
    agent_id: str = "agent-1",
    policy_version: str = "v1",
    attributes: dict[str, str] | None = None,
    deadline: int | None = None,
) -> InputEvent:
    """An ActionDispatched: the agent called `tool` with `params_json` at step `step`."""
    env = _envelope(session_id, logical_event_id, seq, event_time, event_id, episode_id, agent_id, policy_version,
                    attributes)  # fmt: skip
    return _event(DISPATCH, {"envelope": env, "step": step, "tool": tool, "params_json": params_json,
                             "deadline": deadline})  # fmt: skip


def tool_result(
    output: str = "ok",
    *,
    status: str = "OK",
    error: str | None = None,
    latency_ms: float = 120.0,
    tool: str = "search",
    cost_usd: float = 0.0,
    tokens_in: int = 0,
    tokens_out: int = 0,
    retries: int = 0,
    session_id: str = "session-1",
    logical_event_id: str | None = None,
    seq: int | None = None,
    event_time: int | None = None,
    event_id: str | None = None,
    episode_id: str | None = None,
    agent_id: str = "agent-1",
    policy_version: str = "v1",
    attributes: dict[str, str] | None = None,
) -> InputEvent:
    """A ToolResult (status OK, ERROR, TIMEOUT or REJECTED) of the step `logical_event_id`."""
    env = _envelope(session_id, logical_event_id, seq, event_time, event_id, episode_id, agent_id, policy_version,
                    attributes)  # fmt: skip
    record = {"envelope": env, "tool": tool, "status": status, "output": output, "error": error,
              "latency_ms": float(latency_ms), "cost_usd": float(cost_usd), "tokens_in": tokens_in,
              "tokens_out": tokens_out, "retries": retries}  # fmt: skip
    return _event(TOOL_RESULT, record)


def reward(
    value: float = 1.0,
    *,
    source: str = "judge",
    name: str = "reward",
    confidence: float = 1.0,
    annotator: str = "CODE",
    evidence: str | None = None,
    session_id: str = "session-1",
    logical_event_id: str | None = None,
    seq: int | None = None,
    event_time: int | None = None,
    event_id: str | None = None,
    episode_id: str | None = None,
    agent_id: str = "agent-1",
    policy_version: str = "v1",
    attributes: dict[str, str] | None = None,
) -> InputEvent:
    """A RewardSignal from `source` on the step `logical_event_id` (annotator LLM, CODE or HUMAN)."""
    env = _envelope(session_id, logical_event_id, seq, event_time, event_id, episode_id, agent_id, policy_version,
                    attributes)  # fmt: skip
    record = {"envelope": env, "source": source, "name": name, "value": float(value),
              "confidence": float(confidence), "annotator": annotator, "evidence": evidence}  # fmt: skip
    return _event(REWARD, record)


def state_delta(
    node_upserts: list[dict[str, Any]] | None = None,
    *,
    node_deletes: list[str] | None = None,
    edge_upserts: list[dict[str, Any]] | None = None,
    edge_deletes: list[dict[str, Any]] | None = None,
    rollback_to: str | None = None,
    session_id: str = "session-1",
    logical_event_id: str | None = None,
    seq: int | None = None,
    event_time: int | None = None,
    event_id: str | None = None,
    episode_id: str | None = None,
    agent_id: str = "agent-1",
    policy_version: str = "v1",
    attributes: dict[str, str] | None = None,
) -> InputEvent:
    """A StateDelta. Nodes are {id, type, data_json, ttl_seconds}; edges {src, dst, type, data_json} (the
    optional keys default as in the schema)."""
    env = _envelope(session_id, logical_event_id, seq, event_time, event_id, episode_id, agent_id, policy_version,
                    attributes)  # fmt: skip
    nodes = [{"data_json": "{}", "ttl_seconds": None, **n} for n in node_upserts or []]
    edges = [{"data_json": "{}", **e} for e in edge_upserts or []]
    dropped = [{"data_json": "{}", **e} for e in edge_deletes or []]
    record = {"envelope": env, "node_upserts": nodes, "node_deletes": list(node_deletes or []),
              "edge_upserts": edges, "edge_deletes": dropped, "rollback_to": rollback_to}  # fmt: skip
    return _event(STATE_DELTA, record)


def lifecycle(
    kind: str = "EPISODE_STARTED",
    *,
    done: bool = False,
    truncated: bool = False,
    reason: str | None = None,
    episode_reward: float | None = None,
    steps: int | None = None,
    session_id: str = "session-1",
    logical_event_id: str | None = None,
    seq: int | None = None,
    event_time: int | None = None,
    event_id: str | None = None,
    episode_id: str | None = None,
    agent_id: str = "agent-1",
    policy_version: str = "v1",
    attributes: dict[str, str] | None = None,
) -> InputEvent:
    """A LifecycleEvent: SESSION_CREATED, EPISODE_STARTED, EPISODE_ENDED (with done/truncated and an optional
    episode reward), SESSION_PAUSED, SESSION_RESUMED, SESSION_CLOSED or SESSION_ARCHIVED."""
    env = _envelope(session_id, logical_event_id, seq, event_time, event_id, episode_id, agent_id, policy_version,
                    attributes)  # fmt: skip
    record = {"envelope": env, "kind": kind, "done": done, "truncated": truncated, "reason": reason,
              "reward": episode_reward, "steps": steps}  # fmt: skip
    return _event(LIFECYCLE, record)


# --- what a processor publishes ----------------------------------------------------------------------------------


def check_publish(schema_name: str, record: dict[str, Any], key: bytes | None, processor: str = "plugin") -> None:
    """Raise PublishError, naming `processor` and the field at fault, unless the worker would accept this publish:
    a record a processor may publish, that encodes, and (a RewardSignal) passes the checks on input."""
    checked_publish(
        processor, schema_name, record, key,
        encode=_codec().encode, codec=_codec(), validator=_validator(), publishable=_publishable(),
    )  # fmt: skip


@dataclass(frozen=True)
class Published:
    schema_name: str
    record: dict[str, Any]
    key: bytes | None


@dataclass(frozen=True)
class Failure:
    """An event a processor sent to dead letters itself (`ctx.failed`)."""

    processor: str
    event: InputEvent
    error: Exception


@dataclass
class RecordingContext(ProcessingContext):
    """A ProcessingContext that binds nothing to Kafka: it records publishes (checked like the worker's), raw sends,
    dead letters and metrics, for assertions."""

    processor: str = "plugin"
    published: list[Published] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    sent: list[tuple[str, bytes | None, bytes | None, int | None]] = field(default_factory=list)
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    codec: AvroCodec = field(default_factory=_codec)

    @property
    def rewards(self) -> list[dict[str, Any]]:
        """The RewardSignal records published, in order."""
        return [p.record for p in self.published if p.schema_name == REWARD]

    @property
    def evaluation_metrics(self) -> list[dict[str, Any]]:
        """The EvaluationMetric records published, in order."""
        return [p.record for p in self.published if p.schema_name == EVALUATION_METRIC]

    async def publish(self, schema_name: str, record: dict[str, Any], key: bytes | None) -> None:
        check_publish(schema_name, record, key, self.processor)
        self.published.append(Published(schema_name, record, key))

    async def send(self, topic: str, key: bytes | None, value: bytes | None, partition: int | None = None) -> None:
        self.sent.append((topic, key, value, partition))

    def bind(self, event: InputEvent) -> None:
        """Nothing to bind: there are no Faust tables here."""

    def bind_partition(self, partition: int) -> None:
        """Nothing to bind: there are no Faust tables here."""

    async def failed(self, processor: str, event: InputEvent, exc: Exception) -> None:
        self.failures.append(Failure(processor, event, exc))

    def input_backlog(self, partition: int) -> int | None:
        return 0  # never behind


async def run(processor: EventProcessor, *events: InputEvent) -> RecordingContext:
    """Hand `events` to `processor.process()` as one batch; the context holds what it published."""
    ctx = RecordingContext(processor=processor.name)
    await processor.process(list(events), ctx)
    return ctx


def run_sync(processor: EventProcessor, *events: InputEvent) -> RecordingContext:
    """`run` for tests that are not async."""
    return asyncio.run(run(processor, *events))
