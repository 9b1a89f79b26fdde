"""A simulated agent instrumented with OpenTelemetry's SDK (GenAI semantic conventions), and its twin on treadle's SDK.

Both do the same episode: per tool call, a `chat` span (the model asks for the tool) then an `execute_tool` span;
the first tool call is judged by a `gen_ai.evaluation.result` event. The OTLP tests compare what each becomes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Status, StatusCode, Tracer

from topics.settings import Settings
from treadle import AgentStream


@dataclass(frozen=True)
class ToolCall:
    tool: str
    arguments: dict
    result: str
    error: str | None = None  # the span's status message when the tool failed
    score: float | None = None  # a gen_ai.evaluation.result on this call


CALLS = (
    ToolCall("search", {"q": "red shoes", "limit": 3}, '["r1","r2","r3"]', score=0.75),
    ToolCall("buy", {"sku": "r1"}, "", error="out of stock"),
    ToolCall("search", {"q": "blue shoes"}, '["b1"]'),
)
AGENT = "shopper"
MODEL = "qwen-7b"


def tracer_provider(service: str = AGENT) -> TracerProvider:
    return TracerProvider(resource=Resource.create({"service.name": service}))


def run_traced_agent(tracer: Tracer, conversation: str, calls: tuple[ToolCall, ...] = CALLS) -> None:
    """One episode as spans: invoke_agent > (chat, execute_tool)*; every span names the conversation."""
    conv = {"gen_ai.conversation.id": conversation}
    with tracer.start_as_current_span(
        f"invoke_agent {AGENT}",
        attributes={"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": AGENT, **conv},
    ):
        for n, call in enumerate(calls):
            with tracer.start_as_current_span(f"chat {MODEL}") as chat:
                chat.set_attributes(
                    {
                        "gen_ai.operation.name": "chat",
                        "gen_ai.provider.name": "vllm",
                        "gen_ai.request.model": MODEL,
                        "gen_ai.request.temperature": 0.5,
                        "gen_ai.usage.input_tokens": 100 + n,
                        "gen_ai.usage.output_tokens": 10 + n,
                        "gen_ai.response.finish_reasons": ["tool_calls"],
                        "gen_ai.output.messages": json.dumps(
                            [
                                {
                                    "role": "assistant",
                                    "parts": [
                                        {
                                            "type": "tool_call",
                                            "id": f"call_{n}",
                                            "name": call.tool,
                                            "arguments": call.arguments,
                                        }
                                    ],
                                }
                            ]
                        ),
                        **conv,
                    }
                )
            with tracer.start_as_current_span(f"execute_tool {call.tool}") as span:
                span.set_attributes(
                    {
                        "gen_ai.operation.name": "execute_tool",
                        "gen_ai.tool.name": call.tool,
                        "gen_ai.tool.call.id": f"call_{n}",
                        "gen_ai.tool.call.arguments": json.dumps(call.arguments),
                        **conv,
                    }
                )
                if call.result:
                    span.set_attribute("gen_ai.tool.call.result", call.result)
                if call.score is not None:
                    span.add_event(
                        "gen_ai.evaluation.result",
                        {
                            "gen_ai.evaluation.name": "helpfulness",
                            "gen_ai.evaluation.score.value": call.score,
                            "gen_ai.evaluation.explanation": "found matching shoes",
                        },
                    )
                if call.error:
                    span.set_status(Status(StatusCode.ERROR, call.error))


async def run_sdk_agent(settings: Settings, session: str, calls: tuple[ToolCall, ...] = CALLS) -> None:
    """The same episode written with treadle's SDK."""
    async with AgentStream(settings, agent_id=AGENT, session_id=session) as stream:
        await stream.lifecycle("SESSION_CREATED")
        await stream.lifecycle("EPISODE_STARTED")
        for n, call in enumerate(calls):
            step = await stream.dispatch(call.tool, call.arguments)
            await stream.llm_call(step, model=MODEL, provider="vllm", prompt_tokens=100 + n, completion_tokens=10 + n)
            if call.score is not None:
                await stream.reward(step, call.score, source="helpfulness", annotator="LLM")
            await stream.tool_result(step, "ERROR" if call.error else "OK", output=call.result, error=call.error)
        await stream.lifecycle("EPISODE_ENDED", done=True)
