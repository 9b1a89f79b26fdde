"""OTLP ingestion: `python -m bench.otlp_bench [--traces 400] [--tools 8] [--concurrency 32]`.

Payloads: OpenTelemetry's SDK records `--traces` simulated agent episodes (an invoke_agent root, then per tool call a
chat span and an execute_tool span, one evaluation event per episode) and OTel's own encoder turns each episode into
one OTLP protobuf ExportTraceServiceRequest, as the batch exporter would send it.

- baseline, in this process: decoding every payload (ExportTraceServiceRequest.ParseFromString, what an OTel
  Collector-style receiver does before anything else), spans/s;
- end to end: `treadle otlp` in a child process (pinned to one core where taskset exists), `--concurrency` clients
  POST the payloads; a request is answered only after the broker acknowledged its events, so spans/s is span ->
  event on Kafka. Also its CPU seconds, for spans per receiver CPU-second.

Both use the same payloads in the same run; the ratio is end-to-end over decode-only. Kafka runs on the bench's own
ports (TREADLE_BENCH_PORT_SHIFT).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from aiohttp import ClientSession
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.common import REPO_ROOT, bench_settings, cpu_seconds, loadavg, local_stack, machine_facts, pinned
from streams.otlp.decoding import PROTOBUF, parse_request, spans_of
from streams.otlp.mapping import map_spans
from streams.otlp.numbering import SessionNumbering
from topics.admin import ensure_topics
from topics.catalog import TopicCatalog

OTLP_PORT = 29418 + int(os.environ.get("TREADLE_BENCH_PORT_SHIFT", "0"))


def payloads(traces: int, tools: int) -> tuple[list[bytes], int]:
    """One protobuf request per episode, and the number of spans in all of them."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "bench-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("bench")
    bodies, spans = [], 0
    for t in range(traces):
        conv = {"gen_ai.conversation.id": f"bench-{t}"}
        with tracer.start_as_current_span("invoke_agent bench", attributes={"gen_ai.operation.name": "invoke_agent",
                                                                           **conv}):  # fmt: skip
            for n in range(tools):
                output = [{"role": "assistant", "parts": [{"type": "tool_call", "id": f"c{n}", "name": "search"}]}]
                with tracer.start_as_current_span("chat m") as chat:
                    chat.set_attributes(
                        {
                            "gen_ai.operation.name": "chat",
                            "gen_ai.request.model": "qwen-7b",
                            "gen_ai.usage.input_tokens": 400 + n,
                            "gen_ai.usage.output_tokens": 20,
                            "gen_ai.output.messages": json.dumps(output),
                            **conv,
                        }
                    )
                with tracer.start_as_current_span("execute_tool search") as tool:
                    tool.set_attributes(
                        {
                            "gen_ai.operation.name": "execute_tool",
                            "gen_ai.tool.name": "search",
                            "gen_ai.tool.call.id": f"c{n}",
                            "gen_ai.tool.call.arguments": json.dumps({"q": f"query {t}-{n}", "limit": 5}),
                            "gen_ai.tool.call.result": json.dumps([f"r{i}" for i in range(5)]),
                            **conv,
                        }
                    )
                    if n == 0:
                        tool.add_event(
                            "gen_ai.evaluation.result",
                            {"gen_ai.evaluation.name": "judge", "gen_ai.evaluation.score.value": 0.5},
                        )
        finished = exporter.get_finished_spans()
        bodies.append(encode_spans(finished).SerializeToString())
        spans += len(finished)
        exporter.clear()
    provider.shutdown()
    return bodies, spans


def decode_only(bodies: list[bytes], rounds: int) -> float:
    """Seconds per round of parsing every payload (best of `rounds`)."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for body in bodies:
            ExportTraceServiceRequest.FromString(body)
        best = min(best, time.perf_counter() - started)
    return best


def decode_and_map(bodies: list[bytes]) -> float:
    """Seconds to decode every payload into Spans and map them to events (the receiver's CPU work before Kafka)."""
    numbering = SessionNumbering()
    started = time.perf_counter()
    for body in bodies:
        numbering.number(map_spans(spans_of(parse_request(body, PROTOBUF))).events)
    return time.perf_counter() - started


async def post_all(url: str, bodies: list[bytes], concurrency: int) -> tuple[float, dict[int, int]]:
    statuses: dict[int, int] = {}
    queue = list(reversed(bodies))
    async with ClientSession(headers={"Content-Type": "application/x-protobuf"}) as http:

        async def client() -> None:
            while queue:
                body = queue.pop()
                while True:
                    async with http.post(url, data=body) as answer:
                        await answer.read()
                        statuses[answer.status] = statuses.get(answer.status, 0) + 1
                        if answer.status not in (429, 503):
                            break
                        await asyncio.sleep(float(answer.headers.get("Retry-After", "1")))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return time.perf_counter() - started, statuses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=400)
    parser.add_argument("--tools", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    print(machine_facts(), flush=True)
    bodies, spans = payloads(args.traces, args.tools)
    print(f"payloads: {len(bodies)} requests, {spans:,} spans, {sum(map(len, bodies)) / len(bodies):,.0f} bytes each")
    decode_s = decode_only(bodies, 5)
    mapping_s = decode_and_map(bodies)
    with tempfile.TemporaryDirectory(prefix="otlp-bench-") as tmp:
        settings = bench_settings(Path(tmp), f"otlpb{os.getpid()}", partitions=3)
        with local_stack(settings):
            asyncio.run(ensure_topics(TopicCatalog(settings), settings.kafka_bootstrap_servers))
            env = {**os.environ, **settings.to_env(), "PYTHONPATH": str(REPO_ROOT)}
            argv = pinned([sys.executable, "-c", "from treadle.cli import main; main()", "otlp", "--port",
                           str(OTLP_PORT)], pin=True)  # fmt: skip
            receiver = subprocess.Popen(argv, cwd=REPO_ROOT, env=env)
            try:
                root = f"http://127.0.0.1:{OTLP_PORT}/"
                for _ in range(600):
                    try:
                        urllib.request.urlopen(root, timeout=1).read()
                        break
                    except OSError:
                        time.sleep(0.1)
                url = root + "v1/traces"
                asyncio.run(post_all(url, bodies[: max(1, len(bodies) // 20)], args.concurrency))  # warm-up
                cpu_before = cpu_seconds(receiver.pid) or 0.0
                elapsed, statuses = asyncio.run(post_all(url, bodies, args.concurrency))
                cpu = (cpu_seconds(receiver.pid) or 0.0) - cpu_before
                counts = json.loads(urllib.request.urlopen(root, timeout=5).read())
            finally:
                receiver.terminate()
                receiver.wait(30)
    decode_rate = spans / decode_s
    e2e_rate = spans / elapsed
    print(f"load average after the run: {loadavg()}")
    print(f"decode only (baseline): {decode_rate:,.0f} spans/s ({decode_s * 1000:.1f} ms for {spans:,} spans)")
    print(f"decode + map to events (in process, no Kafka): {spans / mapping_s:,.0f} spans/s")
    print(
        f"end to end (HTTP -> mapped -> acknowledged by Kafka): {e2e_rate:,.0f} spans/s over {elapsed:.2f} s; "
        f"receiver CPU {cpu:.2f} s = {spans / cpu if cpu else float('nan'):,.0f} spans per CPU-second; "
        f"answers {statuses}"
    )
    print(
        f"ratio end to end / decode only: {e2e_rate / decode_rate:.5f} (decode + map / decode only: "
        f"{mapping_s and decode_s / mapping_s:.4f})"
    )
    print(f"receiver counted {counts['spans_accepted']:,} spans accepted, {counts['spans_rejected']} rejected")


if __name__ == "__main__":
    main()
