"""`treadle otlp` against real exporters, a real broker and the worker: OpenTelemetry's SDK exports a simulated agent's
traces over OTLP/HTTP (protobuf and JSON), and what lands in ClickHouse is compared with the same agent on treadle's
SDK. Bad requests, resent spans and a stopped broker are covered too."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from opentelemetry.exporter.otlp.json.http.trace_exporter import OTLPSpanExporter as JsonExporter
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as ProtobufExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sinks.sql_client import run_sql
from streams.otlp.receiver import serve
from tests.factories import wait_for
from tests.otlp_agent import CALLS, run_sdk_agent, run_traced_agent, tracer_provider
from tests.paths import REPO_ROOT
from topics.admin import ensure_topics
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.ids import uuid7
from topics.names import INPUT_SCHEMAS
from topics.settings import Settings
from treadle.devstack.kafka import LocalKafka

PORT_BASE = int(os.environ.get("TREADLE_TEST_PORT_BASE", "31000"))
_PORTS = iter(range(PORT_BASE + 400, PORT_BASE + 480))
COLUMNS = "step, agent_id, tool, params_json, tool_status, output, error, reward"
REWARDS = "SELECT {what} FROM raw_events_latest WHERE kind = 'rewards' AND session_id = '{session}'"


class Receiver:
    """`treadle otlp`'s server on its own event loop in a thread, as the command runs it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.port = next(_PORTS)
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            ready = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.create_task(serve(self.settings, "127.0.0.1", self.port, ready))
            await ready.wait()
            self._ready.set()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

        asyncio.run(main())

    def __enter__(self) -> Receiver:
        self._thread.start()
        assert self._ready.wait(60), "the receiver did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._task is not None
        self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(30)


def post(
    url: str, body: bytes, content_type: str = "application/x-protobuf", **headers: str
) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": content_type, **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def export_agent(url: str, exporter_class: type, conversation: str) -> list:
    """Run the traced agent with the real OTLP/HTTP exporter (a span per request: steps arrive before their episode);
    the spans are also kept, to resend them."""
    kept = InMemorySpanExporter()
    provider = tracer_provider()
    provider.add_span_processor(SimpleSpanProcessor(exporter_class(endpoint=url)))
    provider.add_span_processor(SimpleSpanProcessor(kept))
    run_traced_agent(provider.get_tracer("agent"), conversation)
    provider.shutdown()
    return list(kept.get_finished_spans())


def transitions(settings: Settings, session: str) -> list[list]:
    query = f"SELECT {COLUMNS} FROM transitions_latest WHERE session_id = '{session}' ORDER BY step"
    return run_sql(settings, query)[1]


def sql(settings: Settings, query: str) -> list[list]:
    return run_sql(settings, query)[1]


def test_traces_over_protobuf_and_json_become_the_transitions_the_sdk_agent_makes(
    deployment: Settings, worker_factory
) -> None:
    worker = worker_factory().start()
    worker.wait_ready()
    run = uuid7()[-8:]
    with Receiver(deployment) as receiver:
        kept = export_agent(receiver.url, ProtobufExporter, f"otlp-pb-{run}")
        export_agent(receiver.url, JsonExporter, f"otlp-json-{run}")
        asyncio.run(run_sdk_agent(deployment, f"sdk-{run}"))

        def woven(session: str) -> list[list] | None:
            rows = transitions(deployment, session)
            return rows if len(rows) == len(CALLS) and rows[0][-1] is not None else None

        expected = wait_for(lambda: woven(f"sdk-{run}"), 90, "the SDK agent's transitions, rewarded")
        assert expected[0][-1] == 0.75 and [r[4] for r in expected] == ["OK", "ERROR", "OK"]
        for session in (f"otlp-pb-{run}", f"otlp-json-{run}"):
            assert wait_for(lambda s=session: woven(s), 90, f"{session}'s transitions") == expected
            calls = sql(deployment, f"SELECT count() FROM llm_calls_latest WHERE session_id = '{session}'")
            assert calls == [[len(CALLS)]]
            rewards = sql(
                deployment,
                REWARDS.format(
                    what="JSONExtractString(payload_json, 'source'), JSONExtractFloat(payload_json, 'value')",
                    session=session,
                ),
            )
            assert rewards == [["helpfulness", 0.75]], "the evaluation event is a reward signal"

        # the exporter resends the same spans (a retry after a lost answer): no new step, call or reward
        status, _, _ = post(receiver.url, encode_spans(kept).SerializeToString())
        assert status == 200
        export_agent(receiver.url, ProtobufExporter, f"otlp-marker-{run}")  # sent after the resend: once it is in,
        wait_for(lambda: woven(f"otlp-marker-{run}"), 90, "the marker session")  # so is the resend
        session = f"otlp-pb-{run}"
        assert transitions(deployment, session) == expected
        assert sql(deployment, f"SELECT count() FROM transitions FINAL WHERE session_id = '{session}'") == [[3]]
        assert sql(deployment, f"SELECT count() FROM llm_calls_latest WHERE session_id = '{session}'") == [[3]]
        assert sql(deployment, REWARDS.format(what="count()", session=session)) == [[1]]


def test_bad_requests_get_their_status_codes_and_dead_letters(deployment: Settings, worker_factory) -> None:
    worker = worker_factory().start()
    worker.wait_ready()
    settings = deployment.model_copy(update={"otlp_max_request_bytes": 50_000})
    kept = InMemorySpanExporter()
    provider = tracer_provider()
    provider.add_span_processor(SimpleSpanProcessor(kept))
    tracer = provider.get_tracer("bad")
    with tracer.start_as_current_span("execute_tool", attributes={"gen_ai.operation.name": "execute_tool"}):
        pass  # no tool name: unmappable
    run_traced_agent(tracer, "otlp-partial")
    provider.shutdown()
    spans = list(kept.get_finished_spans())
    body = encode_spans(spans).SerializeToString()
    with Receiver(settings) as receiver:
        status, _, answer = post(receiver.url, gzip.compress(body), **{"Content-Encoding": "gzip"})
        assert status == 200
        partial = ExportTraceServiceResponse.FromString(answer).partial_success
        assert partial.rejected_spans == 1 and "without gen_ai.tool.name" in partial.error_message

        junk = b"\x0a\xff\xff\xff\xff definitely not protobuf"
        assert post(receiver.url, junk)[0] == 400
        status, _, answer = post(receiver.url, b'{"resourceSpans": 7}', "application/json")
        assert status == 400 and "JSON" in json.loads(answer)["message"]
        assert post(receiver.url, b"{}", "text/plain")[0] == 415
        assert post(receiver.url, b"\0" * 60_000)[0] == 413
        assert post(receiver.url, gzip.compress(b"\0" * 200_000), **{"Content-Encoding": "gzip"})[0] == 413

    bad_span = next(s for s in spans if not s.attributes.get("gen_ai.tool.name") and s.name == "execute_tool")
    span_bytes = encode_spans([bad_span]).resource_spans[0].scope_spans[0].spans[0].SerializeToString()
    query = "SELECT stage, reason, value, dead_letter_id FROM dead_letters_latest WHERE topic = 'otlp' ORDER BY reason"

    def letters() -> list[list] | None:
        rows = sql(deployment, query)
        return rows if len(rows) >= 5 else None

    rows = wait_for(letters, 90, "five dead letters")
    by_stage: dict[str, list[list]] = {}
    for row in rows:
        by_stage.setdefault(row[0], []).append(row)
    (span_letter,) = by_stage["VALIDATE"]
    assert span_letter[1] == "an execute_tool span without gen_ai.tool.name"
    value = bytes.fromhex(span_letter[2])  # the sink keeps dead-letter bytes as hex
    assert value == span_bytes, "the dead letter keeps the span's protobuf bytes"
    reasons = " | ".join(r[1] for r in by_stage["DECODE"])
    assert len(by_stage["DECODE"]) == 4 and "protobuf" in reasons and "JSON" in reasons and "above 50,000" in reasons
    assert "inflates to more than" in reasons


def dedicated_broker(home: Path) -> LocalKafka:
    return LocalKafka(
        Settings(
            home=home,
            kafka_bootstrap_servers=f"127.0.0.1:{PORT_BASE + 192}",
            kafka_controller_port=PORT_BASE + 193,
            cache=REPO_ROOT / ".treadle" / "cache",
        )
    )


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[LocalKafka]:
    kafka = dedicated_broker(tmp_path / "broker")
    kafka.up()
    try:
        yield kafka
    finally:
        kafka.down()


async def read_event_ids(settings: Settings) -> set[str]:
    """Every input event on the deployment's topics, read from the start."""
    catalog = TopicCatalog(settings)
    topics = [catalog.for_schema(schema).name for schema in INPUT_SCHEMAS]
    consumer = AIOKafkaConsumer(
        *topics, bootstrap_servers=settings.kafka_bootstrap_servers, auto_offset_reset="earliest"
    )
    codec = AvroCodec()
    ids: set[str] = set()
    await consumer.start()
    try:
        while batch := await consumer.getmany(timeout_ms=3000):
            for records in batch.values():
                for record in records:
                    ids.add(codec.decode(record.value)[1]["envelope"]["event_id"])
    finally:
        await consumer.stop()
    return ids


def test_with_the_broker_stopped_requests_are_retryable_and_nothing_accepted_is_lost(
    broker: LocalKafka, tmp_path: Path
) -> None:
    settings = Settings(
        home=tmp_path / "home",
        kafka_bootstrap_servers=broker.bootstrap_servers,
        topic_prefix="otlpdown",
        partitions=2,
        otlp_max_pending=5,  # one request's events are more than that
        otlp_ack_timeout_s=3.0,
        otlp_retry_after_s=2,
    )
    asyncio.run(ensure_topics(TopicCatalog(settings), settings.kafka_bootstrap_servers))

    def traced(conversation: str) -> bytes:
        kept = InMemorySpanExporter()
        provider = tracer_provider()
        provider.add_span_processor(SimpleSpanProcessor(kept))
        run_traced_agent(provider.get_tracer("agent"), conversation)
        provider.shutdown()
        return encode_spans(list(kept.get_finished_spans())).SerializeToString()

    from streams.otlp.decoding import parse_request, spans_of
    from streams.otlp.mapping import map_spans

    def event_ids(body: bytes) -> set[str]:
        mapped = map_spans(spans_of(parse_request(body, "application/x-protobuf")))
        return {e.record["envelope"]["event_id"] for e in mapped.events}

    before, during = traced("before-stop"), traced("while-stopped")
    with Receiver(settings) as receiver:
        # a fresh broker may take longer than the ack timeout to elect its leaders: retry as an exporter does
        wait_for(lambda: post(receiver.url, before)[0] == 200, 120, "the first request accepted")
        broker.down()
        waiting: list[tuple[int, dict, bytes]] = []
        first = threading.Thread(target=lambda: waiting.append(post(receiver.url, during)))
        first.start()
        root = receiver.url.removesuffix("v1/traces")
        wait_for(lambda: json.loads(urllib.request.urlopen(root).read())["events_pending"] > 0, 30, "events pending")
        status, headers, _ = post(receiver.url, traced("too-many"))
        assert status == 429 and headers.get("Retry-After") == "2", "the producer is backed up: come back later"
        first.join(60)
        status, headers, _ = waiting[0]
        assert status == 503 and headers.get("Retry-After") == "2", "the broker did not acknowledge in time"
        broker.up()
        status = wait_for(lambda: (code := post(receiver.url, during)[0]) == 200 and code, 120, "accepted again")
    ids = asyncio.run(read_event_ids(settings))
    assert event_ids(before) <= ids, "what was accepted before the broker stopped survived it"
    assert event_ids(during) <= ids, "the retried request was accepted once the broker was back"
