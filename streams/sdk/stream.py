"""The agent-facing SDK: emit dispatches, tool results, rewards, state deltas and lifecycle events.

An agent loop must never wait for the data plane, so every call returns as soon as its event is
handed to the Kafka producer (appended to its partition's record batch, which aiokafka sends with
`send_batch`: streams/sdk/batching.py); the broker's acknowledgement is tracked in the background. Nothing
is dropped silently either: a send that fails later is recorded, and the next call, `flush()` or
`close()` raises `ProducerError` naming the failed events (their records are kept for a retry).

Every event is keyed by its session_id, so a session's events share one partition in every input
topic, and carries a per-stream `seq` that orders them without trusting clocks.

    async with AgentStream(agent_id="shopper") as stream:
        step = await stream.dispatch("search", {"q": "red shoes"})
        async with stream.tool_call(step) as call:
            call.output = await search("red shoes")
        await stream.reward(step, 0.7, source="heuristic")

Reward sources that only know a step's `logical_event_id` and session use `RewardEmitter`.
Agents without an event loop use `AgentStreamSync` / `RewardEmitterSync`.

Conventions: a dispatch's event_id is its step's logical_event_id, and its trace_id is that id
without dashes unless one is given; deltas and lifecycle events not tied to a step carry their own
event_id as logical_event_id. The partition is Kafka's default, murmur2(session_id) mod partitions,
as Java clients and Faust compute it. aiokafka's idempotent producer retries forever while the
broker is down, so `delivery_timeout_s` (default 120 s, like Java's delivery.timeout.ms) bounds how
long an event may stay unacknowledged before it is reported failed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any

from aiokafka import AIOKafkaProducer

from streams.sdk.emitter import (
    _Emitter,
)
from streams.sdk.llm_calls import LlmCallFields, openai_llm_calls
from streams.sdk.outcomes import Outcome, OutcomeWatcher
from streams.sdk.plans import Subgoal, plan_subgoals
from streams.sdk.types import (
    _TOOL_STATUSES,
    DEFAULT_DELIVERY_TIMEOUT_S,
    Annotator,
    EdgeLike,
    LifecycleKind,
    NodeLike,
    ProducerError,
    StepRef,
    ToolCall,
    ToolStatus,
    _attrs,
    _edge,
    _member,
    _micros,
    _node,
    _params_json,
    _step_ref,
    _text,
)
from topics.codec import AvroCodec
from topics.event_checks import latency_problem, llm_call_problem
from topics.ids import now_micros, uuid7
from topics.names import DISPATCH, LIFECYCLE, LLM_CALL, PLAN_SUBMITTED, STATE_DELTA, TOOL_RESULT
from topics.settings import Settings
from topics.tool_schemas import InvalidParamsError, ToolSchemas

_INFINITY = float("inf")


class AgentStream(_Emitter):
    """One agent session's events; async. Use `async with`, or `start()` then `close()`.

    `seq` counts every event this stream emits, from 0; `step` counts its dispatches, from 0.
    Pass `producer=` (started, on this event loop) to share one producer among many streams: each
    stream then flushes only its own events and never stops the shared producer. `attributes` are put in every
    event's envelope (a call's own attributes win on a clash), e.g. the plan and subgoal an `Executor`'s work runs.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        agent_id: str,
        session_id: str | None = None,
        episode_id: str | None = None,
        policy_version: str = "",
        tool_schemas: ToolSchemas | None = None,
        producer: AIOKafkaProducer | None = None,
        producer_options: Mapping[str, Any] | None = None,
        codec: AvroCodec | None = None,
        delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(
            settings,
            agent_id=agent_id,
            policy_version=policy_version,
            producer=producer,
            producer_options=producer_options,
            codec=codec,
            delivery_timeout_s=delivery_timeout_s,
        )
        self._attributes = _attrs(attributes)
        self.session_id = session_id or uuid7()
        self.episode_id = episode_id or uuid7()
        self.tool_schemas = tool_schemas if tool_schemas is not None else ToolSchemas.load(self.settings.tool_schemas)
        self._step = 0
        self._episode_steps = 0  # dispatches since this stream switched to its current episode
        self._created_ms = time.time_ns() // 1_000_000  # outcomes are looked up in the log from here
        self._watcher: OutcomeWatcher | None = None
        self._watcher_starting: asyncio.Lock | None = None

    @property
    def next_step(self) -> int:
        """The step number the next dispatch will get."""
        return self._step

    @property
    def next_seq(self) -> int:
        """The seq the next event will get."""
        return self._seq

    async def dispatch(
        self,
        tool: str,
        params: dict[str, Any],
        *,
        deadline: datetime | timedelta | int | None = None,
        attributes: Mapping[str, Any] | None = None,
        trace_id: str | None = None,
        event_time: int | None = None,
    ) -> StepRef:
        """Open a step: validate `params` (InvalidParamsError before anything is sent), send, return its ids.

        Returns once the event is handed to the producer; the broker's ack is awaited by `flush()`.
        `deadline`: absolute datetime, timedelta from now, or UTC micros.
        """
        self._ready_to_send()
        if (problem := self.tool_schemas.error(tool, params)) is not None:  # ToolSchemas.validate, a call fewer
            raise InvalidParamsError(problem)
        try:
            params_json = _params_json(params)
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidParamsError(f"params of {tool} are not JSON-serializable: {exc}") from exc
        event_id = uuid7()
        trace = trace_id or event_id.replace("-", "")
        session_id, episode_id, step = self.session_id, self.episode_id, self._step
        # the record as a tuple of its fields in schema order, the envelope too (ENVELOPE_FIELDS): no dicts per event
        envelope = self._envelope_values(event_id, session_id, episode_id, event_id, self._seq, trace, attributes,
                                         event_time)  # fmt: skip
        at = envelope[6]  # event_time
        record = (envelope, step, tool, params_json, _micros(deadline))  # DISPATCH_FIELDS
        encoded = self._encode(DISPATCH, record)
        # No await between reading the counters and advancing them: concurrent dispatches never share a step.
        self._step += 1
        self._episode_steps += 1
        self._seq += 1
        if (waiting := self._send(DISPATCH, record, encoded, None, session_id)) is not None:
            await waiting
        return _step_ref(event_id, trace, step, session_id, episode_id, tool, at)

    def tool_call(self, step: StepRef) -> _AsyncToolCallContext:
        """Measure a tool call and emit its ToolResult on exit (OK, ERROR on exception, TIMEOUT on TimeoutError).

        The exception is re-raised; if emitting fails while one is in flight, the failure is kept
        for the next call / flush instead of replacing the tool's exception.
        """
        return _AsyncToolCallContext(self, step)

    async def tool_result(
        self,
        step: StepRef,
        status: ToolStatus | str,
        *,
        output: Any = None,
        error: str | None = None,
        latency_ms: float | None = None,
        cost_usd: float = 0.0,
        tokens_in: int = 0,
        tokens_out: int = 0,
        retries: int = 0,
        attributes: Mapping[str, Any] | None = None,
        event_time: int | None = None,
    ) -> str:
        """Record a tool's outcome explicitly; latency defaults to the time since the dispatch. Returns its event_id."""
        self._ready_to_send()
        event_id, waiting = self._tool_result_event(
            step, _member(ToolStatus, _TOOL_STATUSES, status), output, error, latency_ms, cost_usd, tokens_in,
            tokens_out, retries, attributes, event_time,
        )  # fmt: skip
        if waiting is not None:
            await waiting
        return event_id

    def _tool_result_event(
        self,
        step: StepRef,
        status: ToolStatus,
        output: Any,
        error: str | None,
        latency_ms: float | None,
        cost_usd: float,
        tokens_in: int,
        tokens_out: int,
        retries: int,
        attributes: Mapping[str, Any] | None,
        event_time: int | None,
    ) -> tuple[str, Coroutine[Any, Any, None] | None]:
        """Check, build, encode and hand over a ToolResult: its event_id, and what to await when the partition's
        batch was full (None almost always). Not a coroutine itself, and positional: once per tool result."""
        if latency_ms is None:
            latency_ms = max(0.0, (now_micros() - step.dispatched_at) / 1000.0) if step.dispatched_at else 0.0
        if not 0.0 <= (latency_ms := float(latency_ms)) < _INFINITY and (problem := latency_problem(latency_ms)):
            raise ValueError(problem)
        event_id = uuid7()
        session_id = step.session_id
        # the record as a tuple of its fields in schema order, the envelope too (ENVELOPE_FIELDS): no dicts per event
        envelope = self._envelope_values(event_id, session_id, step.episode_id, step.logical_event_id, self._seq,
                                         step.trace_id, attributes, event_time)  # fmt: skip
        # TOOL_RESULT_FIELDS; `status._value_`: `.value` is a descriptor call, once per event
        record = (
            envelope, step.tool, status._value_, output if type(output) is str else _text(output), error, latency_ms,
            float(cost_usd), int(tokens_in), int(tokens_out), int(retries),
        )  # fmt: skip
        encoded = self._encode(TOOL_RESULT, record)
        self._seq += 1
        return event_id, self._send(TOOL_RESULT, record, encoded, None, session_id)

    async def _emit_tool_call(self, call: ToolCall, in_flight: BaseException | None) -> None:
        """Emit a finished ToolCall (`_tool_call_result`, awaited)."""
        if (waiting := self._tool_call_result(call, in_flight)) is not None:
            await waiting

    def _tool_call_result(self, call: ToolCall, in_flight: BaseException | None) -> Coroutine[Any, Any, None] | None:
        """Emit a finished ToolCall; what to await when the partition's batch was full (None almost always). While
        the tool's own exception is `in_flight`, a failure here must not replace it: an undelivered event is kept
        for the next call / flush, anything else becomes a note on it."""
        if in_flight is None:
            self._ready_to_send()
        assert call.status is not None
        try:
            _, waiting = self._tool_result_event(
                call.step, _member(ToolStatus, _TOOL_STATUSES, call.status), call.output, call.error,
                call.latency_ms, call.cost_usd, call.tokens_in, call.tokens_out, call.retries, call.attributes, None,
            )  # fmt: skip
        except Exception as exc:
            self._keep_tool_call_failure(exc, in_flight)
            return None
        return None if waiting is None else self._await_tool_call(waiting, in_flight)

    async def _await_tool_call(self, waiting: Coroutine[Any, Any, None], in_flight: BaseException | None) -> None:
        try:
            await waiting
        except Exception as exc:
            self._keep_tool_call_failure(exc, in_flight)

    def _keep_tool_call_failure(self, exc: Exception, in_flight: BaseException | None) -> None:
        if in_flight is None:
            raise exc
        if isinstance(exc, ProducerError):
            self._failures.extend(exc.failed)
        in_flight.add_note(f"treadle could not record this tool call's result: {exc!r}")

    async def reward(
        self,
        target: StepRef | str,
        value: float,
        *,
        source: str,
        name: str = "reward",
        confidence: float = 1.0,
        annotator: Annotator | str = Annotator.CODE,
        evidence: str | None = None,
        session_id: str | None = None,
        episode_id: str | None = None,
        attributes: Mapping[str, Any] | None = None,
        event_time: int | None = None,
        event_id: str | None = None,
    ) -> str:
        """Emit a reward signal for a step (a StepRef, or a logical_event_id of this stream's session by default).

        `event_id`: give one derived from what was judged (e.g. a uuid5) when the same reward may be emitted again,
        by a re-run or a retry: the step assembler ignores a duplicate event_id. Default: a fresh uuid7."""
        if not isinstance(target, StepRef):
            session_id = session_id or self.session_id
            episode_id = self.episode_id if episode_id is None and session_id == self.session_id else episode_id
        event_id, waiting = self._reward_event(
            target, value, source, name, confidence, annotator, evidence, session_id, episode_id, None, attributes,
            event_time, event_id,
        )  # fmt: skip
        if waiting is not None:
            await waiting
        return event_id

    async def delta(
        self,
        *,
        node_upserts: Iterable[NodeLike] = (),
        node_deletes: Iterable[str] = (),
        edge_upserts: Iterable[EdgeLike] = (),
        edge_deletes: Iterable[EdgeLike] = (),
        rollback_to: str | None = None,
        step_ref: StepRef | None = None,
        attributes: Mapping[str, Any] | None = None,
        event_time: int | None = None,
    ) -> str:
        """Emit a state-graph change; tied to `step_ref` if given, else its logical_event_id is its own event_id."""
        self._ready_to_send()
        event_id = uuid7()
        record = {
            "envelope": self._envelope(
                event_id=event_id,
                session_id=self.session_id,
                episode_id=step_ref.episode_id if step_ref else self.episode_id,
                logical_event_id=step_ref.logical_event_id if step_ref else event_id,
                seq=self._seq,
                trace_id=step_ref.trace_id if step_ref else "",
                attributes=attributes,
                event_time=event_time,
            ),
            "node_upserts": [_node(n) for n in node_upserts],
            "node_deletes": [str(n) for n in node_deletes],
            "edge_upserts": [_edge(e) for e in edge_upserts],
            "edge_deletes": [_edge(e) for e in edge_deletes],
            "rollback_to": rollback_to,
        }
        encoded = self._encode(STATE_DELTA, record)
        self._seq += 1
        if (waiting := self._send(STATE_DELTA, record, encoded)) is not None:
            await waiting
        return event_id

    async def lifecycle(
        self,
        kind: LifecycleKind | str,
        *,
        done: bool = False,
        truncated: bool = False,
        reason: str | None = None,
        episode_id: str | None = None,
        attributes: Mapping[str, Any] | None = None,
        event_time: int | None = None,
        reward: float | None = None,
        steps: int | None = None,
    ) -> str:
        """Emit a session/episode phase change; `episode_id` switches this stream to that episode first.

        EPISODE_ENDED may carry the episode's `reward` (spread over its steps by the credit processor);
        `steps` defaults to the dispatches this stream made in the episode, which credit waits for.
        """
        self._ready_to_send()
        kind = LifecycleKind(kind)
        switching = bool(episode_id) and episode_id != self.episode_id
        if steps is None and kind is LifecycleKind.EPISODE_ENDED and not switching:
            steps = self._episode_steps
        event_id = uuid7()
        record = {
            "envelope": self._envelope(
                event_id=event_id,
                session_id=self.session_id,
                episode_id=episode_id or self.episode_id,
                logical_event_id=event_id,
                seq=self._seq,
                trace_id="",
                attributes=attributes,
                event_time=event_time,
            ),
            "kind": kind.value,
            "done": bool(done),
            "truncated": bool(truncated),
            "reason": reason,
            "reward": None if reward is None else float(reward),
            "steps": None if steps is None else int(steps),
        }
        encoded = self._encode(LIFECYCLE, record)
        if switching:
            self._episode_steps = 0
        if episode_id:
            self.episode_id = episode_id
        self._seq += 1
        if (waiting := self._send(LIFECYCLE, record, encoded)) is not None:
            await waiting
        return event_id

    async def llm_call(
        self,
        step: StepRef,
        *,
        model: str,
        provider: str = "",
        messages: Sequence[Mapping[str, Any]] | None = None,
        prompt_text: str = "",
        completion_text: str = "",
        prompt_token_ids: Sequence[int] = (),
        completion_token_ids: Sequence[int] = (),
        completion_logprobs: Sequence[float] = (),
        finish_reason: str = "",
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        cached_tokens: int = 0,
        latency_ms: float = 0.0,
        cost_usd: float = 0.0,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        max_tokens: int | None = None,
        params: Mapping[str, Any] | None = None,
        tool_calls: Sequence[Any] | None = None,
        request_id: str = "",
        response_id: str = "",
        choice_index: int = 0,
        attributes: Mapping[str, Any] | None = None,
        event_time: int | None = None,
    ) -> str:
        """Record one model call made inside `step`: what the model saw and said, for training triplets.

        `messages` (chat) and `params` (other request parameters) are stored as JSON. Token counts default to the
        lengths of the token id lists. Raises ValueError before sending when logprobs do not align with the
        completion's tokens, or when the encoded event is larger than one Kafka record may be. Returns its event_id.
        """
        fields = LlmCallFields(
            model=model,
            provider=provider,
            request_id=request_id,
            response_id=response_id,
            choice_index=choice_index,
            messages_json=_text(list(messages)) if messages is not None else "",
            prompt_text=prompt_text,
            completion_text=completion_text,
            tool_calls_json=_text(list(tool_calls)) if tool_calls else "",
            prompt_token_ids=list(prompt_token_ids),
            completion_token_ids=list(completion_token_ids),
            completion_logprobs=list(completion_logprobs),
            finish_reason=finish_reason,
            prompt_tokens=len(prompt_token_ids) if prompt_tokens is None else prompt_tokens,
            completion_tokens=len(completion_token_ids) if completion_tokens is None else completion_tokens,
            cached_tokens=cached_tokens,
            latency_ms=latency_ms,
            cost_usd=cost_usd,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            max_tokens=max_tokens,
            params_json=_text(dict(params)) if params else "",
        )
        return await self._llm_call(step, fields, attributes, event_time)

    async def llm_call_from_openai(
        self,
        step: StepRef,
        request: Mapping[str, Any] | Any,
        response: Mapping[str, Any] | Any,
        *,
        latency_ms: float = 0.0,
        provider: str = "openai",
        request_id: str = "",
        cost_usd: float = 0.0,
        attributes: Mapping[str, Any] | None = None,
        event_time: int | None = None,
    ) -> list[str]:
        """Record an OpenAI-compatible chat (or text) completion: one LlmCall per choice; their event_ids.

        `request` is what was sent (model, messages, sampling parameters), `response` the completion as a dict (or
        an object with `model_dump()`). Token ids are taken from vLLM's `prompt_token_ids` / `token_ids` when the
        server returns them. All choices are checked before any is sent.
        """
        calls = openai_llm_calls(
            request, response, latency_ms=latency_ms, provider=provider, request_id=request_id, cost_usd=cost_usd
        )
        for fields in calls:  # every problem before the first send
            if (problem := llm_call_problem(fields.record_fields())) is not None:
                raise ValueError(f"choice {fields.choice_index}: {problem}")
        return [await self._llm_call(step, fields, attributes, event_time) for fields in calls]

    def _step_envelope(
        self, step: StepRef, event_id: str, attributes: Mapping[str, Any] | None, event_time: int | None
    ) -> dict[str, Any]:
        """The envelope of an event about a dispatched step (a tool result, an LLM call): its ids and the next seq."""
        return self._envelope(
            event_id, step.session_id, step.episode_id, step.logical_event_id, self._seq, step.trace_id, attributes,
            event_time,
        )  # fmt: skip

    async def _llm_call(
        self,
        step: StepRef,
        fields: LlmCallFields,
        attributes: Mapping[str, Any] | None,
        event_time: int | None,
    ) -> str:
        self._ready_to_send()
        event_id = uuid7()
        record = {
            "envelope": self._step_envelope(step, event_id, attributes, event_time),
            **fields.record_fields(),
        }
        if (problem := llm_call_problem(record)) is not None:
            raise ValueError(problem)  # the worker would dead-letter it
        encoded = self._encode(LLM_CALL, record)
        self._seq += 1
        if (waiting := self._send(LLM_CALL, record, encoded)) is not None:
            await waiting
        return event_id

    # -- plans --------------------------------------------------------------------------------

    async def submit_plan(
        self,
        plan_id: str,
        subgoals: Iterable[Subgoal | Mapping[str, Any]],
        *,
        goal: str = "",
        attributes: Mapping[str, Any] | None = None,
        event_time: int | None = None,
    ) -> str:
        """Submit a plan for this stream's session and episode: a DAG of `Subgoal`s the plans scheduler releases to
        executors as their dependencies succeed and capacity allows. Returns the PlanSubmitted's event_id.

        Checked before anything is sent, with the scheduler's own refusals: `PlanRefused` (a ValueError) names the
        reason (a cycle, an unknown dependency, a repeated id, a bad retry policy...). Submitting the same plan again
        is harmless (the scheduler ignores it); a different plan under the same `plan_id` would be refused there.
        """
        self._check_ready()
        records = plan_subgoals(plan_id, [s if isinstance(s, Subgoal) else dict(s) for s in subgoals])
        event_id = uuid7()
        record = {
            "envelope": self._envelope(
                event_id=event_id,
                session_id=self.session_id,
                episode_id=self.episode_id,
                logical_event_id=plan_id,
                seq=self._seq,
                trace_id="",
                attributes=attributes,
                event_time=event_time,
            ),
            "plan_id": plan_id,
            "goal": goal,
            "subgoals": records,
        }
        await self._emit_plan_event(PLAN_SUBMITTED, record)
        return event_id

    # -- rewards back to the agent --------------------------------------------------------------

    async def outcome(self, step: StepRef | str, timeout: float = 60.0) -> Outcome:
        """The step's woven reward once its required sources are in (or their windows passed); else, at `timeout`
        seconds, a partial Outcome (`partial=True`, no value) with the reward signals seen so far.

        Read from the woven-rewards topic as the worker publishes it (OutcomeWatcher says why not SQL); works
        for steps of this stream's session dispatched since it was created.
        """
        lid = step.logical_event_id if isinstance(step, StepRef) else step
        number = step.step if isinstance(step, StepRef) else -1
        watcher = await self._outcome_watcher()
        return await watcher.outcome(lid, number, timeout)

    async def outcomes(self) -> AsyncIterator[Outcome]:
        """Woven rewards of this stream's session as the worker publishes them: first the latest revision of each
        step rewarded so far, then every new revision. Runs until the caller stops iterating."""
        watcher = await self._outcome_watcher()
        async for outcome in watcher.outcomes():
            yield outcome

    async def _outcome_watcher(self) -> OutcomeWatcher:
        self._check_ready()
        if self._watcher_starting is None:
            self._watcher_starting = asyncio.Lock()
        async with self._watcher_starting:
            if self._watcher is None:
                watcher = OutcomeWatcher(self.settings, self._codec, self.session_id, self._created_ms)
                await watcher.start({topic: await self._partitions_of(topic) for topic in watcher.topics})
                self._watcher = watcher
        return self._watcher

    async def close(self, timeout: float | None = None) -> None:
        """Flush, stop the producer if this stream created it, and stop reading outcomes."""
        try:
            await super().close(timeout)
        finally:
            if self._watcher is not None:
                watcher, self._watcher = self._watcher, None
                await watcher.stop()


class _AsyncToolCallContext:
    def __init__(self, stream: AgentStream, step: StepRef) -> None:
        self._stream = stream
        self._call = ToolCall(step)

    async def __aenter__(self) -> ToolCall:
        self._stream._check_ready()
        self._call._started = time.perf_counter()
        return self._call

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is not None and not isinstance(exc, Exception | asyncio.CancelledError):
            return False  # KeyboardInterrupt / SystemExit: the process is going down
        self._call._finish(exc)
        if (waiting := self._stream._tool_call_result(self._call, exc)) is not None:
            await waiting
        return False
