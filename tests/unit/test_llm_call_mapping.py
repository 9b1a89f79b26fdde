"""OpenAI-compatible responses to LlmCall fields, and the checks an LlmCall must pass (no servers)."""

from __future__ import annotations

import math

import pytest

from streams.sdk.llm_calls import LlmCallFields, openai_llm_calls
from topics.event_checks import llm_call_problem

REQUEST = {
    "model": "gpt-4o-mini",
    "messages": [{"role": "user", "content": "Weather in Oslo?"}],
    "temperature": 0.2,
    "top_p": 1,
    "seed": 7,
    "max_completion_tokens": 100,
    "tools": [{"type": "function", "function": {"name": "weather"}}],
    "logprobs": True,
}
CHAT = {
    "id": "chatcmpl-abc",
    "object": "chat.completion",
    "model": "gpt-4o-mini-2024-07-18",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
                    }
                ],
            },
            "logprobs": {"content": [{"token": "{", "logprob": -0.01, "bytes": [123], "top_logprobs": []}]},
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {
        "prompt_tokens": 12,
        "completion_tokens": 9,
        "total_tokens": 21,
        "prompt_tokens_details": {"cached_tokens": 4},
    },
}


def test_a_chat_completion_with_tool_calls() -> None:
    (call,) = openai_llm_calls(REQUEST, CHAT, latency_ms=250.0, request_id="r-1")
    assert (call.model, call.provider, call.response_id, call.request_id) == (
        "gpt-4o-mini-2024-07-18",
        "openai",
        "chatcmpl-abc",
        "r-1",
    )
    assert call.messages_json == '[{"content":"Weather in Oslo?","role":"user"}]'
    assert call.completion_text == "" and call.finish_reason == "tool_calls"
    assert '"name":"weather"' in call.tool_calls_json
    assert call.completion_logprobs == [-0.01] and call.completion_token_ids == []
    assert (call.prompt_tokens, call.completion_tokens, call.cached_tokens) == (12, 9, 4)
    assert (call.temperature, call.top_p, call.seed, call.max_tokens) == (0.2, 1, 7, 100)
    assert call.params_json == '{"logprobs":true,"tools":[{"function":{"name":"weather"},"type":"function"}]}'
    assert call.latency_ms == 250.0
    assert llm_call_problem(call.record_fields()) is None
    assert call.record_fields()["top_p"] == 1.0 and isinstance(call.record_fields()["top_p"], float)


def test_vllm_token_ids_and_several_choices() -> None:
    response = {
        "id": "cmpl-1",
        "model": "qwen",
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "index": 0,
                "message": {"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                "logprobs": {
                    "content": [{"token": f"token_id:{i}", "logprob": lp} for i, lp in ((10, -1.0), (11, -2.0))]
                },
                "finish_reason": "stop",
            },
            {"index": 1, "message": {"content": "c"}, "token_ids": [12], "finish_reason": "length"},
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3},
    }
    first, second = openai_llm_calls({"model": "qwen", "messages": []}, response, provider="vllm")
    assert first.completion_text == "ab" and first.completion_token_ids == [10, 11]
    assert first.completion_logprobs == [-1.0, -2.0] and first.prompt_token_ids == [1, 2, 3]
    assert second.choice_index == 1 and second.completion_token_ids == [12] and second.completion_logprobs == []
    assert (first.prompt_tokens, second.prompt_tokens, second.completion_tokens) == (3, 0, 0), "usage counted once"


def test_a_text_completion_and_a_pydantic_like_response() -> None:
    class Response:
        def model_dump(self) -> dict:
            logprobs = {"tokens": ["4", "2"], "token_logprobs": [-0.5, -0.25]}
            return {
                "id": "c-2",
                "model": "m",
                "choices": [{"text": "42", "logprobs": logprobs, "finish_reason": "stop"}],
            }

    (call,) = openai_llm_calls({"model": "m", "prompt": "6*7="}, Response())
    assert (call.prompt_text, call.messages_json, call.completion_text) == ("6*7=", "", "42")
    assert call.completion_logprobs == [-0.5, -0.25]


def test_a_stream_chunk_or_a_non_dict_is_refused() -> None:
    with pytest.raises(ValueError, match="no choices"):
        openai_llm_calls(REQUEST, {"id": "x", "choices": []})
    with pytest.raises(TypeError, match="response must be a dict"):
        openai_llm_calls(REQUEST, "chatcmpl-abc")


def fields(**changes) -> dict:
    return {**LlmCallFields(model="m").record_fields(), **changes}


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        (fields(completion_token_ids=[1, 2], completion_logprobs=[-0.1]), "completion_logprobs has 1 values but"),
        (fields(completion_logprobs=[0.3]), "log-probabilities <= 0, got 0.3"),
        (fields(completion_logprobs=[math.nan]), "log-probabilities <= 0, got nan"),
        (fields(completion_logprobs=[-math.inf]), "completion_logprobs must be finite"),
        (fields(prompt_token_ids=[-1]), "prompt_token_ids must be non-negative"),
        (fields(cached_tokens=-2), "cached_tokens must be >= 0"),
        (fields(latency_ms=-1.0), "latency_ms must be a finite non-negative number"),
    ],
)
def test_each_llm_call_problem_is_named(record: dict, problem: str) -> None:
    assert problem in (llm_call_problem(record) or "")


def test_logprobs_without_token_ids_need_not_match_billed_tokens() -> None:
    """Billed completion tokens may include hidden reasoning tokens, so only aligned arrays are compared."""
    assert llm_call_problem(fields(completion_logprobs=[-0.1, -0.2], completion_tokens=40)) is None
