"""The LLM-judge adapter: posts each step's context to an HTTP endpoint and emits its score as a reward.

A step is judged once its dispatch (tool, params) and its tool result (status, output, error) are both in. They
arrive in any order and in different batches, so whichever comes first waits in a Faust table keyed by
logical_event_id (RocksDB + changelog, like the step table). Then the judge POSTs

    {"logical_event_id", "session_id", "tool", "params", "status", "output", "error", "policy_version"}

to TREADLE_LLM_JUDGE_URL, which answers {"score": [-1, 1], "confidence": [0, 1], "rationale": str}, and publishes
a RewardSignal (source and name "llm_judge", annotator LLM, evidence = the rationale cut to 500 characters,
event_id = uuid5 of the logical_event_id, event_time and seq of the tool result) that the step assembler weaves.

Exactly one call per step: after the call the table keeps the published signal instead of the halves, and any
later event of the step (a duplicate, a replay after a crash) re-publishes that signal without calling again;
the same event_id makes the re-publication a no-op downstream. Entries expire like the step table's: once the
partition's event watermark is TREADLE_STEP_RETENTION_S past the newest event time an entry holds, it is deleted
(processors/steps/expiry.py keeps the index, checked after each batch), so the table is bounded. A step's events that
come after that are a new step to the judge, which calls again.

Failures: a call that times out (TREADLE_LLM_JUDGE_TIMEOUT_S), answers non-2xx, or answers something that is not
a valid verdict is retried with exponential backoff (RetryPolicy); after the last attempt the step's input event
of this batch goes to dead letters (stage PROCESS, the reason names the URL and the last error). Both halves stay
in the table, and the step remembers which event it dead-lettered, so replaying that one event (or a later tool
result of the step) judges the step again.

Latency: the calls of a batch run concurrently (at most TREADLE_LLM_JUDGE_CONCURRENCY in flight), but the batch
ends only when the slowest step is judged or given up, so the judge's latency (up to attempts x timeout plus
backoff, ~31 s with the defaults) adds to the batch latency of every processor in the same worker. A deployment
that cannot afford that runs the judge in a worker of its own: TREADLE_PROCESSORS=llm_judge with its own
TREADLE_APP_ID (its own consumer group and table), TREADLE_WEB_PORT, TREADLE_HOME and TREADLE_SINK=off; it reads the
same input topics and its signals reach the main worker through the rewards topic like any other reward source's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import faust
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from processors.steps.expiry import StepExpiry
from processors.steps.watermarks import Watermarks
from streams.runtime import table_writes
from streams.runtime.plugins import PluginError
from streams.runtime.processor import InputEvent, ProcessingContext
from streams.runtime.value_limits import refuse, too_large
from topics.catalog import TopicCatalog
from topics.names import DISPATCH, REWARD, TOOL_RESULT
from topics.settings import Settings

log = logging.getLogger(__name__)

SOURCE = "llm_judge"
_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "treadle:llm_judge")
MAX_RATIONALE = 500
_MAX_ERROR_BODY = 200
EXPIRE_PER_BATCH = 5_000  # entries deleted per partition and batch at most, so one batch never stalls the input


class LlmJudgeError(RuntimeError):
    """A step the endpoint could not judge; the message names the URL and the last error (dead-letter reason)."""


class VerdictError(ValueError):
    """The endpoint answered 2xx with something that is not a verdict."""


class StatusError(Exception):
    """The endpoint answered with a status other than 2xx."""


# --- the wire format (pure) ----------------------------------------------------------------------------------------


class Verdict(BaseModel):
    """The endpoint's answer. Strict: a string "0.5" or a boolean is not a score; NaN and infinities are refused."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)

    score: float = Field(ge=-1.0, le=1.0)
    confidence: float = Field(default=1.0, ge=0.0, le=1.0)
    rationale: str = ""


def parse_verdict(body: bytes | str) -> Verdict:
    """The verdict in a response body; VerdictError says what is wrong with it."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise VerdictError(f"invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise VerdictError(f"expected a JSON object, got {type(data).__name__}")
    try:
        return Verdict.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
        raise VerdictError(f"invalid verdict: {problems}") from None


def judge_request(dispatch: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """What the endpoint is sent for one step; params decoded (they are a JSON object after validation)."""
    env = dispatch["envelope"]
    try:
        params: Any = json.loads(dispatch["params_json"])
    except ValueError:
        params = dispatch["params_json"]
    return {
        "logical_event_id": env["logical_event_id"],
        "session_id": env["session_id"],
        "tool": dispatch["tool"],
        "params": params,
        "status": result["status"],
        "output": result.get("output") or "",
        "error": result.get("error"),
        "policy_version": env.get("policy_version", ""),
    }


def signal_event_id(logical_event_id: str) -> str:
    """One signal per step, whatever triggered the call: a replay publishes the same event."""
    return str(uuid.uuid5(_ID_NAMESPACE, f"{logical_event_id}/{SOURCE}"))


def llm_signal(dispatch: dict[str, Any], result: dict[str, Any], verdict: Verdict) -> dict[str, Any]:
    """The RewardSignal for a judged step: the dispatch's envelope ids, the tool result's time and seq."""
    env, result_env = dispatch["envelope"], result["envelope"]
    rationale = verdict.rationale
    if len(rationale) > MAX_RATIONALE:
        rationale = rationale[: MAX_RATIONALE - 1] + "…"
    return {
        "envelope": {
            "event_id": signal_event_id(env["logical_event_id"]),
            "session_id": env["session_id"],
            "agent_id": env["agent_id"],
            "episode_id": env["episode_id"],
            "logical_event_id": env["logical_event_id"],
            "seq": result_env["seq"],
            "event_time": result_env["event_time"],
            "policy_version": env.get("policy_version", ""),
            "trace_id": env.get("trace_id", ""),
            "attributes": {"judge": SOURCE, "judged_event_id": result_env["event_id"]},
        },
        "source": SOURCE,
        "name": SOURCE,
        "value": verdict.score,
        "confidence": verdict.confidence,
        "annotator": "LLM",
        "evidence": rationale or None,
    }


# --- the HTTP client -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts per step and the pause before each retry (doubling, capped): bounded, so a batch always ends."""

    attempts: int = 3
    first_backoff_s: float = 0.2
    max_backoff_s: float = 2.0

    def backoff_s(self, retry: int) -> float:
        """The pause before retry number `retry` (1-based)."""
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** (retry - 1))


@dataclass
class JudgeClient:
    """POSTs steps to the endpoint: one aiohttp session per worker, `concurrency` calls in flight at most."""

    url: str
    timeout_s: float = 10.0
    concurrency: int = 8
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    _session: aiohttp.ClientSession | None = field(default=None, init=False, repr=False)
    _slots: asyncio.Semaphore | None = field(default=None, init=False, repr=False)

    def _open(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        # Created lazily, inside the worker's running event loop (aiohttp binds a session to its loop).
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.concurrency)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrency)
        return self._session, self._slots

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def judge(self, request: dict[str, Any]) -> Verdict:
        """The endpoint's verdict on one step, retried per the policy; LlmJudgeError after the last attempt."""
        session, slots = self._open()
        last = ""
        for attempt in range(1, self.retry.attempts + 1):
            if attempt > 1:
                await asyncio.sleep(self.retry.backoff_s(attempt - 1))  # the slot is free while waiting
            async with slots:
                try:
                    return await self._call(session, request)
                except TimeoutError:
                    last = f"timed out after {self.timeout_s:g} s"
                except (aiohttp.ClientError, StatusError, VerdictError) as exc:
                    last = str(exc) or type(exc).__name__
            log.warning("llm_judge: %s attempt %d/%d: %s", self.url, attempt, self.retry.attempts, last)
        raise LlmJudgeError(f"POST {self.url} failed {self.retry.attempts} times; last error: {last}")

    async def _call(self, session: aiohttp.ClientSession, request: dict[str, Any]) -> Verdict:
        async with session.post(self.url, json=request) as response:
            body = await response.read()
            if not 200 <= response.status < 300:
                text = body[:_MAX_ERROR_BODY].decode("utf-8", "replace")
                raise StatusError(f"HTTP {response.status}: {text}")
            return parse_verdict(body)


# --- state ---------------------------------------------------------------------------------------------------------


@dataclass
class PendingStep:
    """One step as the judge knows it: the halves seen so far, or, once judged, the signal it published."""

    dispatch: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    signal: dict[str, Any] | None = None
    dead_lettered: str | None = None  # event_id of the input dead-lettered when the last call failed

    def retries_on(self, schema_name: str, record: dict[str, Any]) -> bool:
        """Whether this event asks for the call again: a tool result, or the event a failed call dead-lettered."""
        return schema_name == TOOL_RESULT or record["envelope"]["event_id"] == self.dead_lettered

    @property
    def ready(self) -> bool:
        return self.signal is None and self.dispatch is not None and self.result is not None

    @property
    def horizon_us(self) -> int:
        """The newest event time it holds; the entry is kept TREADLE_STEP_RETENTION_S of event time past it."""
        held = [record for record in (self.dispatch, self.result, self.signal) if record is not None]
        return max(record["envelope"]["event_time"] for record in held)

    def fold(self, schema_name: str, record: dict[str, Any]) -> bool:
        """Keep the earliest dispatch and the latest result (as the step assembler does); True if changed."""
        if self.signal is not None:
            return False
        if schema_name == DISPATCH and (self.dispatch is None or _order(record) < _order(self.dispatch)):
            self.dispatch = record
            return True
        if schema_name == TOOL_RESULT and (self.result is None or _order(record) > _order(self.result)):
            self.result = record
            return True
        return False

    def judged(self, signal: dict[str, Any]) -> None:
        self.dispatch = self.result = self.dead_lettered = None  # the signal is all a later duplicate needs
        self.signal = signal

    def to_bytes(self) -> bytes:
        return orjson.dumps({"d": self.dispatch, "r": self.result, "s": self.signal, "f": self.dead_lettered})

    @classmethod
    def from_bytes(cls, data: bytes) -> PendingStep:
        raw = orjson.loads(data)
        return cls(raw.get("d"), raw.get("r"), raw.get("s"), raw.get("f"))


def _order(record: dict[str, Any]) -> tuple[int, str]:
    env = record["envelope"]
    return env["seq"], env["event_id"]


@dataclass
class _Touched:
    step: PendingStep
    event: InputEvent  # any event of the step (its session's partition and key)
    changed: bool = False
    # What asks for a judgement in this batch, dead-lettered if the call fails: a tool result (a replayed one
    # too), a dispatch that completed the step, or the event a failed call dead-lettered (its replay is how a dead
    # letter is retried). Not any other duplicate dispatch, so a replay calls the judge once per step however the
    # records fall into batches.
    trigger: InputEvent | None = None


# --- the processor -------------------------------------------------------------------------------------------------


class LlmJudge:
    """Posts each step (tool, params, result) to TREADLE_LLM_JUDGE_URL and emits its score as an LLM reward."""

    name = SOURCE
    kind = "reward_source"
    inputs = frozenset({DISPATCH, TOOL_RESULT})

    def __init__(self, client: JudgeClient | None = None) -> None:
        self.client = client
        self.table: Any = None  # faust.Table[bytes, bytes]
        self.expiry = StepExpiry()
        self.watermarks = Watermarks(5.0, 30.0)
        self.max_step_bytes = Settings.model_fields["max_event_bytes"].default  # TREADLE_MAX_EVENT_BYTES

    def setup(self, app: faust.App, settings: Settings) -> None:
        if self.client is None:
            if not settings.llm_judge_url:
                raise PluginError(
                    f"processor {self.name} needs TREADLE_LLM_JUDGE_URL (the judge endpoint); set it or remove "
                    f"{self.name} from TREADLE_PROCESSORS"
                )
            self.client = JudgeClient(
                settings.llm_judge_url, settings.llm_judge_timeout_s, settings.llm_judge_concurrency
            )
        self.table = table_writes.bytes_table(
            app,
            self.name,
            settings,
            help="PendingStep per logical_event_id (halves awaiting a call, or the published signal), orjson.",
        )
        self.expiry.setup(app, settings, self.name)
        self.max_step_bytes = settings.max_event_bytes
        topics = [spec.name for spec in TopicCatalog(settings).inputs if spec.value_schema in self.inputs]
        self.watermarks = Watermarks(settings.watermark_lag_s, settings.idle_timeout_s, topics=topics)
        app.on_before_shutdown.connect(self._close)

    async def _close(self, app: faust.App, **kwargs: Any) -> None:
        if self.client is not None:
            await self.client.close()

    async def process(self, events: list[InputEvent], ctx: ProcessingContext) -> None:
        client = self.client
        assert client is not None, "setup() was not called"
        touched: dict[bytes, _Touched] = {}
        for event in events:
            env = event.record["envelope"]
            self.watermarks.observe(event.source.partition, event.source.topic, env["event_time"])
            key = env["logical_event_id"].encode()
            entry = touched.get(key)
            try:
                if entry is None:
                    ctx.bind(event)
                    stored = self.table.get(key)
                    step = PendingStep.from_bytes(stored) if stored is not None else PendingStep()
                    entry = touched[key] = _Touched(step, event)
                retries = entry.step.retries_on(event.schema_name, event.record)
                before = (entry.step.dispatch, entry.step.result)
                changed = entry.step.fold(event.schema_name, event.record)
                if changed and (size := len(entry.step.to_bytes())) > self.max_step_bytes:
                    entry.step.dispatch, entry.step.result = before  # a step holds one of each: small to measure
                    what = f"judged step {env['logical_event_id']!r}"
                    await refuse(ctx, self.name, event, too_large(self.name, what, size, self.max_step_bytes))
                    continue
                entry.changed |= changed
                if retries or (changed and entry.trigger is None):
                    entry.trigger = event
            except Exception as exc:  # corrupt state or a bug: dead-letter this event, keep the batch going
                await ctx.failed(self.name, event, exc)
        ready = [entry for entry in touched.values() if entry.step.ready and entry.trigger is not None]
        verdicts = await asyncio.gather(
            *(client.judge(judge_request(e.step.dispatch, e.step.result)) for e in ready),  # type: ignore[arg-type]
            return_exceptions=True,
        )
        for entry, verdict in zip(ready, verdicts, strict=True):
            if isinstance(verdict, BaseException):
                if not isinstance(verdict, Exception):
                    raise verdict  # cancellation: the worker is stopping
                assert entry.trigger is not None
                await ctx.failed(self.name, entry.trigger, verdict)
                entry.step.dead_lettered = entry.trigger.record["envelope"]["event_id"]
                entry.changed = True
                continue
            assert entry.step.dispatch is not None and entry.step.result is not None
            entry.step.judged(llm_signal(entry.step.dispatch, entry.step.result, verdict))
            entry.changed = True
        for key, entry in touched.items():
            if entry.changed:
                await table_writes.put(self.table, key, entry.step.to_bytes(), entry.event, ctx)
                await self._index_expiry(key.decode(), entry.step, entry.event.source.partition, ctx)
            if entry.step.signal is not None:
                # Also for duplicates of a judged step: a crash may have lost the first publication.
                await ctx.publish(REWARD, entry.step.signal, key=entry.event.session_key)
        for partition in {entry.event.source.partition for entry in touched.values()}:
            self.watermarks.advance(partition)
            progress = self.watermarks.event_watermark(partition)  # events' progress only, as for the step table
            if progress is not None:
                await self._expire_due(partition, progress, ctx)

    async def _index_expiry(self, lid: str, step: PendingStep, partition: int, ctx: ProcessingContext) -> None:
        expires = self.expiry.expires_us(step.horizon_us)
        if not self.expiry.is_indexed(expires, lid, partition):
            await self.expiry.index(expires, lid, partition, ctx)

    async def _expire_due(self, partition: int, watermark: int, ctx: ProcessingContext) -> None:
        for due in self.expiry.due(partition, watermark, EXPIRE_PER_BATCH):
            await self.expiry.unindex(due, partition, ctx)
            key = due.logical_event_id.encode()
            stored = table_writes.get_in_partition(self.table, key, partition)
            if stored is None:
                continue
            step = PendingStep.from_bytes(stored)
            if self.expiry.expires_us(step.horizon_us) > watermark:  # a newer event moved it since the entry
                await self._index_expiry(due.logical_event_id, step, partition, ctx)
                continue
            await table_writes.delete_in_partition(self.table, key, partition, ctx)
