"""`treadle sink`: the ClickHouse sink and the read-only SQL endpoint, in a process of their own.

The sink decodes every topic again and inserts rows; in the Faust worker's process that took about
half of its one core, so the worker starts this as a child process by default (TREADLE_SINK=child)
and each gets a core. With embedded chDB this process owns the data path (one process per path),
so it also answers `treadle sql` on 127.0.0.1:TREADLE_SQL_PORT (`/sql`: JSON rows; `/arrow`: Arrow IPC
streams, for the state history reads); SqlEndpoint says where. `/variant` takes the rows `treadle reweave` writes
(a named variant's, never live ones), since no other process can open the database while this one runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import orjson
from aiohttp import web
from pydantic import ValidationError

from sinks.clickhouse import ClickHouseStore, ClickHouseUnavailableError
from sinks.consumer import SinkConsumer
from sinks.merge_settings import apply_merge_settings
from sinks.migrations import apply_migrations
from sinks.sink_group import SinkRefusedError
from sinks.sql_auth import check_sql_bind, token_middleware
from sinks.sql_guard import ReadOnlyQueryError
from sinks.variants import VariantWrite, apply_write
from streams.runtime.garbage_collection import freeze_startup_objects, tune_collector
from streams.runtime.processes import SINK_REFUSED_EXIT, pid_alive
from streams.runtime.run_info import SinkRefusal, SqlEndpoint
from topics import native_codec
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.intake import Intake
from topics.registry import SchemaRegistry
from topics.settings import Settings
from topics.tool_schemas import ToolSchemas
from topics.validation import InputValidator

log = logging.getLogger(__name__)
REQUEST_BYTES = 64 * 1024 * 1024  # a /variant part (sinks.variants sends at most VARIANT_PART_BYTES of records)


def open_store(settings: Settings, wait_s: float = 30.0) -> ClickHouseStore:
    """Open ClickHouse; a just-killed predecessor may hold embedded chDB for a moment, so retry."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return ClickHouseStore.open(settings)
        except ClickHouseUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def sql_app(
    store: ClickHouseStore, sink: SinkConsumer | None = None, *, token: str | None = None, serve_sql: bool = True
) -> web.Application:
    """/sql and /arrow (read-only queries; with `token`, only for requests that carry it) and /metrics.

    `serve_sql` False leaves only /metrics: with a ClickHouse server, readers query the server itself.
    """

    async def post_sql(request: web.Request) -> web.Response:
        body = await request.json()
        try:
            result = await store.read_only_query(str(body.get("sql", "")))
        except ReadOnlyQueryError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except Exception as exc:  # unknown table, syntax error...: the user's to fix
            return web.json_response({"error": f"ClickHouse error: {_first_line(exc)}"}, status=400)
        rows = orjson.dumps([list(r) for r in result.result_rows], default=str)
        columns = orjson.dumps(list(result.column_names))
        return web.Response(body=b'{"columns":' + columns + b',"rows":' + rows + b"}", content_type="application/json")

    async def post_arrow(request: web.Request) -> web.Response:
        """Read-only statements (`sql`: one or a list), answered as Arrow IPC streams (columns, no per-row JSON).

        A list runs two statements at a time (ClickHouseStore.read_only_queries_arrow); the body is, per
        statement in order, its stream's length (8 bytes, big-endian) and the stream.
        """
        body = await request.json()
        sql = body.get("sql", "")
        statements = [str(s) for s in sql] if isinstance(sql, list) else [str(sql)]
        try:
            streams = await store.read_only_queries_arrow_streams(statements)
        except ReadOnlyQueryError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except Exception as exc:
            return web.json_response({"error": f"ClickHouse error: {_first_line(exc)}"}, status=400)
        parts = [part for stream in streams for part in (len(stream).to_bytes(8, "big"), stream)]
        return web.Response(body=b"".join(parts), content_type="application/vnd.apache.arrow.stream")

    async def post_variant(request: web.Request) -> web.Response:
        """Re-woven rows of one variant (`treadle reweave` / `backfill` while this process owns embedded chDB): the
        only write this service takes, and never to live rows (sinks.variants refuses the name `live`)."""
        try:
            write = VariantWrite.model_validate(await request.json())
            written = await asyncio.to_thread(apply_write, store, write)
        except (ValidationError, ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"refused variant rows: {_first_line(exc)}"}, status=400)
        except Exception as exc:
            return web.json_response({"error": f"ClickHouse error: {_first_line(exc)}"}, status=400)
        return web.json_response({"rows": written})

    async def get_metrics(request: web.Request) -> web.Response:
        body = await sink.exposition() if sink is not None else b""
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    middlewares = [token_middleware(token)] if token is not None else []
    app = web.Application(middlewares=middlewares, client_max_size=REQUEST_BYTES)
    if serve_sql:
        app.router.add_post("/sql", post_sql)
        app.router.add_post("/arrow", post_arrow)
        app.router.add_post("/variant", post_variant)
    app.router.add_get("/metrics", get_metrics)
    return app


async def serve(settings: Settings, parent_pid: int | None = None) -> None:
    """Run the sink and the SQL endpoint until cancelled, or until the parent worker is gone."""
    catalog = TopicCatalog(settings)
    registry = SchemaRegistry(settings.kafka_bootstrap_servers, catalog["schemas"].name)
    await registry.load()
    codec = AvroCodec(lookup=registry.lookup)
    intake = Intake(
        codec,
        catalog,
        InputValidator(ToolSchemas.load(settings.tool_schemas)),
        reload_schemas=registry.load_if_due,
        max_event_bytes=settings.max_event_bytes,  # what the worker dead-letters is not a raw event either
    )
    store = await asyncio.to_thread(open_store, settings)
    await asyncio.to_thread(apply_migrations, store)
    await asyncio.to_thread(apply_merge_settings, store)
    consumer = SinkConsumer(settings, catalog, codec, intake, store)
    consumer.metrics.gc_pauses.watch()
    token = settings.sql_token.get_secret_value() if settings.sql_token is not None else None
    app = sql_app(store, consumer, token=token, serve_sql=settings.embedded_clickhouse)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, settings.bind_host, settings.sql_port).start()
    SqlEndpoint(pid=os.getpid(), port=settings.sql_port).write(settings)
    serving = "SQL and /metrics" if settings.embedded_clickhouse else "/metrics (SQL readers query the server)"
    log.info("%s on %s:%d%s; sinking to %s; Avro codec: %s", serving, settings.bind_host, settings.sql_port,
             " (SQL needs TREADLE_SQL_TOKEN)" if token is not None else "", store.database,
             native_codec.describe())  # fmt: skip
    freeze_startup_objects()
    sink = asyncio.create_task(consumer.run())
    try:
        while not sink.done():
            if parent_pid is not None and not pid_alive(parent_pid):
                log.warning("worker %d is gone; the sink stops too", parent_pid)
                break
            await asyncio.sleep(0.5)
        if sink.done():
            sink.result()  # re-raise a crash
    finally:
        sink.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await sink
        await runner.cleanup()
        await store.aclose()


def run_sink(settings: Settings, parent_pid: int | None = None) -> None:
    """Run the sink until SIGTERM/SIGINT; SqlExposureError first when it would serve SQL beyond loopback openly.

    Exits with SINK_REFUSED_EXIT when its group refuses it (sinks.sink_group), so its worker does not restart it.
    """
    if settings.embedded_clickhouse:
        check_sql_bind(settings)
    settings.worker_dir.mkdir(parents=True, exist_ok=True)
    tune_collector(settings.gc_thresholds)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(settings, parent_pid))
    except SinkRefusedError as exc:
        log.error("this sink stops: %s", exc)
        SinkRefusal(pid=parent_pid or os.getpid(), reason=str(exc)).write(settings)
        raise SystemExit(SINK_REFUSED_EXIT) from None
