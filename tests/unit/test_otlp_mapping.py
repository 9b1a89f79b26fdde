"""GenAI spans to treadle events (the pure mapping and numbering), and OTLP request decoding (no servers)."""

from __future__ import annotations

import gzip
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans as encode_json
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as encode_protobuf
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from streams.otlp.decoding import JSON, PROTOBUF, RequestError, TooLarge, decompress, parse_request, spans_of
from streams.otlp.mapping import OPENINFERENCE, MappedEvent, MappingConfig, map_spans, step_id
from streams.otlp.numbering import SessionNumbering
from streams.otlp.spans import STATUS_ERROR, Span, SpanEvent
from tests.otlp_agent import CALLS, run_traced_agent, tracer_provider
from topics.codec import AvroCodec
from topics.names import DISPATCH, LIFECYCLE, LLM_CALL, REWARD, TOOL_RESULT

TRACE = "0af7651916cd43dd8448eb211c80319c"
ROOT = "b7ad6b7169203331"
T0 = 1_764_000_000_000_000_000  # ns


def traced_spans(conversation: str = "conv-1") -> list:
    exporter = InMemorySpanExporter()
    provider = tracer_provider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    run_traced_agent(provider.get_tracer("test"), conversation)
    provider.shutdown()
    return list(exporter.get_finished_spans())


def decoded(sdk_spans: list, media: str = PROTOBUF) -> list[Span]:
    body = encode_protobuf(sdk_spans).SerializeToString() if media == PROTOBUF else encode_json(sdk_spans).to_json()
    return spans_of(parse_request(body if isinstance(body, bytes) else body.encode(), media))


def tool_span(span_id: str, tool: str = "search", start: int = 0, **attributes: object) -> Span:
    return Span(
        trace_id=TRACE,
        span_id=span_id,
        parent_span_id=ROOT,
        name=f"execute_tool {tool}",
        start_ns=T0 + start,
        end_ns=T0 + start + 5_000_000,
        attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": tool, **attributes},
    )


def test_a_traced_agent_maps_to_lifecycle_steps_llm_calls_and_a_reward() -> None:
    mapped = map_spans(decoded(traced_spans()))
    assert mapped.unmappable == [] and mapped.skipped == 0
    kinds = [e.schema for e in mapped.events]
    assert kinds.count(DISPATCH) == kinds.count(TOOL_RESULT) == kinds.count(LLM_CALL) == len(CALLS)
    assert kinds.count(REWARD) == 1 and kinds.count(LIFECYCLE) == 3
    assert kinds[:2] == [LIFECYCLE, LIFECYCLE] and kinds[-1] == LIFECYCLE  # created, started ... ended
    dispatches = [e.record for e in mapped.events if e.schema == DISPATCH]
    assert [d["tool"] for d in dispatches] == [c.tool for c in CALLS]
    assert [json.loads(d["params_json"]) for d in dispatches] == [c.arguments for c in CALLS]
    assert dispatches[0]["params_json"] == '{"q":"red shoes","limit":3}', "compact, as the SDK writes params_json"
    assert all(d["envelope"]["session_id"] == "conv-1" and d["envelope"]["agent_id"] == "shopper" for d in dispatches)
    results = {e.record["envelope"]["logical_event_id"]: e.record for e in mapped.events if e.schema == TOOL_RESULT}
    lids = [d["envelope"]["logical_event_id"] for d in dispatches]
    assert [results[lid]["status"] for lid in lids] == ["OK", "ERROR", "OK"]
    assert results[lids[1]]["error"] == "out of stock" and results[lids[0]]["output"] == '["r1","r2","r3"]'
    calls = [e.record for e in mapped.events if e.schema == LLM_CALL]
    assert [c["envelope"]["logical_event_id"] for c in calls] == lids, "each chat belongs to the step it asked for"
    assert calls[0]["model"] == "qwen-7b" and calls[0]["prompt_tokens"] == 100 and calls[0]["temperature"] == 0.5
    assert json.loads(calls[0]["tool_calls_json"])[0]["name"] == "search" and calls[0]["finish_reason"] == "tool_calls"
    (reward,) = [e.record for e in mapped.events if e.schema == REWARD]
    assert reward["envelope"]["logical_event_id"] == lids[0]
    assert (reward["source"], reward["value"], reward["annotator"]) == ("helpfulness", 0.75, "LLM")
    assert reward["evidence"] == "found matching shoes"


def test_a_chat_span_finds_the_step_it_asked_for_in_another_request() -> None:
    spans = decoded(traced_spans())
    chats = [s for s in spans if s.attributes.get("gen_ai.operation.name") == "chat"]
    others = [s for s in spans if s not in chats]
    alone = {e.record["envelope"]["logical_event_id"] for e in map_spans(chats).events}
    dispatched = {e.record["envelope"]["logical_event_id"] for e in map_spans(others).events if e.schema == DISPATCH}
    assert alone == dispatched and len(alone) == len(CALLS)


def test_protobuf_and_json_bodies_decode_to_the_same_spans() -> None:
    sdk_spans = traced_spans()
    assert decoded(sdk_spans, PROTOBUF) == decoded(sdk_spans, JSON)


def test_mapping_is_deterministic_and_renumbering_a_resent_request_changes_nothing() -> None:
    spans = decoded(traced_spans())
    first, again = map_spans(spans), map_spans(list(reversed(spans)))
    assert sorted(e.record["envelope"]["event_id"] for e in first.events) == sorted(
        e.record["envelope"]["event_id"] for e in again.events
    )
    numbering = SessionNumbering()
    numbering.number(first.events)
    numbering.number(again.events)
    number = {
        e.record["envelope"]["event_id"]: (e.record["envelope"]["seq"], e.record.get("step")) for e in first.events
    }
    assert number == {
        e.record["envelope"]["event_id"]: (e.record["envelope"]["seq"], e.record.get("step")) for e in again.events
    }
    steps = sorted(e.record["step"] for e in first.events if e.schema == DISPATCH)
    assert steps == [0, 1, 2]
    (ended,) = [e.record for e in first.events if e.schema == LIFECYCLE and e.record["kind"] == "EPISODE_ENDED"]
    assert ended["steps"] == 3 and ended["done"] is True


def test_every_mapped_event_is_a_valid_avro_record() -> None:
    codec = AvroCodec()
    mapped = map_spans(decoded(traced_spans()))
    SessionNumbering().number(mapped.events)
    for event in mapped.events:
        codec.encode(event.schema, event.record)


def test_spans_that_are_not_genai_are_skipped_and_bad_genai_spans_are_unmappable_with_a_reason() -> None:
    http = Span(TRACE, "1111111111111111", "GET /search", T0, T0 + 1, parent_span_id=ROOT, attributes={"http.x": 1})
    no_tool = Span(
        TRACE,
        "2222222222222222",
        "execute_tool",
        T0,
        T0 + 1,
        parent_span_id=ROOT,
        attributes={"gen_ai.operation.name": "execute_tool"},
    )
    bad_args = tool_span("3333333333333333", **{"gen_ai.tool.call.arguments": "{not json"})
    list_args = tool_span("4444444444444444", **{"gen_ai.tool.call.arguments": "[1, 2]"})
    zero_trace = Span("0" * 32, "5555555555555555", "x", T0, T0 + 1, attributes={"gen_ai.operation.name": "chat"})
    no_score = tool_span("6666666666666666")
    no_score = Span(**{**no_score.__dict__, "events": (SpanEvent("gen_ai.evaluation.result", T0, {"x": 1}),)})
    bad_reward = tool_span("7777777777777777", **{"treadle.reward.value": "high"})
    mapped = map_spans([http, no_tool, bad_args, list_args, zero_trace, no_score, bad_reward])
    assert mapped.skipped == 1 and mapped.events == []
    reasons = {u.span.span_id[:1]: u.reason for u in mapped.unmappable}
    assert reasons["2"] == "an execute_tool span without gen_ai.tool.name"
    assert reasons["3"] == "gen_ai.tool.call.arguments is not JSON"
    assert reasons["4"] == "tool arguments must be a JSON object, got list"
    assert "trace id" in reasons["5"]
    assert "gen_ai.evaluation.name" in reasons["6"] and "expected a number" in reasons["7"]


def test_status_and_treadle_reward_attributes() -> None:
    timeout = tool_span("1111111111111111", **{"error.type": "TimeoutError"})
    timeout = Span(**{**timeout.__dict__, "status_code": STATUS_ERROR, "status_message": ""})
    rewarded = tool_span(
        "2222222222222222",
        start=10_000_000,
        **{"treadle.reward.value": 1, "treadle.reward.source": "tests", "treadle.reward.annotator": "human"},
    )
    events = map_spans([timeout, rewarded]).events
    result = next(e.record for e in events if e.schema == TOOL_RESULT and e.span_id == timeout.span_id)
    assert (result["status"], result["error"], result["latency_ms"]) == ("TIMEOUT", "TimeoutError", 5.0)
    (reward,) = [e.record for e in events if e.schema == REWARD]
    assert (reward["source"], reward["value"], reward["annotator"]) == ("tests", 1.0, "HUMAN")
    assert reward["envelope"]["logical_event_id"] == step_id(TRACE, rewarded.span_id)


def test_an_evaluation_on_the_root_span_is_the_episode_reward_and_an_evaluation_span_judges_its_parent() -> None:
    evaluation = {"gen_ai.evaluation.name": "task", "gen_ai.evaluation.score.value": 0.5}
    root = Span(
        TRACE,
        ROOT,
        "invoke_agent a",
        T0,
        T0 + 10**9,
        attributes={"gen_ai.operation.name": "invoke_agent"},
        events=(SpanEvent("gen_ai.evaluation.result", T0 + 10**9, evaluation),),
    )
    tool = tool_span("1111111111111111")
    judge = Span(
        TRACE,
        "2222222222222222",
        "gen_ai.evaluation.result",
        T0 + 9,
        T0 + 9,
        parent_span_id=tool.span_id,
        attributes=evaluation,
    )
    events = map_spans([root, tool, judge]).events
    ended = next(e.record for e in events if e.schema == LIFECYCLE and e.record["kind"] == "EPISODE_ENDED")
    assert ended["reward"] == 0.5 and ended["envelope"]["session_id"] == TRACE, "no conversation id: the trace"
    (reward,) = [e.record for e in events if e.schema == REWARD]
    assert reward["envelope"]["logical_event_id"] == step_id(TRACE, tool.span_id) and reward["source"] == "task"


def test_openinference_names() -> None:
    tool = Span(
        TRACE,
        "1111111111111111",
        "lookup",
        T0,
        T0 + 2_000_000,
        parent_span_id=ROOT,
        attributes={
            "openinference.span.kind": "TOOL",
            "tool.name": "lookup",
            "input.value": '{"id": 7}',
            "output.value": "found",
            "session.id": "phoenix-session",
        },
    )
    llm = Span(
        TRACE,
        "2222222222222222",
        "llm",
        T0 - 9,
        T0 - 5,
        parent_span_id=ROOT,
        attributes={
            "openinference.span.kind": "LLM",
            "llm.model_name": "gpt-x",
            "llm.token_count.prompt": 12,
            "output.value": "calling lookup",
        },
    )
    assert map_spans([tool, llm]).events == [], "GenAI names by default: OpenInference spans are skipped"
    events = map_spans([tool, llm], MappingConfig(OPENINFERENCE)).events
    dispatch = next(e.record for e in events if e.schema == DISPATCH)
    assert (dispatch["tool"], dispatch["params_json"], dispatch["envelope"]["session_id"]) == (
        "lookup",
        '{"id":7}',
        "phoenix-session",
    )
    call = next(e.record for e in events if e.schema == LLM_CALL)
    assert (call["model"], call["prompt_tokens"], call["completion_text"]) == ("gpt-x", 12, "calling lookup")
    assert call["envelope"]["logical_event_id"] == dispatch["envelope"]["logical_event_id"]


def test_a_configured_session_attribute_wins() -> None:
    tool = tool_span("1111111111111111", **{"app.user_session": "u-9", "gen_ai.conversation.id": "c"})
    (event, *_) = map_spans([tool], MappingConfig(session_attribute="app.user_session")).events
    assert event.record["envelope"]["session_id"] == "u-9"


def test_decoding_gzip_and_refusals() -> None:
    body = encode_protobuf(traced_spans()).SerializeToString()
    assert decompress(gzip.compress(body), "gzip", len(body)) == body
    with pytest.raises(TooLarge):
        decompress(gzip.compress(b"\0" * 10_000_000), "gzip", 1_000_000)  # a zip bomb stops at the cap
    with pytest.raises(RequestError, match="not valid gzip"):
        decompress(b"plain", "gzip", 100)
    with pytest.raises(RequestError, match="cut short"):
        decompress(gzip.compress(body)[:-20], "gzip", len(body))
    with pytest.raises(RequestError, match="not supported"):
        decompress(body, "br", 100)
    with pytest.raises(RequestError, match="protobuf"):
        parse_request(b"\xff\xff\xff garbage", PROTOBUF)
    with pytest.raises(RequestError, match="JSON"):
        parse_request(b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}', JSON)
    with pytest.raises(RequestError, match="not supported"):
        parse_request(body, "text/plain")


CODEC = AvroCodec()
_VALUES = st.one_of(
    st.none(),
    st.text(max_size=30),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(),
    st.booleans(),
    st.lists(st.text(max_size=5), max_size=3),
)
_KEYS = st.sampled_from(
    [
        "gen_ai.operation.name",
        "gen_ai.tool.name",
        "gen_ai.tool.call.arguments",
        "gen_ai.tool.call.result",
        "gen_ai.conversation.id",
        "gen_ai.usage.input_tokens",
        "gen_ai.request.temperature",
        "gen_ai.request.seed",
        "gen_ai.output.messages",
        "gen_ai.response.finish_reasons",
        "treadle.reward.value",
        "treadle.reward.confidence",
        "treadle.reward.annotator",
        "error.type",
    ]
)
_OPS = st.sampled_from(["execute_tool", "chat", "invoke_agent", "text_completion", "embeddings", None])


@st.composite
def spans(draw: st.DrawFn) -> Span:
    attributes = draw(st.dictionaries(_KEYS, _VALUES, max_size=8))
    op = draw(_OPS)
    if op is not None:
        attributes["gen_ai.operation.name"] = op
    start = draw(st.integers(min_value=0, max_value=2**62))
    return Span(
        trace_id=draw(st.sampled_from([TRACE, "1" * 32, "0" * 32, "xyz"])),
        span_id=draw(st.text("0123456789abcdef", min_size=16, max_size=16)),
        parent_span_id=draw(st.sampled_from(["", ROOT])),
        name=draw(st.text(max_size=20)),
        start_ns=start,
        end_ns=start + draw(st.integers(min_value=-10, max_value=10**12)),
        status_code=draw(st.sampled_from([0, 1, 2])),
        attributes=attributes,
        events=tuple(
            SpanEvent("gen_ai.evaluation.result", start, a)
            for a in draw(
                st.lists(
                    st.dictionaries(
                        st.sampled_from(["gen_ai.evaluation.name", "gen_ai.evaluation.score.value"]), _VALUES
                    ),
                    max_size=2,
                )
            )
        ),
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(spans(), max_size=6), st.randoms(use_true_random=False))
def test_any_spans_map_to_valid_events_or_reasons_and_order_does_not_change_the_ids(
    batch: list[Span], rnd: random.Random
) -> None:
    mapped = map_spans(batch)
    assert len(mapped.unmappable) + mapped.skipped <= len(batch)
    assert all(u.reason for u in mapped.unmappable)
    SessionNumbering().number(mapped.events)
    for event in mapped.events:
        CODEC.encode(event.schema, event.record)  # never a record the worker would not decode
    shuffled = batch[:]
    rnd.shuffle(shuffled)
    ids = sorted(e.record["envelope"]["event_id"] for e in mapped.events)
    assert sorted(e.record["envelope"]["event_id"] for e in map_spans(shuffled).events) == ids


@settings(max_examples=100, deadline=None)
@given(st.lists(spans(), max_size=8), st.integers(min_value=0, max_value=7))
def test_numbering_gives_each_session_contiguous_steps_and_a_resent_span_its_old_numbers(
    batch: list[Span], split: int
) -> None:
    numbering = SessionNumbering()
    first, second = map_spans(batch[:split]).events, map_spans(batch[split:]).events
    numbering.number(first)
    numbering.number(second)
    numbers = {_key(e): (e.record["envelope"]["seq"], e.record.get("step")) for e in first}
    numbers.update({_key(e): (e.record["envelope"]["seq"], e.record.get("step")) for e in second})
    again = map_spans(batch, known_sessions=numbering.trace_sessions).events
    numbering.number(again)
    resent = [e for e in again if _key(e) in numbers]  # (a trace whose session was learnt
    for event in resent:  # late maps its first spans anew: the OTLP page says to put the session on every span)
        env = event.record["envelope"]
        assert (env["seq"], event.record.get("step")) == numbers[_key(event)]
    steps: dict[str, set[int]] = {}
    for event in first + second:
        if event.schema == DISPATCH:
            steps.setdefault(event.record["envelope"]["session_id"], set()).add(event.record["step"])
    assert all(found == set(range(len(found))) for found in steps.values())


def _key(event: MappedEvent) -> tuple[str, str]:
    return event.record["envelope"]["session_id"], event.record["envelope"]["event_id"]
