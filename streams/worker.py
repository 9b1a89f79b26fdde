"""`treadle worker`: one process running the Faust agents, the ClickHouse sink and the SQL endpoint.

With embedded chDB only one process may open the data path, so the worker that owns it also
answers `treadle sql` over HTTP on 127.0.0.1 (see WorkerInfo for how the CLI finds it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import faust
import orjson
from faust.web import Request, Response, View

from processors.app import Pipeline, build_pipeline
from sinks.clickhouse import ClickHouseStore
from sinks.consumer import SinkConsumer
from sinks.migrations import apply_migrations
from sinks.sql_guard import ReadOnlyQueryError
from streams.settings import Settings
from topics.admin import ensure_topics
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.registry import SchemaRegistry
from topics.schemas import SchemaSet

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerInfo:
    """Written to <home>/worker/worker.json while a worker runs, so the CLI can route SQL to it."""

    pid: int
    web_port: int
    embedded_clickhouse: bool

    @staticmethod
    def path(settings: Settings) -> Path:
        return settings.worker_dir / "worker.json"

    def write(self, settings: Settings) -> None:
        path = self.path(settings)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, settings: Settings) -> WorkerInfo | None:
        try:
            info = cls(**json.loads(cls.path(settings).read_text()))
        except (OSError, ValueError, TypeError):
            return None
        try:
            os.kill(info.pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return info


async def prepare_cluster(settings: Settings, registry: SchemaRegistry | None = None) -> None:
    """Topics exist with the right partitions, and the shipped schemas are registered."""
    catalog = TopicCatalog(settings)
    await ensure_topics(catalog, settings.kafka_bootstrap_servers)
    registry = registry or SchemaRegistry(settings.kafka_bootstrap_servers, catalog["schemas"].name)
    await registry.register_set(SchemaSet.load())


def build_worker(settings: Settings) -> tuple[Pipeline, ClickHouseStore]:
    """The pipeline plus the sink and SQL endpoint, ready for faust.Worker."""
    registry = SchemaRegistry(settings.kafka_bootstrap_servers, TopicCatalog(settings)["schemas"].name)
    # Writer schemas we don't ship (newer producers, other languages) are found in the registry.
    pipeline = build_pipeline(settings, codec=AvroCodec(lookup=registry.lookup))
    asyncio.run(prepare_cluster(settings, registry))
    store = ClickHouseStore.open(settings)
    apply_migrations(store)
    sink = SinkConsumer(settings, pipeline.catalog, pipeline.codec, pipeline.intake, store)
    app = pipeline.app

    @app.task
    async def clickhouse_sink() -> None:
        await sink.run()

    @app.task
    async def refresh_schemas() -> None:
        while True:
            await asyncio.sleep(10)
            try:
                await registry.load()
            except Exception as exc:  # the registry is an optimisation for unknown writers, never fatal
                log.warning("could not refresh the schema registry: %s", exc)

    @app.page("/sql")
    class SQLView(View):
        async def post(self, request: Request) -> Response:
            body = await request.json()
            try:
                result = await store.read_only_query(str(body.get("sql", "")))
            except ReadOnlyQueryError as exc:
                return self.json({"error": str(exc)}, status=400)
            except Exception as exc:  # unknown table, syntax error...: the user's to fix
                return self.json({"error": f"ClickHouse error: {_first_line(exc)}"}, status=400)
            return self.json({"columns": list(result.column_names), "rows": _jsonable(result.result_rows)})

    return pipeline, store


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _jsonable(rows: list) -> list[list]:
    """ClickHouse values as JSON: datetimes as ISO strings, bytes as text, tuples as lists."""
    return orjson.loads(orjson.dumps([list(r) for r in rows], default=str, option=orjson.OPT_PASSTHROUGH_DATETIME))


def run_worker(settings: Settings, loglevel: str = "info") -> None:
    """Run until SIGTERM/SIGINT; exits the process like any Faust worker."""
    settings.worker_dir.mkdir(parents=True, exist_ok=True)
    pipeline, _store = build_worker(settings)
    worker = TreadleWorker(pipeline.app, settings, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()


class TreadleWorker(faust.Worker):
    """A Faust worker that announces itself (WorkerInfo) once recovery is done and the web server is up."""

    def __init__(self, app: faust.App, settings: Settings, **kwargs: object) -> None:
        super().__init__(app, **kwargs)
        self.treadle_settings = settings

    async def on_startup_finished(self) -> None:
        await super().on_startup_finished()
        s = self.treadle_settings
        WorkerInfo(pid=os.getpid(), web_port=s.web_port, embedded_clickhouse=s.embedded_clickhouse).write(s)
