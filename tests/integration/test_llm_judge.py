"""The LLM-judge adapter: the wire format, the client's retries against a local HTTP server, the fold, and the real
pipeline (broker + worker + chDB) scoring steps, retrying, and dead-lettering a step the endpoint never judges.

The endpoint is an aiohttp server this test starts on 127.0.0.1 (port 0: the kernel picks a free one). It scores
deterministically from the output's length, and follows a per-step script of failures ("500", "garbage", "slow").
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

from processors.judges.llm import (
    MAX_RATIONALE,
    JudgeClient,
    LlmJudge,
    LlmJudgeError,
    PendingStep,
    RetryPolicy,
    Verdict,
    VerdictError,
    judge_request,
    llm_signal,
    parse_verdict,
    signal_event_id,
)
from processors.steps.expiry import DueStep
from sinks.sql_client import run_sql
from streams.runtime.plugins import PluginError, ProcessorRegistry
from streams.runtime.processor import InputEvent
from tests.factories import dispatch, result, step_components, wait_for
from tests.integration.test_pipeline import produce
from tests.paths import REPO_ROOT
from topics.codec import AvroCodec
from topics.ids import uuid7
from topics.settings import Settings

DISPATCH, RESULT, REWARD = (
    "treadle.events.ActionDispatched",
    "treadle.events.ToolResult",
    "treadle.events.RewardSignal",
)
FAST = RetryPolicy(attempts=3, first_backoff_s=0.01, max_backoff_s=0.05)


def verdict_for(output: str) -> dict[str, Any]:
    """The test endpoint's deterministic score: -1 for an empty output, +1 from 200 characters on."""
    return {
        "score": min(len(output), 200) / 100 - 1,
        "confidence": 0.8,
        "rationale": f"the output has {len(output)} characters. " * 20,  # > 500 characters: evidence is cut
    }


def evidence_for(output: str) -> str:
    rationale = verdict_for(output)["rationale"]
    return rationale[: MAX_RATIONALE - 1] + "…"


class JudgeServer:
    """A judge endpoint on 127.0.0.1 in a thread of its own (the worker under test is another process)."""

    def __init__(self, script: dict[str, list[str]] | None = None, slow_s: float = 1.0) -> None:
        self.script = script or {}  # logical_event_id -> what its 1st, 2nd, ... call gets; then a verdict
        self.slow_s = slow_s
        self.calls: Counter[str] = Counter()
        self.requests: dict[str, dict[str, Any]] = {}
        self.in_flight = self.max_in_flight = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.url = ""

    def __enter__(self) -> JudgeServer:
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_post("/judge", self._judge)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        host, port = self.runner.addresses[0][:2]
        return f"http://{host}:{port}/judge"

    async def _judge(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        lid = body["logical_event_id"]
        self.calls[lid] += 1
        self.requests[lid] = body
        script = self.script.get(lid, [])
        action = script[self.calls[lid] - 1] if self.calls[lid] <= len(script) else "ok"
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.slow_s if action == "slow" else 0.02)
        finally:
            self.in_flight -= 1
        if action == "500":
            return web.Response(status=500, text="judge overloaded")
        if action == "garbage":
            return web.Response(text="<html>not json</html>", content_type="text/html")
        if action == "out_of_range":
            return web.json_response({"score": 3.0, "confidence": 1.0, "rationale": "too good"})
        return web.json_response(verdict_for(body["output"]))


# --- wire format (pure) ----------------------------------------------------------------------------------------------


def test_a_verdict_is_parsed_strictly() -> None:
    assert parse_verdict(b'{"score": -0.5, "confidence": 0.25, "rationale": "meh"}') == Verdict(
        score=-0.5, confidence=0.25, rationale="meh"
    )
    assert parse_verdict('{"score": 1, "extra": true}') == Verdict(score=1.0, confidence=1.0, rationale="")
    for body, problem in [
        ("not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"confidence": 1}', "score: Field required"),
        ('{"score": 1.5}', "score: Input should be less than or equal to 1"),
        ('{"score": -1.01}', "score: Input should be greater than or equal to -1"),
        ('{"score": "0.5"}', "score: Input should be a valid number"),
        ('{"score": true}', "score: Input should be a valid number"),
        ('{"score": NaN}', "score: Input should be a finite number"),
        ('{"score": 0, "confidence": 2}', "confidence: Input should be less than or equal to 1"),
        ('{"score": 0, "rationale": 5}', "rationale: Input should be a valid string"),
    ]:
        with pytest.raises(VerdictError, match=problem):
            parse_verdict(body)


def test_the_request_carries_the_steps_context_and_the_signal_its_verdict() -> None:
    d = dispatch("s-1", "l-1", 0, 1, tool="search", params='{"q": "weather"}')
    r = {**result("s-1", "l-1", 2, status="ERROR"), "output": "", "error": "boom"}
    assert judge_request(d, r) == {
        "logical_event_id": "l-1",
        "session_id": "s-1",
        "tool": "search",
        "params": {"q": "weather"},
        "status": "ERROR",
        "output": "",
        "error": "boom",
        "policy_version": "v1",
    }
    signal = llm_signal(d, r, Verdict(score=0.25, confidence=0.5, rationale="x" * 600))
    assert signal == {
        "envelope": {
            "event_id": signal_event_id("l-1"),
            "session_id": "s-1",
            "agent_id": "agent-test",
            "episode_id": "s-1-ep0",
            "logical_event_id": "l-1",
            "seq": 2,
            "event_time": r["envelope"]["event_time"],
            "policy_version": "v1",
            "trace_id": "trace-l-1",
            "attributes": {"judge": "llm_judge", "judged_event_id": r["envelope"]["event_id"]},
        },
        "source": "llm_judge",
        "name": "llm_judge",
        "value": 0.25,
        "confidence": 0.5,
        "annotator": "LLM",
        "evidence": "x" * 499 + "…",
    }
    assert len(signal["evidence"]) == MAX_RATIONALE
    assert signal_event_id("l-1") == signal_event_id("l-1") != signal_event_id("l-2")
    codec = AvroCodec()
    assert codec.decode(codec.encode(REWARD, signal), expect=REWARD)[1] == signal
    assert llm_signal(d, r, Verdict(score=0.0))["evidence"] is None


def test_a_pending_step_keeps_the_earliest_dispatch_and_latest_result_in_any_order() -> None:
    d1, d2 = dispatch("s-1", "l-1", 0, 1), dispatch("s-1", "l-1", 0, 5)
    r1, r2 = result("s-1", "l-1", 2), result("s-1", "l-1", 3)
    for order in ([d1, r1, d2, r2], [r2, d2, r1, d1], [r1, r2, d2, d1]):
        step = PendingStep()
        for record in order:
            step.fold(DISPATCH if "step" in record else RESULT, record)
        assert (step.dispatch, step.result, step.ready) == (d1, r2, True)
        assert PendingStep.from_bytes(step.to_bytes()) == step
    assert PendingStep().fold(DISPATCH, d1) is True
    step = PendingStep(d1, r1)
    assert step.fold(DISPATCH, d1) is False, "a duplicate changes nothing"
    step.judged({"envelope": {}})
    assert (step.dispatch, step.result, step.ready) == (None, None, False)
    assert step.fold(RESULT, r2) is False, "a judged step takes no more input"
    assert PendingStep.from_bytes(step.to_bytes()) == step


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [RetryPolicy(5, 0.2, 1.0).backoff_s(n) for n in range(1, 5)] == [0.2, 0.4, 0.8, 1.0]


def test_llm_judge_refuses_to_start_without_a_url() -> None:
    with pytest.raises(PluginError, match="processor llm_judge needs TREADLE_LLM_JUDGE_URL"):
        LlmJudge().setup(None, Settings())  # type: ignore[arg-type]
    registry = ProcessorRegistry.discover()
    assert registry.load("llm_judge") is LlmJudge
    (info,) = [i for i in registry.describe()[0] if i.name == "llm_judge"]
    assert info.kind == "reward_source" and info.inputs == (DISPATCH, RESULT)


def test_a_worker_with_llm_judge_and_no_url_stops_with_one_line(tmp_path) -> None:
    env = {**os.environ, "TREADLE_HOME": str(tmp_path), "TREADLE_PROCESSORS": "steps,llm_judge"}
    env.pop("TREADLE_LLM_JUDGE_URL", None)
    done = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "worker"], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: processor llm_judge needs TREADLE_LLM_JUDGE_URL")


# --- the client against a local server -------------------------------------------------------------------------------


def request_for(lid: str, output: str = "abc") -> dict[str, Any]:
    return judge_request(dispatch("s-1", lid, 0, 1), {**result("s-1", lid, 2), "output": output})


async def test_the_client_retries_failures_then_gives_up_naming_the_url() -> None:
    script = {"flaky": ["500", "garbage"], "down": ["500"] * 5, "junk": ["garbage"] * 5, "wild": ["out_of_range"] * 5}
    with JudgeServer(script) as server:
        client = JudgeClient(server.url, timeout_s=5, retry=FAST)
        try:
            assert await client.judge(request_for("flaky", "x" * 50)) == Verdict(**verdict_for("x" * 50))
            assert server.calls["flaky"] == 3
            with pytest.raises(LlmJudgeError) as down:
                await client.judge(request_for("down"))
            assert str(down.value) == f"POST {server.url} failed 3 times; last error: HTTP 500: judge overloaded"
            with pytest.raises(LlmJudgeError, match="last error: invalid JSON"):
                await client.judge(request_for("junk"))
            with pytest.raises(LlmJudgeError, match="last error: invalid verdict: score: Input should be less"):
                await client.judge(request_for("wild"))
            assert (server.calls["down"], server.calls["junk"], server.calls["wild"]) == (3, 3, 3)
        finally:
            await client.close()


async def test_a_slow_endpoint_times_out_and_calls_run_concurrently_up_to_the_limit() -> None:
    with JudgeServer({"slow": ["slow"] * 5}, slow_s=2.0) as server:
        client = JudgeClient(server.url, timeout_s=0.3, retry=RetryPolicy(2, 0.01, 0.01))
        try:
            with pytest.raises(LlmJudgeError, match=r"last error: timed out after 0\.3 s"):
                await client.judge(request_for("slow"))
            assert server.calls["slow"] == 2
        finally:
            await client.close()
    with JudgeServer() as server:
        client = JudgeClient(server.url, timeout_s=5, concurrency=2, retry=FAST)
        try:
            verdicts = await asyncio.gather(*(client.judge(request_for(f"l-{i}", "y" * i)) for i in range(8)))
            assert [v.score for v in verdicts] == [verdict_for("y" * i)["score"] for i in range(8)]
            assert server.max_in_flight == 2
        finally:
            await client.close()


# --- the processor on a fake table -----------------------------------------------------------------------------------


class FakeTable(dict):
    """What LlmJudge and table_writes use of a Faust table: get, data, changelog_topic, a partition's RocksDB."""

    offset_key = b"__offset__"

    def __init__(self) -> None:
        super().__init__()
        self.data = self
        self.changelog_topic = SimpleNamespace(get_topic_name=lambda: "llm_judge-changelog")

    def keys(self) -> list[bytes]:  # type: ignore[override]
        return sorted(super().keys())  # RocksDB iterates in key order

    def _db_for_partition(self, partition: int) -> FakeTable:
        return self  # one partition here

    def put(self, key: bytes, value: bytes) -> None:
        self[key] = value

    def delete(self, key: bytes) -> None:
        self.pop(key, None)


class FakeContext:
    def __init__(self) -> None:
        self.published: list[tuple[str, dict[str, Any], bytes | None]] = []
        self.sent: list[tuple[str, bytes | None, bytes | None, int | None]] = []
        self.failures: list[tuple[str, InputEvent, Exception]] = []

    async def publish(self, schema_name: str, record: dict[str, Any], key: bytes | None) -> None:
        self.published.append((schema_name, record, key))

    async def send(self, topic: str, key: bytes | None, value: bytes | None, partition: int | None = None) -> None:
        self.sent.append((topic, key, value, partition))

    def bind(self, event: InputEvent) -> None:
        pass

    async def failed(self, processor: str, event: InputEvent, exc: Exception) -> None:
        self.failures.append((processor, event, exc))


def event_of(schema_name: str, record: dict[str, Any]) -> InputEvent:
    return InputEvent(schema_name, record, source=SimpleNamespace(partition=0, topic=schema_name))  # type: ignore[arg-type]


def fake_tables(judge: LlmJudge) -> LlmJudge:
    judge.table, judge.expiry.table = FakeTable(), FakeTable()
    return judge


async def test_the_processor_judges_each_step_once_and_dead_letters_what_fails() -> None:
    d_ok, r_ok = dispatch("s-1", "ok", 0, 1), {**result("s-1", "ok", 2), "output": "z" * 40}
    d_bad, r_bad = dispatch("s-1", "bad", 1, 3), result("s-1", "bad", 4)
    with JudgeServer({"bad": ["500"] * 10, "late": ["500"] * 10}) as server:
        judge = fake_tables(LlmJudge(JudgeClient(server.url, timeout_s=5, retry=FAST)))
        try:
            ctx = FakeContext()
            await judge.process([event_of(RESULT, r_ok), event_of(DISPATCH, d_bad)], ctx)  # halves only
            assert (ctx.published, ctx.failures, server.calls) == ([], [], Counter())
            await judge.process([event_of(DISPATCH, d_ok), event_of(RESULT, r_bad)], ctx)
            [(schema, signal, key)] = ctx.published
            assert (schema, key, signal) == (REWARD, b"s-1", llm_signal(d_ok, r_ok, Verdict(**verdict_for("z" * 40))))
            [(name, failed_event, exc)] = ctx.failures
            assert (name, failed_event.record) == ("llm_judge", r_bad)
            assert repr(exc).startswith(f"LlmJudgeError('POST {server.url} failed 3 times; last error: HTTP 500")
            assert server.calls == Counter({"ok": 1, "bad": 3})

            # Duplicates: the judged step re-publishes its signal without a call; the failed one is tried again
            # when its tool result is replayed (the dead letter), not on a duplicate dispatch, so a replay of
            # both calls once whatever batches they fall into.
            again = FakeContext()
            await judge.process([event_of(RESULT, r_ok), event_of(DISPATCH, d_bad)], again)
            assert [s for _, s, _ in again.published] == [signal]
            assert (again.failures, server.calls) == ([], Counter({"ok": 1, "bad": 3}))
            await judge.process([event_of(DISPATCH, d_bad), event_of(RESULT, r_bad)], again)
            assert [e.record for _, e, _ in again.failures] == [r_bad]
            assert server.calls == Counter({"ok": 1, "bad": 6})
            assert PendingStep.from_bytes(judge.table[b"ok"]).signal == signal
            assert PendingStep.from_bytes(judge.table[b"bad"]).ready

            # A step completed by its dispatch (its result came first) dead-letters that dispatch when the call
            # fails, and remembers it: replaying the dead letter calls again.
            d_late, r_late = dispatch("s-1", "late", 2, 5), result("s-1", "late", 6)
            late = FakeContext()
            await judge.process([event_of(RESULT, r_late)], late)
            await judge.process([event_of(DISPATCH, d_late)], late)
            assert [e.record for _, e, _ in late.failures] == [d_late] and server.calls["late"] == 3
            assert PendingStep.from_bytes(judge.table[b"late"]).dead_lettered == d_late["envelope"]["event_id"]
            await judge.process([event_of(DISPATCH, d_late)], late)
            assert [e.record for _, e, _ in late.failures] == [d_late, d_late] and server.calls["late"] == 6
        finally:
            await judge.client.close()  # type: ignore[union-attr]


async def test_an_entry_is_deleted_once_the_event_watermark_is_the_retention_past_its_newest_event() -> None:
    """Retention 10 s, watermark lag 5 s: step `old` (judged at T + 1 s) goes once the events of both input topics
    reach T + 16.5 s (event watermark T + 11.5 s); steps whose newest event is within the retention stay, and so do
    their expiry entries."""
    t = 1_800_000_000_000_000

    def at(record: dict[str, Any], seconds: float) -> dict[str, Any]:
        record["envelope"]["event_time"] = t + int(seconds * 1_000_000)
        return record

    with JudgeServer() as server:
        judge = fake_tables(LlmJudge(JudgeClient(server.url, timeout_s=5, retry=FAST)))
        judge.expiry.retention_us = 10_000_000
        try:
            ctx = FakeContext()
            old = [
                event_of(DISPATCH, at(dispatch("s-1", "old", 0, 1), 0)),
                event_of(RESULT, at(result("s-1", "old", 2), 1)),
            ]
            await judge.process(old, ctx)
            assert b"old" in judge.table and server.calls["old"] == 1
            await judge.process([event_of(DISPATCH, at(dispatch("s-1", "new", 1, 3), 12))], ctx)
            assert b"old" in judge.table, "the results topic (newest T + 1 s) holds the watermark back"
            later = [
                event_of(RESULT, at(result("s-1", "new", 4), 16.5)),
                event_of(DISPATCH, at(dispatch("s-1", "newer", 2, 5), 16.5)),
            ]
            await judge.process(later, ctx)
            assert b"old" not in judge.table and b"new" in judge.table and b"newer" in judge.table
            # `new` has two: its dispatch's (due at T + 22 s) and its result's; the first, due, finds it not expired
            assert [DueStep.parse(k).logical_event_id for k in judge.expiry.table] == ["new", "new", "newer"]
        finally:
            await judge.client.close()  # type: ignore[union-attr]


# --- end to end ------------------------------------------------------------------------------------------------------


def judge_components(settings: Settings, session: str) -> dict[str, dict[str, Any]]:
    """Per step: its transition revision and its llm_judge components {event_id: (value, confidence, evidence)}."""
    rows = step_components(settings, session, "llm_judge")
    return {lid: {"revision": row["revision"], "judge": row["components"]} for lid, row in rows.items()}


def dead_letters(settings: Settings, session: str) -> list[dict[str, Any]]:
    columns, rows = run_sql(
        settings,
        "SELECT stage, reason, event_id, schema_name, offset FROM dead_letters_latest "
        f"WHERE session_id = '{session}' ORDER BY offset",
    )
    return [dict(zip(columns, row, strict=True)) for row in rows]


def test_llm_judge_scores_steps_retries_and_dead_letters_on_the_real_pipeline(
    deployment: Settings, worker_factory
) -> None:
    session = f"ljudge-{uuid7()[-12:]}"
    broken, ok1, ok2, flaky = (uuid7() for _ in range(4))
    outputs = {broken: "never judged", ok1: "", ok2: "o" * 120, flaky: "f" * 250}
    steps = {}
    for seq, lid in enumerate((broken, ok1, ok2, flaky)):
        d = dispatch(session, lid, seq, 2 * seq + 1, params=f'{{"q": "step {seq}"}}')
        steps[lid] = (d, {**result(session, lid, 2 * seq + 2), "output": outputs[lid]})
    first = [(DISPATCH, steps[broken][0]), (RESULT, steps[broken][1])]
    rest = [(name, rec) for lid in (ok1, ok2, flaky) for name, rec in zip((DISPATCH, RESULT), steps[lid], strict=True)]
    judged = (ok1, ok2, flaky)
    expected = {
        lid: {signal_event_id(lid): (verdict_for(outputs[lid])["score"], 0.8, evidence_for(outputs[lid]))}
        for lid in judged
    }

    with JudgeServer({flaky: ["500", "500"], broken: ["500"] * 100}) as server:
        settings = deployment.model_copy(
            update={"processors": ("steps", "llm_judge"), "llm_judge_url": server.url, "llm_judge_timeout_s": 5.0}
        )
        worker = worker_factory(settings).start()
        worker.wait_ready()
        # A warm-up step first: a new worker re-reads partitions it has not committed yet (streams/start_positions.py),
        # and what it reads twice meanwhile would call the endpoint twice for a failing step.
        warm, warm_session = uuid7(), f"warm-{session}"
        warm_up = [(DISPATCH, dispatch(warm_session, warm, 0, 1)), (RESULT, result(warm_session, warm, 2))]
        asyncio.run(produce(settings, warm_up))
        wait_for(
            lambda: judge_components(settings, warm_session).get(warm, {}).get("judge"), 180, "the warm-up step",
            explain=lambda: f"{server.calls}\n{worker.log_tail(40)}",
        )  # fmt: skip
        time.sleep(2)
        asyncio.run(produce(settings, first))  # the step the endpoint never judges comes first
        asyncio.run(produce(settings, rest))

        def done() -> dict | None:
            rows = judge_components(settings, session)
            complete = len(rows) == 4 and all(rows[lid]["judge"] for lid in judged)
            return rows if complete and dead_letters(settings, session) else None

        rows = wait_for(
            done, 180, "three judged steps and one dead letter",
            explain=lambda: f"{judge_components(settings, session)}\n{server.calls}\n{worker.log_tail(40)}",
        )  # fmt: skip
        assert {lid: rows[lid]["judge"] for lid in judged} == expected
        assert rows[broken] == {"revision": 2, "judge": {}}, "the step itself is assembled without the judge"
        assert {lid: rows[lid]["revision"] for lid in judged} == dict.fromkeys(judged, 3)
        assert server.calls[flaky] == 3, "500, 500, 200: the third attempt succeeds"
        assert (server.calls[ok1], server.calls[ok2], server.calls[broken]) == (1, 1, 3)
        d_ok2 = steps[ok2][0]
        assert server.requests[ok2] == {
            "logical_event_id": ok2,
            "session_id": session,
            "tool": "search",
            "params": {"q": "step 2"},
            "status": "OK",
            "output": outputs[ok2],
            "error": None,
            "policy_version": d_ok2["envelope"]["policy_version"],
        }
        [letter] = dead_letters(settings, session)
        assert (letter["stage"], letter["schema_name"]) == ("PROCESS", RESULT)
        assert letter["event_id"] == steps[broken][1]["envelope"]["event_id"]
        assert server.url in letter["reason"] and "HTTP 500: judge overloaded" in letter["reason"]
        assert letter["reason"].startswith("processor llm_judge failed: LlmJudgeError(")

        # Everything again, then a fresh step of the same session (same partition: it lands after the replay).
        asyncio.run(produce(settings, first + rest))
        sentinel = uuid7()
        d_s, r_s = dispatch(session, sentinel, 4, 9), {**result(session, sentinel, 10), "output": "s" * 10}
        asyncio.run(produce(settings, [(DISPATCH, d_s), (RESULT, r_s)]))
        after = wait_for(
            lambda: (found := judge_components(settings, session)).get(sentinel, {}).get("judge") and found,
            180,
            "the sentinel step's judgement after the replay",
            explain=lambda: f"{server.calls}\n{worker.log_tail(40)}",
        )
        assert {lid: row for lid, row in after.items() if lid != sentinel} == rows
        assert [server.calls[lid] for lid in (ok1, ok2, flaky, sentinel)] == [1, 1, 3, 1], "judged steps: no new call"
        wait_for(lambda: server.calls[broken] == 6, 60, "the replayed failing step tried again")
        letters = wait_for(lambda: len(found := dead_letters(settings, session)) == 2 and found, 60, "2 dead letters")
        assert [row["event_id"] for row in letters] == [steps[broken][1]["envelope"]["event_id"]] * 2
        _, counts = run_sql(
            settings,
            "SELECT count(), uniqExact(event_id) FROM reward_components FINAL "
            f"WHERE session_id = '{session}' AND source = 'llm_judge'",
        )
        assert counts == [[4, 4]]
