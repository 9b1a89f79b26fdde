"""What an LlmCall record says, built from plain arguments or from an OpenAI-compatible response.

`LlmCallFields` is the LlmCall record without its envelope. `openai_llm_calls` reads the dict shape of an
OpenAI-compatible chat (or text) completion, as OpenAI, vLLM, SGLang and most gateways return it, one
`LlmCallFields` per choice. It never imports the openai package: a response object of that package (a
pydantic model) is read through its `model_dump()`.

Token ids come from vLLM's extensions where present (`prompt_token_ids` on the response, `token_ids` on a
choice, or logprob tokens spelled `token_id:N` with `return_tokens_as_token_ids`); logprobs from
`choices[i].logprobs.content[*].logprob` (chat) or `logprobs.token_logprobs` (text completions).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# Request keys with a column of their own; everything else a request carries goes to params_json.
_OWN_REQUEST_KEYS = frozenset(
    {"model", "messages", "prompt", "temperature", "top_p", "seed", "max_tokens", "max_completion_tokens"}
)
_TOKEN_ID_PREFIX = "token_id:"


@dataclass
class LlmCallFields:
    """The fields of an LlmCall besides its envelope (see the LlmCall schema for what each means)."""

    model: str
    provider: str = ""
    request_id: str = ""
    response_id: str = ""
    choice_index: int = 0
    messages_json: str = ""
    prompt_text: str = ""
    completion_text: str = ""
    tool_calls_json: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    completion_token_ids: list[int] = field(default_factory=list)
    completion_logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    latency_ms: float = 0.0
    cost_usd: float = 0.0
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    params_json: str = ""

    def record_fields(self) -> dict[str, Any]:
        """The fields as the Avro record takes them (numbers coerced, lists copied)."""
        fields = asdict(self)
        fields["prompt_token_ids"] = [int(t) for t in self.prompt_token_ids]
        fields["completion_token_ids"] = [int(t) for t in self.completion_token_ids]
        fields["completion_logprobs"] = [float(v) for v in self.completion_logprobs]
        for name in ("choice_index", "prompt_tokens", "completion_tokens", "cached_tokens"):
            fields[name] = int(fields[name])
        for name in ("latency_ms", "cost_usd"):
            fields[name] = float(fields[name])
        for name, kind in (("temperature", float), ("top_p", float), ("seed", int), ("max_tokens", int)):
            if fields[name] is not None:
                fields[name] = kind(fields[name])
        return fields


def as_dict(value: Any, what: str) -> dict[str, Any]:
    """A response or request as a dict: a dict as it is, a pydantic model (the openai package's) by model_dump()."""
    if isinstance(value, Mapping):
        return dict(value)
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump()
    raise TypeError(f"{what} must be a dict (or have model_dump()), not {type(value).__name__}")


def openai_llm_calls(
    request: Mapping[str, Any] | Any,
    response: Mapping[str, Any] | Any,
    *,
    latency_ms: float = 0.0,
    provider: str = "openai",
    request_id: str = "",
    cost_usd: float = 0.0,
) -> list[LlmCallFields]:
    """One LlmCallFields per choice of an OpenAI-compatible chat or text completion `response` to `request`.

    Usage (tokens billed and cached) is the whole response's, so it is given on the first choice only: summing
    over a step's calls then counts each call once.
    """
    req = as_dict(request, "request")
    resp = as_dict(response, "response")
    choices = resp.get("choices") or []
    if not isinstance(choices, Sequence) or not choices:
        raise ValueError("the response has no choices: pass the completion response itself, not a stream chunk")
    usage = resp.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    messages = req.get("messages")
    prompt = req.get("prompt")
    params = {k: v for k, v in req.items() if k not in _OWN_REQUEST_KEYS}
    max_tokens = req.get("max_completion_tokens", req.get("max_tokens"))
    calls = []
    for position, choice in enumerate(choices):
        choice = as_dict(choice, "a choice")
        token_ids, logprobs = _completion_tokens(choice)
        first = position == 0
        calls.append(
            LlmCallFields(
                model=str(resp.get("model") or req.get("model") or ""),
                provider=provider,
                request_id=request_id,
                response_id=str(resp.get("id") or ""),
                choice_index=int(choice.get("index", position)),
                messages_json=_json(messages) if messages is not None else "",
                prompt_text=prompt if isinstance(prompt, str) else "",
                completion_text=_completion_text(choice),
                tool_calls_json=_tool_calls_json(choice),
                prompt_token_ids=_int_list(resp.get("prompt_token_ids")),
                completion_token_ids=token_ids,
                completion_logprobs=logprobs,
                finish_reason=str(choice.get("finish_reason") or ""),
                prompt_tokens=int(usage.get("prompt_tokens") or 0) if first else 0,
                completion_tokens=int(usage.get("completion_tokens") or 0) if first else 0,
                cached_tokens=int(details.get("cached_tokens") or 0) if first else 0,
                latency_ms=float(latency_ms),
                cost_usd=float(cost_usd) if first else 0.0,
                temperature=req.get("temperature"),
                top_p=req.get("top_p"),
                seed=req.get("seed"),
                max_tokens=max_tokens,
                params_json=_json(params) if params else "",
            )
        )
    return calls


def _completion_text(choice: Mapping[str, Any]) -> str:
    message = choice.get("message")
    if isinstance(message, Mapping):
        content = message.get("content")
        if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
            return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
        return "" if content is None else str(content)
    return str(choice.get("text") or "")


def _tool_calls_json(choice: Mapping[str, Any]) -> str:
    message = choice.get("message")
    calls = message.get("tool_calls") if isinstance(message, Mapping) else None
    return _json(calls) if calls else ""


def _completion_tokens(choice: Mapping[str, Any]) -> tuple[list[int], list[float]]:
    """(token ids, logprobs) of a choice: vLLM's `token_ids`, or ids spelled in the logprob tokens."""
    ids = _int_list(choice.get("token_ids"))
    logprobs = choice.get("logprobs") or {}
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    if content:  # chat: one entry per token
        values = [float(entry["logprob"]) for entry in content]
        tokens = [str(entry.get("token", "")) for entry in content]
    elif isinstance(logprobs, Mapping) and logprobs.get("token_logprobs") is not None:  # text completion
        values = [float(v) for v in logprobs["token_logprobs"]]
        tokens = [str(t) for t in logprobs.get("tokens") or []]
    else:
        return ids, []
    if not ids and tokens and all(t.startswith(_TOKEN_ID_PREFIX) for t in tokens):
        ids = [int(t[len(_TOKEN_ID_PREFIX) :]) for t in tokens]
    return ids, values


def _int_list(value: Any) -> list[int]:
    return [int(v) for v in value] if value else []


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True, default=str)
