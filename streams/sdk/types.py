"""The SDK's value types: step references, graph nodes and edges, tool calls, enums and errors."""

from __future__ import annotations

import asyncio
import json
import json.encoder
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, TypeVar

from topics.ids import now_micros

T = TypeVar("T")

_METADATA_TIMEOUT_S = 15.0
DEFAULT_DELIVERY_TIMEOUT_S = 120.0
# Encoders built once: json.dumps with options builds a new encoder per call, a visible cost per dispatch.
_PARAMS_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_LENIENT_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=str)


def _params_encoder() -> Callable[[Any], str]:
    """`_PARAMS_JSON.encode`, with json's C encoder built once instead of on every call (half the cost of a dispatch's
    JSON). Its output is the same; without the circular-reference check (whose marker dict cannot be shared between
    calls that fail halfway), a cycle raises RecursionError instead of ValueError."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # no C accelerator (e.g. PyPy)
        return _PARAMS_JSON.encode
    p = _PARAMS_JSON
    encoder = make(None, p.default, json.encoder.encode_basestring, None, p.key_separator, p.item_separator,
                   p.sort_keys, p.skipkeys, p.allow_nan)  # fmt: skip
    return lambda params: "".join(encoder(params, 0))


_params_json = _params_encoder()


class ToolStatus(StrEnum):
    """How a tool call ended (the ToolResult.status enum)."""

    OK = "OK"
    ERROR = "ERROR"
    TIMEOUT = "TIMEOUT"
    REJECTED = "REJECTED"


class Annotator(StrEnum):
    """Who produced a reward signal (the RewardSignal.annotator enum)."""

    LLM = "LLM"
    CODE = "CODE"
    HUMAN = "HUMAN"


class LifecycleKind(StrEnum):
    """Session and episode phases (the LifecycleEvent.kind enum)."""

    SESSION_CREATED = "SESSION_CREATED"
    EPISODE_STARTED = "EPISODE_STARTED"
    EPISODE_ENDED = "EPISODE_ENDED"
    SESSION_PAUSED = "SESSION_PAUSED"
    SESSION_RESUMED = "SESSION_RESUMED"
    SESSION_CLOSED = "SESSION_CLOSED"
    SESSION_ARCHIVED = "SESSION_ARCHIVED"


_TOOL_STATUSES = {m.value: m for m in ToolStatus}
_ANNOTATORS = {m.value: m for m in Annotator}
E = TypeVar("E", bound=StrEnum)


def _member(kind: type[E], by_value: dict[str, E], given: Any) -> E:
    """`kind(given)` (ValueError for an unknown value) without Enum's slow call for members and known strings."""
    if type(given) is kind:
        return given
    if type(given) is str and (member := by_value.get(given)) is not None:
        return member
    return kind(given)


class StreamError(Exception):
    """The stream cannot do what was asked (not started, closed, topics missing)."""


class EventTooLargeError(ValueError):
    """An event larger than TREADLE_MAX_EVENT_BYTES encoded; nothing was sent (the worker would dead-letter it)."""


@dataclass(frozen=True, slots=True)
class FailedEvent:
    """An event the broker never acknowledged; `record` is kept so the caller can resend it."""

    schema: str
    topic: str
    record: dict[str, Any]
    error: BaseException

    @property
    def event_id(self) -> str:
        return str(self.record["envelope"]["event_id"])

    @property
    def session_id(self) -> str:
        return str(self.record["envelope"]["session_id"])

    @property
    def logical_event_id(self) -> str:
        return str(self.record["envelope"]["logical_event_id"])


class ProducerError(StreamError):
    """Events could not be delivered to Kafka; `failed` lists them, `cause` is the first error."""

    def __init__(self, cause: BaseException, failed: Iterable[FailedEvent] = ()) -> None:
        self.cause = cause
        self.failed: tuple[FailedEvent, ...] = tuple(failed)
        what = f"{len(self.failed)} event(s) not delivered" if self.failed else "event not delivered"
        first = f" (first: {self.failed[0].schema.rsplit('.', 1)[-1]} {self.failed[0].event_id})" if self.failed else ""
        super().__init__(f"{what}{first}: {type(cause).__name__}: {cause}")


@dataclass(frozen=True, slots=True)
class StepRef:
    """The ids of a dispatched step: what a tool result or a reward needs to attach to it."""

    logical_event_id: str
    trace_id: str
    step: int
    session_id: str
    episode_id: str
    tool: str = ""
    dispatched_at: int = 0  # event_time of the dispatch, UTC micros


def _step_ref_maker() -> Callable[[str, str, int, str, str, str, int], StepRef]:
    """`StepRef(...)` for `dispatch`, a third of the cost: a frozen dataclass's __init__ sets each field through
    object.__setattr__, a global and an attribute lookup per field; this sets the same slots through their
    descriptors, looked up once. The instance is the same (type, equality, hash, repr)."""
    make = object.__new__
    lid, trace, number, session, episode, tool, at = (
        getattr(StepRef, f.name).__set__ for f in fields(StepRef)
    )  # fmt: skip

    def step_ref(
        logical_event_id: str,
        trace_id: str,
        step: int,
        session_id: str,
        episode_id: str,
        tool_name: str,
        dispatched_at: int,
    ) -> StepRef:
        ref = make(StepRef)
        lid(ref, logical_event_id)
        trace(ref, trace_id)
        number(ref, step)
        session(ref, session_id)
        episode(ref, episode_id)
        tool(ref, tool_name)
        at(ref, dispatched_at)
        return ref

    return step_ref


_step_ref = _step_ref_maker()


@dataclass(frozen=True, slots=True)
class Node:
    """A state-graph node to upsert; `data` is any JSON value (a dict, usually)."""

    id: str
    type: str
    data: Any = None
    ttl_seconds: int | None = None


@dataclass(frozen=True, slots=True)
class Edge:
    """A typed, directed edge between two nodes."""

    src: str
    dst: str
    type: str
    data: Any = None


NodeLike = Node | Mapping[str, Any]
EdgeLike = Edge | Mapping[str, Any] | tuple[str, str, str]


@dataclass(slots=True)
class ToolCall:
    """A tool call being measured by `tool_call(...)`; set the outcome fields inside the block.

    `status` defaults to OK on a normal exit, ERROR on an exception and TIMEOUT on TimeoutError;
    set it yourself (e.g. REJECTED) to override a normal exit.
    """

    step: StepRef
    output: Any = None
    error: str | None = None
    status: ToolStatus | str | None = None
    cost_usd: float = 0.0
    tokens_in: int = 0
    tokens_out: int = 0
    retries: int = 0
    attributes: dict[str, str] = field(default_factory=dict)
    latency_ms: float | None = None
    _started: float = field(default_factory=time.perf_counter, repr=False)

    def _finish(self, exc: BaseException | None) -> None:
        """Fix latency and status from how the block ended."""
        self.latency_ms = (time.perf_counter() - self._started) * 1000.0
        if exc is None:
            self.status = ToolStatus.OK if self.status is None else _member(ToolStatus, _TOOL_STATUSES, self.status)
        elif isinstance(exc, TimeoutError):  # asyncio.TimeoutError is TimeoutError since 3.11
            self.status = ToolStatus.TIMEOUT
            self.error = self.error or _describe(exc) or "timed out"
        else:
            self.status = ToolStatus.ERROR
            self.error = self.error or ("cancelled" if isinstance(exc, asyncio.CancelledError) else _describe(exc))


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _text(value: Any) -> str:
    """Tool outputs and graph data as text: strings as they are, anything else as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    return _LENIENT_JSON.encode(value)


def _json_data(value: Any) -> str:
    return "{}" if value is None else _text(value)


def _attrs(attributes: Mapping[str, Any] | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in attributes.items()} if attributes else {}


def _micros(deadline: datetime | timedelta | int | None) -> int | None:
    """A deadline as UTC micros: datetimes as they are (naive = UTC), timedeltas from now, ints as micros."""
    if deadline is None:
        return None
    if isinstance(deadline, timedelta):
        return now_micros() + int(deadline / timedelta(microseconds=1))
    if isinstance(deadline, datetime):
        aware = deadline if deadline.tzinfo is not None else deadline.replace(tzinfo=UTC)
        return int(aware.timestamp() * 1_000_000)
    return int(deadline)


def _node(node: NodeLike) -> dict[str, Any]:
    if isinstance(node, Node):
        return {"id": node.id, "type": node.type, "data_json": _json_data(node.data), "ttl_seconds": node.ttl_seconds}
    data_json = node["data_json"] if "data_json" in node else _json_data(node.get("data"))
    return {"id": node["id"], "type": node["type"], "data_json": data_json, "ttl_seconds": node.get("ttl_seconds")}


def _edge(edge: EdgeLike) -> dict[str, Any]:
    if isinstance(edge, Edge):
        return {"src": edge.src, "dst": edge.dst, "type": edge.type, "data_json": _json_data(edge.data)}
    if isinstance(edge, tuple):
        src, dst, kind = edge
        return {"src": src, "dst": dst, "type": kind, "data_json": "{}"}
    data_json = edge["data_json"] if "data_json" in edge else _json_data(edge.get("data"))
    return {"src": edge["src"], "dst": edge["dst"], "type": edge["type"], "data_json": data_json}
