"""LLM calls: from the SDK through Kafka into ClickHouse's llm_calls table; too large and invalid ones."""

from __future__ import annotations

import asyncio

import pytest

from sinks.sql_client import run_sql
from tests.factories import RawProducer, envelope, wait_for
from topics.ids import uuid7
from topics.settings import Settings
from treadle import AgentStream, EventTooLargeError

REQUEST = {
    "model": "qwen-7b",
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Find red shoes"}],
    "temperature": 0.7,
    "top_p": 0.95,
    "seed": 11,
    "max_tokens": 64,
    "stop": ["\n\n"],
}
RESPONSE = {
    "id": "chatcmpl-42",
    "object": "chat.completion",
    "model": "qwen-7b-instruct",
    "prompt_token_ids": [151644, 8948, 198, 3430],
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Searching.", "tool_calls": None},
            "finish_reason": "stop",
            "token_ids": [50, 2742, 13],
            "logprobs": {
                "content": [
                    {"token": "Search", "logprob": -0.25},
                    {"token": "ing", "logprob": -0.5},
                    {"token": ".", "logprob": -0.125},
                ]
            },
        },
        {
            "index": 1,
            "message": {"role": "assistant", "content": "On it."},
            "finish_reason": "length",
            "token_ids": [1925, 433],
            "logprobs": {"content": [{"token": "On", "logprob": -1.0}, {"token": " it.", "logprob": -2.0}]},
        },
    ],
    "usage": {"prompt_tokens": 4, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 2}},
}

COLUMNS = (
    "event_id, logical_event_id, agent_id, policy_version, provider, model, response_id, choice_index, messages_json, "
    "completion_text, prompt_token_ids, completion_token_ids, completion_logprobs, finish_reason, prompt_tokens, "
    "completion_tokens, cached_tokens, latency_ms, temperature, top_p, seed, max_tokens, params_json"
)


def llm_rows(settings: Settings, session: str) -> list[dict]:
    columns, rows = run_sql(
        settings, f"SELECT {COLUMNS} FROM llm_calls_latest WHERE session_id = '{session}' ORDER BY event_id"
    )
    return [dict(zip(columns, row, strict=True)) for row in rows]


async def record_calls(settings: Settings) -> tuple[AgentStream, list[str], str, str]:
    async with AgentStream(settings, agent_id="llm-agent", policy_version="pv-9") as stream:
        step = await stream.dispatch("search", {"q": "red shoes"})
        seq_before = stream.next_seq
        with pytest.raises(EventTooLargeError, match=r"LlmCall is [\d,]+ bytes encoded, above the 900,000-byte limit"):
            await stream.llm_call(step, model="qwen-7b", completion_text="x" * 2_000_000)
        assert stream.next_seq == seq_before, "a refused event must not take a seq"
        plain = await stream.llm_call(
            step,
            model="qwen-7b",
            provider="vllm",
            prompt_text="Find red shoes",
            completion_text="ok",
            prompt_token_ids=[1, 2, 3],
            completion_token_ids=[7, 8],
            completion_logprobs=[-0.5, -0.25],
            finish_reason="stop",
            latency_ms=12.5,
        )
        with pytest.raises(ValueError, match="completion_logprobs has 1 values but completion_token_ids has 2"):
            await stream.llm_call(step, model="m", completion_token_ids=[1, 2], completion_logprobs=[-0.1])
        from_openai = await stream.llm_call_from_openai(step, REQUEST, RESPONSE, latency_ms=321.0, provider="vllm")
        await stream.tool_result(step, "OK", output="3 results")
        return stream, [plain, *from_openai], step.logical_event_id, stream.session_id


def test_llm_calls_round_trip_into_clickhouse_and_an_oversized_one_loses_nothing_else(
    deployment: Settings, worker_factory
) -> None:
    worker = worker_factory().start()
    worker.wait_ready()
    _, event_ids, lid, session = asyncio.run(record_calls(deployment))

    rows = wait_for(lambda: (rows := llm_rows(deployment, session)) and len(rows) == 3 and rows, 60, "three rows")
    by_id = {row["event_id"]: row for row in rows}
    assert set(by_id) == set(event_ids)
    plain = by_id[event_ids[0]]
    assert (plain["logical_event_id"], plain["agent_id"], plain["policy_version"]) == (lid, "llm-agent", "pv-9")
    assert plain["completion_token_ids"] == [7, 8] and plain["completion_logprobs"] == [-0.5, -0.25]
    assert (plain["prompt_tokens"], plain["completion_tokens"]) == (3, 2), "counts default to the id lists' lengths"
    first, second = by_id[event_ids[1]], by_id[event_ids[2]]
    assert (first["model"], first["response_id"], first["choice_index"]) == ("qwen-7b-instruct", "chatcmpl-42", 0)
    assert first["completion_text"] == "Searching." and second["completion_text"] == "On it."
    assert first["prompt_token_ids"] == RESPONSE["prompt_token_ids"]
    assert first["completion_token_ids"] == [50, 2742, 13] and second["completion_token_ids"] == [1925, 433]
    assert first["completion_logprobs"] == [-0.25, -0.5, -0.125] and second["completion_logprobs"] == [-1.0, -2.0]
    assert (first["prompt_tokens"], first["completion_tokens"], first["cached_tokens"]) == (4, 5, 2)
    assert (second["prompt_tokens"], second["cached_tokens"]) == (0, 0), "usage is counted once per response"
    assert (first["temperature"], first["top_p"], first["seed"], first["max_tokens"]) == (0.7, 0.95, 11, 64)
    assert first["params_json"] == '{"stop":["\\n\\n"]}'
    assert '"role":"system"' in first["messages_json"] and first["finish_reason"] == "stop"
    assert second["finish_reason"] == "length" and first["latency_ms"] == 321.0

    # the step itself went on: its tool result arrived after the refused call
    query = f"SELECT tool_status FROM transitions_latest WHERE logical_event_id = '{lid}'"
    assert wait_for(lambda: run_sql(deployment, query)[1], 60, "the step's transition") == [["OK"]]


async def send_invalid_call(settings: Settings) -> str:
    session = f"s-llm-bad-{uuid7()[:8]}"
    record = {
        "envelope": envelope(session, uuid7(), 1),
        "model": "m",
        "completion_token_ids": [1, 2, 3],
        "completion_logprobs": [-0.1, 0.5, -0.2],
    }
    async with RawProducer(settings) as producer:
        await producer.send("treadle.events.LlmCall", record)
        await producer.flush()
    return session


def test_an_invalid_llm_call_from_another_producer_is_a_dead_letter(deployment: Settings, worker_factory) -> None:
    session = asyncio.run(send_invalid_call(deployment))
    worker = worker_factory().start()
    worker.wait_ready()
    query = f"SELECT stage, reason FROM dead_letters_latest WHERE session_id = '{session}'"
    rows = wait_for(lambda: run_sql(deployment, query)[1], 60, "the dead letter")
    assert rows == [["VALIDATE", "completion_logprobs must be finite log-probabilities <= 0, got 0.5"]]
    _, calls = run_sql(deployment, f"SELECT count() FROM llm_calls_latest WHERE session_id = '{session}'")
    assert calls == [[0]]
