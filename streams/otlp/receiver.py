"""`treadle otlp`: OTLP/HTTP traces in (POST /v1/traces, protobuf or JSON, gzip or not), treadle events out.

Thin on purpose: size cap, decompression and decoding here (decoding), mapping and sending in OtlpGateway. The
answers follow the OTLP/HTTP specification: 200 with a partial success when some spans went to dead letters, 400
for a body that is not an OTLP trace export, 413 above TREADLE_OTLP_MAX_REQUEST_BYTES, 415 for another media type,
429 (too many events waiting for the broker) and 503 (broker unreachable or slow) with Retry-After: exporters retry
those, and nothing was accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

from streams.otlp.decoding import JSON, PROTOBUF, RequestError, TooLarge, decompress, parse_request, response, spans_of
from streams.otlp.gateway import Busy, OtlpGateway
from topics.codec import DeadLetterStage
from topics.settings import Settings

log = logging.getLogger(__name__)
TRACES_PATH = "/v1/traces"


def otlp_app(gateway: OtlpGateway) -> web.Application:
    """POST /v1/traces, and GET / for a liveness probe."""
    settings = gateway.settings
    limit = settings.otlp_max_request_bytes

    async def post_traces(request: web.Request) -> web.Response:
        content_type = request.headers.get("Content-Type", "")
        media = content_type.split(";", 1)[0].strip().lower()
        if media not in (PROTOBUF, JSON):
            return _status(415, f"Content-Type {content_type!r} is not supported: {PROTOBUF} or {JSON}", media)
        size = request.content_length
        if size is not None and size > limit:
            reason = f"the request is {size:,} bytes, above {limit:,} (TREADLE_OTLP_MAX_REQUEST_BYTES)"
            head = await request.content.read(64 * 1024)
            await gateway.dead_letter_request(DeadLetterStage.DECODE, reason, head, size)
            return _status(413, reason, media)
        body = await request.content.read(limit + 1)
        try:
            if len(body) > limit:
                raise TooLarge(f"the request is above {limit:,} bytes (TREADLE_OTLP_MAX_REQUEST_BYTES)")
            plain = decompress(body, request.headers.get("Content-Encoding", ""), limit)
            spans = spans_of(parse_request(plain, content_type))
        except TooLarge as exc:
            await gateway.dead_letter_request(DeadLetterStage.DECODE, str(exc), body, size or len(body))
            return _status(413, str(exc), media)
        except RequestError as exc:
            await gateway.dead_letter_request(DeadLetterStage.DECODE, str(exc), body, len(body))
            return _status(400, str(exc), media)
        try:
            result = await gateway.export(spans)
        except Busy as exc:
            log.warning("OTLP request of %d spans not accepted, the exporter will retry: %s", len(spans), exc)
            code = 429 if exc.overloaded else 503
            retry = {"Retry-After": str(settings.otlp_retry_after_s)}
            return _status(code, str(exc), media, headers=retry)
        body = response(media, result.rejected_spans, result.message)
        return web.Response(body=body, content_type=media)

    async def get_root(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "receiver": "treadle otlp",
                "traces": TRACES_PATH,
                "spans_accepted": gateway.spans_accepted,
                "spans_rejected": gateway.spans_rejected,
                "events_pending": gateway.pending,
            }
        )

    app = web.Application(client_max_size=limit + 1)
    app.router.add_post(TRACES_PATH, post_traces)
    app.router.add_get("/", get_root)
    return app


def _status(code: int, message: str, media: str, headers: dict[str, str] | None = None) -> web.Response:
    """An error answer: a google.rpc.Status (code = the HTTP status, as the spec allows), protobuf unless JSON."""
    if media == JSON:
        return web.json_response({"code": code, "message": message}, status=code, headers=headers)
    text = message.encode()
    body = b"\x08" + _varint(code) + b"\x12" + _varint(len(text)) + text
    return web.Response(body=body, status=code, content_type=PROTOBUF, headers=headers)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


async def serve(settings: Settings, host: str, port: int, ready: asyncio.Event | None = None) -> None:
    """Run the receiver on host:port until cancelled."""
    gateway = OtlpGateway(settings)
    await gateway.start()
    runner = web.AppRunner(otlp_app(gateway), access_log=None, auto_decompress=False)  # decoding caps inflation
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        log.warning(
            "treadle otlp on http://%s:%d%s (%s conventions) -> %s",
            host,
            port,
            TRACES_PATH,
            settings.otlp_conventions,
            settings.kafka_bootstrap_servers,
        )
        if ready is not None:
            ready.set()
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await gateway.close()


def run_otlp(settings: Settings, host: str, port: int) -> None:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings, host, port))
