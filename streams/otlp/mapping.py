"""GenAI spans to treadle events: the mapping table, versioned (MAPPING_VERSION), with no I/O.

One trace is one episode (episode_id = the trace id); its session is the span's `gen_ai.conversation.id` (or the
configured attribute; OpenInference: `session.id`), found on the span, its resource, or another span of the same
trace in the same request, else the trace id. Every id is derived from the trace and span ids (uuid5), so a span
sent twice maps to the same events and the worker drops the copy as a duplicate.

- an `execute_tool` span: ActionDispatched (at the span's start) + ToolResult (at its end; status from the span
  status, latency from its times); the step's logical_event_id = uuid5(trace:tool call id), or uuid5(trace:span id)
  when the span has no gen_ai.tool.call.id.
- a `chat` / `text_completion` / `generate_content` span: an LlmCall of the step whose tool call it asked for (the
  first tool call id in gen_ai.output.messages; without ids, the first execute_tool sibling in the same request
  that starts after it ended, else its parent tool span), else of a step id of its own (a final answer).
- the trace's root span (`invoke_agent`, or any root span carrying gen_ai.* / treadle.* attributes): SESSION_CREATED
  (id from the session, so sent once per session whatever the traces), EPISODE_STARTED, EPISODE_ENDED.
- `gen_ai.evaluation.result` span events (or evaluation spans) and `treadle.reward.*` attributes: a RewardSignal for
  the span's step (an evaluation span: its parent's step); on the root span, the episode's terminal reward.

`step` and `seq` are left at -1 here: `SessionNumbering` gives them in arrival order.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from streams.otlp.spans import STATUS_ERROR, Span
from topics.event_checks import event_time_problem, latency_problem, llm_call_problem, reward_problem
from topics.names import DISPATCH, LIFECYCLE, LLM_CALL, REWARD, TOOL_RESULT

MAPPING_VERSION = "1"
# The namespace of every id the mapping derives (uuid5): fixed forever, or re-sent spans stop being duplicates.
ID_NAMESPACE = uuid.UUID("5d0b6f0e-2f7c-4c55-9a43-7e1f0c7a0d26")
EVALUATION_EVENT = "gen_ai.evaluation.result"
REWARD_PREFIX = "treadle.reward."
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=str)  # the SDK's params_json


@dataclass(frozen=True)
class Conventions:
    """Which attribute names mean what: one column of the mapping table (docs: OTLP ingestion)."""

    name: str
    session: str
    operation: str  # the attribute whose value says what a span is
    agent_ops: frozenset[str]
    tool_ops: frozenset[str]
    llm_ops: frozenset[str]
    eval_ops: frozenset[str]
    agent_name: str
    tool_name: str
    tool_arguments: str
    tool_result: str
    tool_call_id: str
    model: tuple[str, ...]  # first present wins
    provider: tuple[str, ...]
    input_tokens: str
    output_tokens: str
    cached_tokens: str
    input_messages: str
    output_messages: str
    response_id: str
    finish_reasons: str
    temperature: str
    top_p: str
    seed: str
    max_tokens: str
    request_prefix: str  # other request parameters, as params_json


GENAI = Conventions(
    name="genai",
    session="gen_ai.conversation.id",
    operation="gen_ai.operation.name",
    agent_ops=frozenset({"invoke_agent"}),
    tool_ops=frozenset({"execute_tool"}),
    llm_ops=frozenset({"chat", "text_completion", "generate_content"}),
    eval_ops=frozenset({EVALUATION_EVENT}),
    agent_name="gen_ai.agent.name",
    tool_name="gen_ai.tool.name",
    tool_arguments="gen_ai.tool.call.arguments",
    tool_result="gen_ai.tool.call.result",
    tool_call_id="gen_ai.tool.call.id",
    model=("gen_ai.response.model", "gen_ai.request.model"),
    provider=("gen_ai.provider.name", "gen_ai.system"),
    input_tokens="gen_ai.usage.input_tokens",
    output_tokens="gen_ai.usage.output_tokens",
    cached_tokens="gen_ai.usage.cache_read.input_tokens",
    input_messages="gen_ai.input.messages",
    output_messages="gen_ai.output.messages",
    response_id="gen_ai.response.id",
    finish_reasons="gen_ai.response.finish_reasons",
    temperature="gen_ai.request.temperature",
    top_p="gen_ai.request.top_p",
    seed="gen_ai.request.seed",
    max_tokens="gen_ai.request.max_tokens",
    request_prefix="gen_ai.request.",
)

OPENINFERENCE = Conventions(
    name="openinference",
    session="session.id",
    operation="openinference.span.kind",
    agent_ops=frozenset({"AGENT"}),
    tool_ops=frozenset({"TOOL"}),
    llm_ops=frozenset({"LLM"}),
    eval_ops=frozenset({"EVALUATOR"}),
    agent_name="agent.name",
    tool_name="tool.name",
    tool_arguments="input.value",
    tool_result="output.value",
    tool_call_id="tool_call.id",
    model=("llm.model_name",),
    provider=("llm.provider", "llm.system"),
    input_tokens="llm.token_count.prompt",
    output_tokens="llm.token_count.completion",
    cached_tokens="llm.token_count.prompt_details.cache_read",
    input_messages="input.value",
    output_messages="output.value",
    response_id="llm.response.id",
    finish_reasons="llm.finish_reason",
    temperature="llm.invocation_parameters.temperature",
    top_p="llm.invocation_parameters.top_p",
    seed="llm.invocation_parameters.seed",
    max_tokens="llm.invocation_parameters.max_tokens",
    request_prefix="llm.invocation_parameters.",
)

CONVENTIONS = {c.name: c for c in (GENAI, OPENINFERENCE)}


@dataclass(frozen=True)
class MappingConfig:
    """How spans are read: which conventions, and which attribute names the session (default: the conventions')."""

    conventions: Conventions = GENAI
    session_attribute: str = ""

    @property
    def session_key(self) -> str:
        return self.session_attribute or self.conventions.session


@dataclass
class MappedEvent:
    """One treadle input event made from a span; envelope seq (and a dispatch's step) are -1 until numbered."""

    schema: str
    record: dict[str, Any]
    span_id: str


@dataclass(frozen=True)
class Unmappable:
    """A GenAI span that could not become events, and why (it goes to dead letters with its bytes)."""

    span: Span
    reason: str


@dataclass
class MappedSpans:
    events: list[MappedEvent] = field(default_factory=list)
    unmappable: list[Unmappable] = field(default_factory=list)
    skipped: int = 0  # spans that are not GenAI spans (HTTP clients, databases, ...): accepted, nothing to map


class _Refused(ValueError):
    """A span cannot be mapped; the message is the dead letter's reason."""


def derived_id(*parts: str) -> str:
    """A uuid5 of the parts: the same span always gets the same ids."""
    return str(uuid.uuid5(ID_NAMESPACE, ":".join(parts)))


def step_id(trace_id: str, span_id: str) -> str:
    """The logical_event_id of the step a tool span is."""
    return derived_id(trace_id, span_id)


def map_spans(
    spans: Sequence[Span], config: MappingConfig = MappingConfig(), known_sessions: Mapping[str, str] | None = None
) -> MappedSpans:
    """Map one request's spans; `known_sessions` (trace id -> session) is what earlier requests taught."""
    conv = config.conventions
    sessions = dict(known_sessions or {})
    named: dict[str, tuple[int, str, str]] = {}  # trace -> (start, span id, session) of its earliest naming span
    for span in spans:  # a session named by a span of the trace names the trace's spans that name none
        value = span.attribute(config.session_key)
        if value not in (None, "") and span.trace_id not in sessions:
            candidate = (span.start_ns, span.span_id, str(value))
            named[span.trace_id] = min(named.get(span.trace_id, candidate), candidate)
    sessions.update({trace: name for trace, (_, _, name) in named.items()})
    llm_steps = _llm_steps(spans, conv)
    out = MappedSpans()
    for span in spans:
        kind = _kind(span, conv)
        if kind is None:
            out.skipped += 1
            continue
        try:
            own = span.attribute(config.session_key)
            session = str(own) if own not in (None, "") else sessions.get(span.trace_id) or span.trace_id
            _check_ids(span)
            events = _map_one(span, kind, session, conv, llm_steps)
        except _Refused as exc:
            out.unmappable.append(Unmappable(span, str(exc)))
            continue
        out.events.extend(events)
    out.events.sort(key=lambda e: e.record["envelope"]["event_time"])  # seq follows time within a request
    return out


def _op(span: Span, conv: Conventions) -> str:
    op = span.attributes.get(conv.operation)
    return op if isinstance(op, str) else ""


def _kind(span: Span, conv: Conventions) -> str | None:
    op = _op(span, conv)
    if op in conv.tool_ops:
        return "tool"
    if op in conv.llm_ops:
        return "llm"
    if op in conv.eval_ops or span.name == EVALUATION_EVENT:
        return "evaluation"
    if not span.parent_span_id and (op in conv.agent_ops or _genai_attributes(span)):
        return "episode"
    if op in conv.agent_ops:
        return None  # a sub-agent: its spans belong to the trace's episode
    if any(k.startswith(REWARD_PREFIX) for k in span.attributes):
        return "reward"
    return None


def _genai_attributes(span: Span) -> bool:
    return any(k.startswith(("gen_ai.", "treadle.", "openinference.")) for k in span.attributes)


def _check_ids(span: Span) -> None:
    if not _hex(span.trace_id, 32):
        raise _Refused(f"trace id {span.trace_id!r} is not 32 hex digits (or is all zeros)")
    if not _hex(span.span_id, 16):
        raise _Refused(f"span id {span.span_id!r} is not 16 hex digits (or is all zeros)")
    if span.end_ns < span.start_ns:
        raise _Refused(f"the span ends ({span.end_ns}) before it starts ({span.start_ns})")


_HEX_DIGITS = frozenset("0123456789abcdef")


def _hex(text: str, digits: int) -> bool:
    return len(text) == digits and _HEX_DIGITS.issuperset(text) and text.strip("0") != ""


def tool_step_id(span: Span, conv: Conventions = GENAI) -> str:
    """The logical_event_id of the step a tool span is: from its tool call id when it has one (so the chat span that
    asked for the call finds it in any request), else from its span id."""
    call_id = span.attributes.get(conv.tool_call_id)
    if isinstance(call_id, str) and call_id:
        return derived_id(span.trace_id, "tool_call", call_id)
    return step_id(span.trace_id, span.span_id)


def _requested_calls(span: Span, conv: Conventions) -> list[str]:
    """The ids of the tool calls an LLM span's output asked for, in order."""
    if conv is OPENINFERENCE:
        keys = sorted(k for k in span.attributes if k.startswith("llm.output_messages.") and k.endswith("tool_call.id"))
        return [str(span.attributes[k]) for k in keys if span.attributes[k]]
    _, calls = _output(span.attributes.get(conv.output_messages))
    return [str(c["id"]) for c in calls if isinstance(c, dict) and c.get("id")]


def _llm_steps(spans: Sequence[Span], conv: Conventions) -> dict[str, str]:
    """span id of a tool span or an LLM span -> its step id. An LLM span belongs to the step of the first tool call
    its output asked for; without call ids, to the first tool span after it under the same parent in this request,
    else to its parent tool span; else (a final answer, say) to a step id of its own."""
    tools = sorted((s for s in spans if _op(s, conv) in conv.tool_ops), key=lambda s: (s.start_ns, s.span_id))
    steps = {t.span_id: tool_step_id(t, conv) for t in tools}
    for span in spans:
        if _op(span, conv) not in conv.llm_ops:
            continue
        if requested := _requested_calls(span, conv):
            steps[span.span_id] = derived_id(span.trace_id, "tool_call", requested[0])
            continue
        after = next(
            (
                t
                for t in tools
                if t.trace_id == span.trace_id and t.parent_span_id == span.parent_span_id and t.start_ns >= span.end_ns
            ),
            None,
        )
        if after is not None:
            steps[span.span_id] = steps[after.span_id]
        elif span.parent_span_id in steps:
            steps[span.span_id] = steps[span.parent_span_id]
    return steps


def _map_one(span: Span, kind: str, session: str, conv: Conventions, llm_steps: dict[str, str]) -> list[MappedEvent]:
    agent = str(span.attribute(conv.agent_name) or span.resource.get("service.name") or "otlp")
    policy = str(span.attribute("treadle.policy_version") or "")
    if kind == "episode":
        return _episode(span, session, agent, policy, conv)
    if kind == "tool":
        lid = llm_steps[span.span_id]
        return _tool(span, lid, session, agent, policy, conv) + _rewards(span, lid, session, agent, policy)
    if kind == "llm":
        lid = llm_steps.get(span.span_id) or step_id(span.trace_id, span.span_id)
        return [_llm(span, lid, session, agent, policy, conv), *_rewards(span, lid, session, agent, policy)]
    # an evaluation span or a span with treadle.reward.*: it judges its parent span's step
    if not span.parent_span_id:
        raise _Refused("an evaluation or reward span without a parent: no step to reward")
    lid = llm_steps.get(span.parent_span_id) or step_id(span.trace_id, span.parent_span_id)
    rewards = _rewards(span, lid, session, agent, policy, evaluation_span=kind == "evaluation")
    if not rewards:
        raise _Refused("an evaluation span without gen_ai.evaluation.name / score.value")
    return rewards


def _envelope(
    span: Span, event_id: str, lid: str, session: str, agent: str, policy: str, time_ns: int, extra: dict[str, str]
) -> dict[str, Any]:
    event_time = time_ns // 1000
    if (problem := event_time_problem(event_time)) is not None:
        raise _Refused(problem)
    return {
        "event_id": event_id,
        "session_id": session,
        "agent_id": agent,
        "episode_id": span.trace_id,
        "logical_event_id": lid,
        "seq": -1,
        "event_time": event_time,
        "policy_version": policy,
        "trace_id": span.trace_id,
        "attributes": {"otel.span_id": span.span_id, "treadle.otlp_mapping": MAPPING_VERSION, **extra},
    }


def _tool(span: Span, lid: str, session: str, agent: str, policy: str, conv: Conventions) -> list[MappedEvent]:
    tool = span.attributes.get(conv.tool_name)
    if not tool:
        tool = span.name.removeprefix("execute_tool ").strip() if span.name.startswith("execute_tool ") else ""
    if not tool:
        raise _Refused(f"an execute_tool span without {conv.tool_name}")
    arguments = span.attributes.get(conv.tool_arguments)
    params_json = _params_json(arguments)
    call_id = span.attributes.get(conv.tool_call_id)
    extra = {"tool_call_id": str(call_id)} if call_id else {}
    dispatch = {
        "envelope": _envelope(span, lid, lid, session, agent, policy, span.start_ns, extra),
        "step": -1,
        "tool": str(tool),
        "params_json": params_json,
        "deadline": None,
    }
    latency_ms = (span.end_ns - span.start_ns) / 1e6
    if (problem := latency_problem(latency_ms)) is not None:
        raise _Refused(problem)
    status, error = _tool_status(span)
    result = {
        "envelope": _envelope(span, derived_id(lid, "result"), lid, session, agent, policy, span.end_ns, extra),
        "tool": str(tool),
        "status": status,
        "output": _text(span.attributes.get(conv.tool_result)),
        "error": error,
        "latency_ms": latency_ms,
        "cost_usd": _number(span.attributes.get("treadle.cost_usd"), 0.0),
        "tokens_in": _int(span.attributes.get(conv.input_tokens)),
        "tokens_out": _int(span.attributes.get(conv.output_tokens)),
        "retries": 0,
    }
    return [MappedEvent(DISPATCH, dispatch, span.span_id), MappedEvent(TOOL_RESULT, result, span.span_id)]


def _tool_status(span: Span) -> tuple[str, str | None]:
    if span.status_code != STATUS_ERROR:
        return "OK", None
    error_type = str(span.attributes.get("error.type") or "")
    error = span.status_message or error_type or "error"
    return ("TIMEOUT" if "timeout" in error_type.lower() else "ERROR"), error


def _params_json(arguments: Any) -> str:
    """Tool arguments as the SDK writes params_json: compact JSON of an object; a string that is not one is refused."""
    if arguments is None or arguments == "":
        return "{}"
    value = arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            raise _Refused("gen_ai.tool.call.arguments is not JSON") from None
    if not isinstance(value, dict):
        raise _Refused(f"tool arguments must be a JSON object, got {type(value).__name__}")
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError as exc:
        raise _Refused(f"tool arguments: {exc}") from None


def _llm(span: Span, lid: str, session: str, agent: str, policy: str, conv: Conventions) -> MappedEvent:
    attrs = span.attributes
    model = next((str(attrs[k]) for k in conv.model if attrs.get(k)), "")
    provider = next((str(span.attribute(k)) for k in conv.provider if span.attribute(k)), "")
    completion_text, tool_calls = _output(attrs.get(conv.output_messages))
    finish = attrs.get(conv.finish_reasons)
    if isinstance(finish, list | tuple):
        finish = finish[0] if finish else ""
    own = {conv.temperature, conv.top_p, conv.seed, conv.max_tokens}
    params = {
        k.removeprefix(conv.request_prefix): v
        for k, v in attrs.items()
        if k.startswith(conv.request_prefix) and k not in own and k != "gen_ai.request.model"
    }
    messages = attrs.get(conv.input_messages)
    record = {
        "envelope": _envelope(
            span, derived_id(span.trace_id, span.span_id, "llm"), lid, session, agent, policy, span.end_ns, {}
        ),
        "provider": provider,
        "model": model,
        "request_id": "",
        "response_id": str(attrs.get(conv.response_id) or ""),
        "choice_index": 0,
        "messages_json": "" if messages is None else _text(messages),
        "prompt_text": "",
        "completion_text": completion_text,
        "tool_calls_json": _JSON.encode(tool_calls) if tool_calls else "",
        "prompt_token_ids": [],
        "completion_token_ids": [],
        "completion_logprobs": [],
        "finish_reason": str(finish or ""),
        "prompt_tokens": _int(attrs.get(conv.input_tokens)),
        "completion_tokens": _int(attrs.get(conv.output_tokens)),
        "cached_tokens": _int(attrs.get(conv.cached_tokens)),
        "latency_ms": (span.end_ns - span.start_ns) / 1e6,
        "cost_usd": _number(attrs.get("treadle.cost_usd"), 0.0),
        "temperature": _optional(attrs.get(conv.temperature), float),
        "top_p": _optional(attrs.get(conv.top_p), float),
        "seed": _optional(attrs.get(conv.seed), int),
        "max_tokens": _optional(attrs.get(conv.max_tokens), int),
        "params_json": _JSON.encode(params) if params else "",
    }
    if (problem := llm_call_problem(record)) is not None:
        raise _Refused(problem)
    return MappedEvent(LLM_CALL, record, span.span_id)


def _output(messages: Any) -> tuple[str, list[Any]]:
    """Completion text and tool calls from gen_ai.output.messages ([{role, parts: [{type, content | name, ...}]}])."""
    if messages is None:
        return "", []
    parsed = messages
    if isinstance(messages, str):
        try:
            parsed = json.loads(messages)
        except ValueError:
            return messages, []  # plain text (OpenInference output.value often is)
    if not isinstance(parsed, list):
        return _text(messages), []
    texts: list[str] = []
    calls: list[Any] = []
    for message in parsed:
        for part in (message.get("parts") or []) if isinstance(message, dict) else []:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "text":
                texts.append(str(part.get("content", "")))
            elif part.get("type") == "tool_call":
                calls.append({k: v for k, v in part.items() if k != "type"})
    return "".join(texts), calls


def _episode(span: Span, session: str, agent: str, policy: str, conv: Conventions) -> list[MappedEvent]:
    trace = span.trace_id

    def lifecycle(kind: str, event_id: str, time_ns: int, **fields: Any) -> MappedEvent:
        record = {
            "envelope": _envelope(span, event_id, event_id, session, agent, policy, time_ns, {}),
            "kind": kind,
            "done": False,
            "truncated": False,
            "reason": None,
            "reward": None,
            "steps": None,
            **fields,
        }
        record["envelope"]["trace_id"] = ""
        return MappedEvent(LIFECYCLE, record, span.span_id)

    created = lifecycle("SESSION_CREATED", derived_id("session", session), span.start_ns)
    started = lifecycle("EPISODE_STARTED", derived_id(trace, "episode-started"), span.start_ns)
    rewards = [r for r in _reward_values(span) if r is not None]
    error = span.status_code == STATUS_ERROR
    ended = lifecycle(
        "EPISODE_ENDED",
        derived_id(trace, "episode-ended"),
        span.end_ns,
        done=not error,
        truncated=error,
        reason=(span.status_message or "error") if error else None,
        reward=rewards[0]["value"] if rewards else None,
    )
    return [created, started, ended]


def _rewards(
    span: Span, lid: str, session: str, agent: str, policy: str, *, evaluation_span: bool = False
) -> list[MappedEvent]:
    events = []
    for index, reward in enumerate(_reward_values(span, evaluation_span=evaluation_span)):
        if reward is None:
            continue
        event_id = derived_id(span.trace_id, span.span_id, "reward", str(index))
        record = {
            "envelope": _envelope(span, event_id, lid, session, agent, policy, reward.pop("time_ns"), {}),
            **reward,
        }
        events.append(MappedEvent(REWARD, record, span.span_id))
    return events


def _reward_values(span: Span, *, evaluation_span: bool = False) -> list[dict[str, Any] | None]:
    """RewardSignal fields from the span's evaluation events (or, for an evaluation span, its own attributes) and its
    treadle.reward.* attributes, in a fixed order (their ids count on it)."""
    found: list[dict[str, Any] | None] = []
    sources = [(e.attributes, e.time_ns) for e in span.events if e.name == EVALUATION_EVENT]
    if evaluation_span:
        sources.insert(0, (span.attributes, span.end_ns))
    for attrs, time_ns in sources:
        name = attrs.get("gen_ai.evaluation.name")
        score = attrs.get("gen_ai.evaluation.score.value")
        if not name or score is None:
            raise _Refused("a gen_ai.evaluation.result needs gen_ai.evaluation.name and gen_ai.evaluation.score.value")
        found.append(
            _reward(
                str(name),
                "reward",
                _number(score, math.nan),
                1.0,
                "LLM",
                attrs.get("gen_ai.evaluation.explanation"),
                time_ns,
            )
        )
    a = span.attributes
    if (REWARD_PREFIX + "value") in a:
        found.append(
            _reward(
                str(a.get(REWARD_PREFIX + "source") or "otlp"),
                str(a.get(REWARD_PREFIX + "name") or "reward"),
                _number(a.get(REWARD_PREFIX + "value"), math.nan),
                _number(a.get(REWARD_PREFIX + "confidence"), 1.0),
                str(a.get(REWARD_PREFIX + "annotator") or "CODE").upper(),
                a.get(REWARD_PREFIX + "evidence"),
                span.end_ns,
            )
        )
    elif any(k.startswith(REWARD_PREFIX) for k in a):
        raise _Refused(f"treadle.reward.* attributes without {REWARD_PREFIX}value")
    return found


def _reward(
    source: str, name: str, value: float, confidence: float, annotator: str, evidence: Any, time_ns: int
) -> dict[str, Any]:
    if (problem := reward_problem(value, confidence)) is not None:
        raise _Refused(problem)
    if annotator not in ("LLM", "CODE", "HUMAN"):
        raise _Refused(f"treadle.reward.annotator must be LLM, CODE or HUMAN, not {annotator!r}")
    return {
        "source": source,
        "name": name,
        "value": value,
        "confidence": confidence,
        "annotator": annotator,
        "evidence": None if evidence is None else _text(evidence),
        "time_ns": time_ns,
    }


def _number(value: Any, default: float) -> float:
    if value is None:
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        raise _Refused(f"expected a number, got {value!r}") from None


def _int(value: Any, default: int = 0) -> int:
    number = _number(value, default)
    if not math.isfinite(number) or not -(2**63) <= number < 2**63:
        raise _Refused(f"expected a 64-bit integer, got {value!r}")
    return int(number)


def _optional(value: Any, kind: type) -> Any:
    if value is None:
        return None
    return _number(value, math.nan) if kind is float else _int(value)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return _JSON.encode(value)
