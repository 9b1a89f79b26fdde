"""The agent SDK against a real Kafka broker: what it sends is read back and decoded, nothing is mocked."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import murmur2
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from streams.sdk.producer import create_producer
from streams.sdk.types import _params_json
from tests.paths import REPO_ROOT
from topics.admin import ensure_topics
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.settings import Settings
from topics.tool_schemas import ToolSchemas
from treadle import (
    AgentStream,
    AgentStreamSync,
    Edge,
    EventTooLargeError,
    InvalidParamsError,
    LifecycleKind,
    Node,
    ProducerError,
    RewardEmitter,
    RewardEmitterSync,
    StepRef,
    StreamError,
    ToolStatus,
)
from treadle.devstack.kafka import LocalKafka


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def kafka_bootstrap(stack: Settings) -> str:
    """The shared test broker (tests/conftest.py)."""
    return stack.kafka_bootstrap_servers


class SecondBroker:
    """A broker of its own on free ports, for the test that stops it under a live stream."""

    def __init__(self, home: Path) -> None:
        port = free_port()
        self.kafka = LocalKafka(
            Settings(
                home=home,
                kafka_bootstrap_servers=f"127.0.0.1:{port}",
                kafka_controller_port=free_port(),
                cache=REPO_ROOT / ".treadle" / "cache",
            )
        )
        self.bootstrap = self.kafka.bootstrap_servers

    def start(self) -> None:
        self.kafka.up()

    def stop(self) -> None:
        self.kafka.down()


TOOL_SCHEMAS = {
    "search": {
        "type": "object",
        "properties": {"q": {"type": "string", "minLength": 1}, "limit": {"type": "integer", "minimum": 1}},
        "required": ["q"],
        "additionalProperties": False,
    },
    "blob": {"type": "object"},
}
UUID7 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
INPUT_KINDS = ("actions", "tool_results", "rewards", "state_deltas", "lifecycle")


def make_settings(bootstrap: str, tmp: Path) -> Settings:
    return Settings(
        home=tmp,
        kafka_bootstrap_servers=bootstrap,
        topic_prefix=f"sdk{uuid.uuid4().hex[:8]}",
        partitions=3,
    )


async def create_topics(s: Settings) -> None:
    await ensure_topics(TopicCatalog(s), s.kafka_bootstrap_servers)


@pytest.fixture(scope="module")
def settings(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """This module's deployment: its own topic prefix, topics created."""
    s = make_settings(kafka_bootstrap, tmp_path_factory.mktemp("sdk-home"))
    asyncio.run(create_topics(s))
    return s


@pytest.fixture(scope="module")
def codec() -> AvroCodec:
    return AvroCodec()


@pytest.fixture
def tools() -> ToolSchemas:
    return ToolSchemas(TOOL_SCHEMAS)


@dataclass(frozen=True)
class Read:
    kind: str
    partition: int
    offset: int
    key: bytes
    record: dict[str, Any]

    @property
    def env(self) -> dict[str, Any]:
        return self.record["envelope"]


async def read_back(settings: Settings, codec: AvroCodec, session_ids: set[str]) -> dict[str, list[Read]]:
    """Every event of `session_ids` in the input topics, decoded, in (partition, offset) order per topic."""
    catalog = TopicCatalog(settings)
    wanted = {s.encode() for s in session_ids}
    out: dict[str, list[Read]] = {k: [] for k in INPUT_KINDS}
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = [TopicPartition(catalog[k].name, p) for k in INPUT_KINDS for p in range(catalog[k].partitions)]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        end = await consumer.end_offsets(partitions)
        remaining = {tp for tp in partitions if end[tp] > 0}
        deadline = time.monotonic() + 30
        while remaining and time.monotonic() < deadline:
            for tp, messages in (await consumer.getmany(timeout_ms=500)).items():
                kind = catalog.by_name(tp.topic).kind
                for m in messages:
                    if m.key in wanted:
                        schema = catalog[kind].value_schema
                        _, record = codec.decode(m.value, expect=schema)
                        out[kind].append(Read(kind, m.partition, m.offset, m.key, record))
                    if m.offset + 1 >= end[tp]:
                        remaining.discard(tp)
        assert not remaining, f"did not reach the end of {remaining}"
    finally:
        await consumer.stop()
    for reads in out.values():
        reads.sort(key=lambda r: (r.partition, r.offset))
    return out


def check_session_invariants(reads: dict[str, list[Read]], session_id: str) -> None:
    """Key is the session, one partition number across topics, seq strictly increasing per topic and unique."""
    every = [r for rs in reads.values() for r in rs]
    assert every
    assert {r.key for r in every} == {session_id.encode()}
    assert {r.env["session_id"] for r in every} == {session_id}
    assert len({r.partition for r in every}) == 1, "co-partitioned topics must put a session on one partition"
    assert every[0].partition == (murmur2(session_id.encode()) & 0x7FFFFFFF) % 3  # Kafka's default partitioner
    seqs = [r.env["seq"] for r in every]
    assert len(set(seqs)) == len(seqs)
    for rs in reads.values():
        per_topic = [r.env["seq"] for r in rs]
        assert per_topic == sorted(per_topic) and len(set(per_topic)) == len(per_topic)
    for r in every:
        assert UUID7.match(r.env["event_id"]), r.env["event_id"]
    assert len({r.env["event_id"] for r in every}) == len(every)


async def test_events_round_trip_with_envelope_seq_and_steps(
    settings: Settings, codec: AvroCodec, tools: ToolSchemas
) -> None:
    before = time.time_ns() // 1000
    async with AgentStream(
        settings, agent_id="agent-a", policy_version="pv-3", tool_schemas=tools, codec=codec
    ) as stream:
        await stream.lifecycle(LifecycleKind.EPISODE_STARTED, episode_id="ep-1")
        refs = [await stream.dispatch("search", {"q": f"query {i}"}, attributes={"i": i}) for i in range(3)]
        assert [r.step for r in refs] == [0, 1, 2]
        async with stream.tool_call(refs[0]) as call:
            await asyncio.sleep(0.02)
            call.output = {"hits": 3}
            call.cost_usd, call.tokens_in, call.tokens_out, call.retries = 0.25, 11, 7, 1
        with pytest.raises(ValueError, match="tool broke"):
            async with stream.tool_call(refs[1]):
                raise ValueError("tool broke")
        with pytest.raises(TimeoutError):
            async with stream.tool_call(refs[2]):
                async with asyncio.timeout(0.01):
                    await asyncio.sleep(5)
        await stream.reward(refs[0], 0.5, source="judge", name="helpfulness", annotator="LLM", evidence="fine")
        await stream.reward(refs[1].logical_event_id, -1.0, source="code_check")
        await stream.delta(
            node_upserts=[Node("n1", "page", {"url": "u"}, ttl_seconds=60), {"id": "n2", "type": "page"}],
            edge_upserts=[Edge("n1", "n2", "references"), ("n2", "n1", "causes")],
            node_deletes=["n0"],
            step_ref=refs[0],
        )
        await stream.lifecycle("EPISODE_ENDED", done=True, reason="goal reached")
        assert stream.next_seq == 11
        assert stream.next_step == 3
        session_id = stream.session_id
    after = time.time_ns() // 1000

    reads = await read_back(settings, codec, {session_id})
    check_session_invariants(reads, session_id)
    assert sorted(r.env["seq"] for rs in reads.values() for r in rs) == list(range(11))
    for r in (r for rs in reads.values() for r in rs):
        assert r.env["agent_id"] == "agent-a"
        assert r.env["episode_id"] == "ep-1"
        assert r.env["policy_version"] == "pv-3"
        assert before <= r.env["event_time"] <= after

    actions = reads["actions"]
    assert [a.record["step"] for a in actions] == [0, 1, 2]
    for a, ref in zip(actions, refs, strict=True):
        assert a.env["logical_event_id"] == ref.logical_event_id == a.env["event_id"]
        assert a.env["trace_id"] == ref.trace_id and len(ref.trace_id) == 32
        assert a.record["tool"] == "search" and a.record["deadline"] is None
        assert a.env["event_time"] == ref.dispatched_at
    assert [a.env["attributes"] for a in actions] == [{"i": "0"}, {"i": "1"}, {"i": "2"}]
    assert actions[0].record["params_json"] == '{"q":"query 0"}'

    results = {r.env["logical_event_id"]: r for r in reads["tool_results"]}
    ok, err, timeout = (results[ref.logical_event_id].record for ref in refs)
    assert (ok["status"], err["status"], timeout["status"]) == ("OK", "ERROR", "TIMEOUT")
    assert ok["latency_ms"] >= 20 and err["latency_ms"] > 0 and timeout["latency_ms"] >= 10
    assert ok["output"] == '{"hits":3}' and ok["error"] is None
    assert (ok["cost_usd"], ok["tokens_in"], ok["tokens_out"], ok["retries"]) == (0.25, 11, 7, 1)
    assert err["error"] == "ValueError: tool broke"
    assert timeout["error"].startswith("TimeoutError")
    for ref in refs:
        assert results[ref.logical_event_id].env["trace_id"] == ref.trace_id
        assert results[ref.logical_event_id].record["tool"] == "search"

    judge, check = reads["rewards"]
    assert judge.env["logical_event_id"] == refs[0].logical_event_id and judge.env["trace_id"] == refs[0].trace_id
    assert (judge.record["source"], judge.record["name"], judge.record["value"]) == ("judge", "helpfulness", 0.5)
    assert (judge.record["annotator"], judge.record["evidence"], judge.record["confidence"]) == ("LLM", "fine", 1.0)
    assert check.env["logical_event_id"] == refs[1].logical_event_id and check.record["annotator"] == "CODE"
    assert check.record["name"] == "reward" and check.record["value"] == -1.0

    (delta,) = reads["state_deltas"]
    assert delta.env["logical_event_id"] == refs[0].logical_event_id
    assert delta.record["node_upserts"] == [
        {"id": "n1", "type": "page", "data_json": '{"url":"u"}', "ttl_seconds": 60},
        {"id": "n2", "type": "page", "data_json": "{}", "ttl_seconds": None},
    ]
    assert delta.record["edge_upserts"] == [
        {"src": "n1", "dst": "n2", "type": "references", "data_json": "{}"},
        {"src": "n2", "dst": "n1", "type": "causes", "data_json": "{}"},
    ]
    assert delta.record["node_deletes"] == ["n0"] and delta.record["rollback_to"] is None

    started, ended = reads["lifecycle"]
    assert started.record["kind"] == "EPISODE_STARTED" and started.env["seq"] == 0
    assert (ended.record["kind"], ended.record["done"], ended.record["truncated"]) == ("EPISODE_ENDED", True, False)
    assert ended.record["reason"] == "goal reached" and ended.env["seq"] == 10
    assert started.env["logical_event_id"] == started.env["event_id"]


async def test_invalid_params_raise_before_anything_is_sent(
    settings: Settings, codec: AvroCodec, tools: ToolSchemas
) -> None:
    async with AgentStream(settings, agent_id="agent-b", tool_schemas=tools, codec=codec) as stream:
        with pytest.raises(InvalidParamsError, match="q"):
            await stream.dispatch("search", {"limit": 3})
        with pytest.raises(InvalidParamsError, match="limit"):
            await stream.dispatch("search", {"q": "x", "limit": 0})
        with pytest.raises(InvalidParamsError, match="JSON object"):
            await stream.dispatch("search", ["q"])  # type: ignore[arg-type]
        with pytest.raises(InvalidParamsError, match="JSON-serializable"):
            await stream.dispatch("anything", {"when": object()})
        with pytest.raises(InvalidParamsError, match="JSON-serializable"):
            await stream.dispatch("anything", {"x": float("nan")})
        cyclic: dict[str, Any] = {}
        cyclic["self"] = cyclic
        with pytest.raises(InvalidParamsError, match="JSON-serializable"):
            await stream.dispatch("anything", cyclic)
        assert (stream.next_step, stream.next_seq, stream.pending) == (0, 0, 0)
        ref = await stream.dispatch("search", {"q": "ok"})
        assert (ref.step, stream.next_seq) == (0, 1)
        session_id = stream.session_id
    reads = await read_back(settings, codec, {session_id})
    assert [(a.record["step"], a.env["seq"]) for a in reads["actions"]] == [(0, 0)]
    assert sum(len(rs) for rs in reads.values()) == 1


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@hypothesis_settings(max_examples=500, deadline=None)
@given(st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=5))
def test_params_json_is_compact_json_dumps(params: dict[str, Any]) -> None:
    """The dispatch's params_json (json's C encoder, built once) is exactly what json.dumps writes."""
    assert _params_json(params) == json.dumps(params, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


async def test_other_bad_arguments_raise_before_anything_is_sent(settings: Settings, codec: AvroCodec) -> None:
    async with AgentStream(settings, agent_id="agent-b2", codec=codec) as stream:
        with pytest.raises(ValueError):
            await stream.lifecycle("NOT_A_PHASE")
        with pytest.raises(ValueError):
            await stream.reward("lid", "high", source="x")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            await stream.reward("lid", 1.0, source="x", annotator="ROBOT")
        for bad, match in (({"value": float("nan")}, "must be finite"), ({"confidence": 1.5}, r"in \[0, 1\]"),
                           ({"event_time": 0}, "positive microseconds")):  # fmt: skip
            with pytest.raises(ValueError, match=match):  # what the worker would dead-letter
                await stream.reward("lid", **{"value": 1.0, "source": "x", **bad})
        ref = await stream.dispatch("t", {}, deadline=timedelta(seconds=30))
        with pytest.raises(ValueError):
            await stream.tool_result(ref, "MAYBE")
        with pytest.raises(ValueError, match="latency_ms must be a finite non-negative number"):
            await stream.tool_result(ref, "OK", latency_ms=float("inf"))
        with pytest.raises(ValueError, match="event_time must be positive"):
            await stream.dispatch("t", {}, event_time=-5)
        with pytest.raises(ValueError, match="cannot encode"):
            await stream.delta(node_upserts=[{"id": 1, "type": "t"}])
        async with stream.tool_call(ref) as call:
            call.status = ToolStatus.REJECTED
            call.error = "policy says no"
        assert (stream.next_step, stream.next_seq) == (1, 2)
        session_id = stream.session_id
    reads = await read_back(settings, codec, {session_id})
    (action,) = reads["actions"]
    assert abs(action.record["deadline"] - (action.env["event_time"] + 30_000_000)) < 1_000_000
    (result,) = reads["tool_results"]
    assert (result.record["status"], result.record["error"], result.env["seq"]) == ("REJECTED", "policy says no", 1)


async def test_concurrent_dispatches_get_distinct_steps_and_seqs(settings: Settings, codec: AvroCodec) -> None:
    async with AgentStream(settings, agent_id="agent-c", codec=codec) as stream:
        refs = await asyncio.gather(*(stream.dispatch("t", {"i": i}) for i in range(200)))
        await stream.flush()
        assert stream.pending == 0
        session_id = stream.session_id
    assert sorted(r.step for r in refs) == list(range(200))
    reads = await read_back(settings, codec, {session_id})
    check_session_invariants(reads, session_id)
    assert sorted(a.env["seq"] for a in reads["actions"]) == list(range(200))
    assert sorted(a.record["step"] for a in reads["actions"]) == list(range(200))


async def test_many_streams_share_one_producer(settings: Settings, codec: AvroCodec) -> None:
    producer = create_producer(settings)
    await producer.start()
    try:
        streams = [AgentStream(settings, agent_id=f"agent-{i}", producer=producer, codec=codec) for i in range(8)]
        for s in streams:
            await s.start()
        for s in streams:
            ref = await s.dispatch("t", {})
            await s.tool_result(ref, "OK", output="done")
        for s in streams:
            await s.close()
        # the shared producer is still running: the streams did not stop it
        await producer.send_and_wait(TopicCatalog(settings)["lifecycle"].name, b"x", key=b"not-a-session")
    finally:
        await producer.stop()
    reads = await read_back(settings, codec, {s.session_id for s in streams})
    for s in streams:
        mine = {k: [r for r in rs if r.key == s.session_id.encode()] for k, rs in reads.items()}
        check_session_invariants(mine, s.session_id)
        assert [(r.kind, r.env["seq"]) for r in mine["actions"] + mine["tool_results"]] == [
            ("actions", 0),
            ("tool_results", 1),
        ]
        result = mine["tool_results"][0].record
        assert result["status"] == "OK" and result["latency_ms"] >= 0 and result["output"] == "done"


async def test_reward_source_needs_only_the_step_id_and_session(settings: Settings, codec: AvroCodec) -> None:
    async with AgentStream(settings, agent_id="agent-d", codec=codec) as stream:
        ref = await stream.dispatch("t", {"x": 1})
    lid, session_id = ref.logical_event_id, ref.session_id  # what a judge service would receive

    async with RewardEmitter(settings, source="llm_judge", annotator="LLM", codec=codec) as judge:
        with pytest.raises(ValueError, match="session_id"):
            await judge.reward(lid, 0.9)
        await judge.reward(lid, 0.9, session_id=session_id, name="helpfulness", confidence=0.8, evidence="ok")
        await judge.reward(ref, 0.1, name="safety", annotator="HUMAN")
        await judge.reward(lid, 0.2, session_id="other-session")
    with RewardEmitterSync(settings, source="labeller", annotator="HUMAN", codec=codec) as labeller:
        with pytest.raises(ValueError, match="event_id must be a non-empty string"):
            labeller.reward(lid, 1.0, session_id=session_id, event_id="")
        # a re-run of the labelling job sends the same event_id, which the step assembler ignores
        labelled_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"label/{lid}"))
        assert labeller.reward(lid, 1.0, session_id=session_id, event_id=labelled_id) == labelled_id

    reads = await read_back(settings, codec, {session_id, "other-session"})
    rewards = [r for r in reads["rewards"] if r.key == session_id.encode()]
    assert len(rewards) == 3
    assert {r.partition for r in rewards} == {reads["actions"][0].partition}
    assert all(r.env["logical_event_id"] == lid for r in rewards)
    judged = sorted((r for r in rewards if r.env["agent_id"] == "llm_judge"), key=lambda r: r.env["seq"])
    (labelled,) = (r for r in rewards if r.env["agent_id"] == "labeller")
    first, second = (r.record for r in judged)
    assert (first["source"], first["name"], first["annotator"], first["confidence"]) == (
        "llm_judge", "helpfulness", "LLM", 0.8,
    )  # fmt: skip
    assert (second["name"], second["annotator"]) == ("safety", "HUMAN")
    assert judged[1].env["trace_id"] == ref.trace_id and judged[1].env["episode_id"] == ref.episode_id
    assert (labelled.record["source"], labelled.record["annotator"]) == ("labeller", "HUMAN")
    assert labelled.env["event_id"] == labelled_id
    (other,) = (r for r in reads["rewards"] if r.key == b"other-session")
    assert other.env["seq"] > judged[1].env["seq"]  # one counter per emitter: increasing in every session


async def test_broker_rejection_surfaces_at_flush_with_the_failed_event(settings: Settings, codec: AvroCodec) -> None:
    # The producer accepts 4 MB but the broker's limit is ~1 MB: the send is accepted, the broker refuses it later.
    settings = settings.model_copy(update={"max_event_bytes": 4_000_000})  # past the SDK's own check
    async with AgentStream(
        settings, agent_id="agent-e", codec=codec, producer_options={"max_request_size": 4_000_000}
    ) as stream:
        ref = await stream.dispatch("blob", {"data": "x" * 2_000_000})  # returns at once, no error yet
        with pytest.raises(ProducerError) as caught:
            await stream.flush()
        assert [f.logical_event_id for f in caught.value.failed] == [ref.logical_event_id]
        assert caught.value.failed[0].record["step"] == 0
        assert caught.value.__cause__ is caught.value.cause
        await stream.flush()  # reported once; the stream stays usable

        # A background failure also surfaces on the next call, before that call sends anything.
        await stream.dispatch("blob", {"data": "y" * 2_000_000})
        while stream.pending:
            await asyncio.sleep(0.05)
        with pytest.raises(ProducerError):
            await stream.dispatch("t", {})
        ok = await stream.dispatch("t", {})
        session_id = stream.session_id
    reads = await read_back(settings, codec, {session_id})
    assert [a.env["logical_event_id"] for a in reads["actions"]] == [ok.logical_event_id]


async def test_an_event_over_the_size_limit_raises_before_it_is_sent(settings: Settings, codec: AvroCodec) -> None:
    async with AgentStream(settings, agent_id="agent-f", codec=codec) as stream:
        with pytest.raises(EventTooLargeError, match=r"above the 900,000-byte limit \(TREADLE_MAX_EVENT_BYTES\)"):
            await stream.dispatch("blob", {"data": "x" * 900_000})
        assert stream.pending == 0


async def test_producer_side_rejection_raises_at_once(settings: Settings, codec: AvroCodec) -> None:
    settings = settings.model_copy(update={"max_event_bytes": 4_000_000})  # past the SDK's own check
    async with AgentStream(settings, agent_id="agent-f", codec=codec) as stream:
        with pytest.raises(ProducerError, match="MessageSizeTooLarge"):
            await stream.dispatch("blob", {"data": "x" * 2_000_000})
        assert stream.pending == 0


async def test_not_started_and_closed_streams_refuse(settings: Settings, codec: AvroCodec) -> None:
    stream = AgentStream(settings, agent_id="agent-g", codec=codec)
    with pytest.raises(StreamError, match="not started"):
        await stream.dispatch("t", {})
    await stream.start()
    await stream.close()
    await stream.close()  # idempotent
    with pytest.raises(StreamError, match="closed"):
        await stream.dispatch("t", {})


async def test_missing_topics_are_a_clear_error(kafka_bootstrap: str, tmp_path: Path, codec: AvroCodec) -> None:
    s = make_settings(kafka_bootstrap, tmp_path)  # topics never created
    stream = AgentStream(s, agent_id="agent-h", codec=codec, producer_options={"request_timeout_ms": 2000})
    with pytest.raises(StreamError, match="not found"):
        await stream.start()


def test_sync_facade(settings: Settings, codec: AvroCodec, tools: ToolSchemas) -> None:
    with AgentStreamSync(settings, agent_id="agent-sync", tool_schemas=tools, codec=codec) as stream:
        stream.lifecycle("SESSION_CREATED")
        with pytest.raises(InvalidParamsError):
            stream.dispatch("search", {})
        refs = [stream.dispatch("search", {"q": str(i)}) for i in range(3)]
        assert all(isinstance(r, StepRef) for r in refs) and [r.step for r in refs] == [0, 1, 2]
        with stream.tool_call(refs[0]) as call:
            time.sleep(0.01)
            call.output = "fine"
        with pytest.raises(KeyError), stream.tool_call(refs[1]):
            raise KeyError("missing")
        with pytest.raises(TimeoutError), stream.tool_call(refs[2]):
            raise TimeoutError
        stream.tool_result(refs[2], ToolStatus.REJECTED, output="late", latency_ms=3.5)
        stream.reward(refs[0], 1.0, source="code")
        stream.delta(node_upserts=[Node("a", "t")])
        stream.flush()
        assert stream.pending == 0
        session_id = stream.session_id
    stream.close()  # idempotent after the with block

    reads = asyncio.run(read_back(settings, codec, {session_id}))
    check_session_invariants(reads, session_id)
    assert sorted(r.env["seq"] for rs in reads.values() for r in rs) == list(range(10))
    assert [a.record["step"] for a in reads["actions"]] == [0, 1, 2]
    statuses = [(r.env["logical_event_id"], r.record["status"]) for r in reads["tool_results"]]
    assert statuses == [
        (refs[0].logical_event_id, "OK"),
        (refs[1].logical_event_id, "ERROR"),
        (refs[2].logical_event_id, "TIMEOUT"),
        (refs[2].logical_event_id, "REJECTED"),
    ]
    latencies = [r.record["latency_ms"] for r in reads["tool_results"]]
    assert latencies[0] >= 10 and all(x > 0 for x in latencies)
    assert reads["tool_results"][1].record["error"] == "KeyError: 'missing'"
    assert len(reads["rewards"]) == len(reads["state_deltas"]) == len(reads["lifecycle"]) == 1


def test_a_forgotten_sync_stream_is_flushed_not_lost(settings: Settings, codec: AvroCodec) -> None:
    stream = AgentStreamSync(settings, agent_id="agent-forgetful", codec=codec).start()
    ref = stream.dispatch("t", {})
    with pytest.warns(ResourceWarning, match="not closed"):
        del stream
        gc.collect()
    reads = asyncio.run(read_back(settings, codec, {ref.session_id}))
    assert [a.env["logical_event_id"] for a in reads["actions"]] == [ref.logical_event_id]


def test_sync_facade_surfaces_producer_failures(settings: Settings, codec: AvroCodec) -> None:
    settings = settings.model_copy(update={"max_event_bytes": 4_000_000})  # past the SDK's own check
    stream = AgentStreamSync(
        settings, agent_id="agent-sync-fail", codec=codec, producer_options={"max_request_size": 4_000_000}
    ).start()
    stream.dispatch("blob", {"data": "x" * 2_000_000})
    with pytest.raises(ProducerError):
        stream.close()
    with pytest.raises(StreamError):
        stream.dispatch("t", {})


async def test_stopped_broker_fails_the_flush_and_the_next_call(tmp_path: Path, codec: AvroCodec) -> None:
    """Events accepted while the broker is down are reported, not dropped, and closing does not hang.

    (aiokafka's idempotent producer retries forever, so the stream's delivery_timeout_s bounds the wait.)
    """
    broker = SecondBroker(tmp_path / "kafka")
    await asyncio.to_thread(broker.start)
    try:
        s = make_settings(broker.bootstrap, tmp_path / "home")
        await create_topics(s)
        stream = AgentStream(s, agent_id="agent-i", codec=codec, delivery_timeout_s=2.0)
        await stream.start()
        await stream.dispatch("t", {})
        await stream.flush()
        await asyncio.to_thread(broker.stop)

        ref = await stream.dispatch("t", {})  # still returns at once
        with pytest.raises(ProducerError, match="KafkaTimeoutError") as caught:
            await stream.flush()
        assert [f.logical_event_id for f in caught.value.failed] == [ref.logical_event_id]

        late = await stream.dispatch("t", {})
        await asyncio.sleep(2.2)
        with pytest.raises(ProducerError) as caught:
            await stream.dispatch("t", {})  # the overdue event surfaces here, before this one is sent
        assert [f.logical_event_id for f in caught.value.failed] == [late.logical_event_id]

        started = time.monotonic()
        await stream.close()
        assert time.monotonic() - started < 5
    finally:
        await asyncio.to_thread(broker.stop)
