"""`treadle worker`: the Faust app (intake, processors, tables, timers) and, by default, a `treadle sink` child.

The sink child owns ClickHouse (embedded chDB allows one process per data path) and answers
`treadle sql` on 127.0.0.1; see sinks/service.py. TREADLE_SINK=off runs the processors only,
for deployments that run `treadle sink` on its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time

import faust
from mode.utils.times import want_seconds

from streams.runtime.app import Pipeline, build_pipeline
from streams.runtime.garbage_collection import freeze_startup_objects, tune_collector
from streams.runtime.gpu import GpuTelemetry
from streams.runtime.metrics_page import add_metrics_page
from streams.runtime.plugins import ProcessorRegistry
from streams.runtime.processes import SINK_REFUSED_EXIT
from streams.runtime.run_info import FirstInput, SinkRefusal, SqlEndpoint, WorkerInfo
from topics import native_codec
from topics.admin import ensure_topics
from topics.catalog import TopicCatalog, TopicRole, TopicSpec
from topics.codec import AvroCodec
from topics.names import RESOURCE_SAMPLE
from topics.registry import SchemaRegistry
from topics.schemas import SchemaSet
from topics.settings import Settings

log = logging.getLogger(__name__)

STOP_DEADLINE_S = 45.0  # a stop that has not ended the process by then ends it (what was not committed is replayed)
SINK_CHECK_S = 1.0  # how often the worker checks that its sink child still runs
SINK_RESTART_MAX_S = 30.0  # longest pause between restarts of a sink child that keeps exiting
SINK_STABLE_S = 60.0  # a sink child that ran this long before it exited is restarted without backing off


async def prepare_cluster(
    settings: Settings, registry: SchemaRegistry | None = None, app: faust.App | None = None
) -> None:
    """Topics exist with the right partitions, and the shipped schemas are registered; with `app`, its tables'
    changelog topics exist too (changelog_specs), with every partition led, before the app starts."""
    catalog = TopicCatalog(settings)
    states = await ensure_topics(catalog, settings.kafka_bootstrap_servers)
    if app is not None:
        await ensure_topics(changelog_specs(app), settings.kafka_bootstrap_servers)
    fresh = any(state.created for state in states if state.spec.kind == "schemas")
    registry = registry or SchemaRegistry(settings.kafka_bootstrap_servers, catalog["schemas"].name)
    await registry.register_set(SchemaSet.load(), load=not fresh)


def changelog_specs(app: faust.App) -> list[TopicSpec]:
    """The changelog topic of each of `app`'s tables, as Faust declares it at start (partitions, replicas, cleanup
    policy and retention as faust's Topic.declare and Transport._topic_config make them, plus the table's topic
    configs).

    Made before the app starts, not by Faust as it starts: a changelog Faust had just created was once missing
    from the group's first assignment ("Ignoring missing topic": its partitions had no leader yet), so its
    partitions came in a second rebalance ~10 s later, under load, and that one never finished (issue 24)."""
    specs = []
    for table in app.tables.values():
        topic = table.changelog_topic
        config: dict[str, str] = {}
        policy = [flag for flag, on in (("compact", topic.compacting), ("delete", topic.deleting)) if on]
        if policy:
            config["cleanup.policy"] = ",".join(policy)
        if topic.retention:
            config["retention.ms"] = str(int(want_seconds(topic.retention) * 1000.0))
        config.update({key: str(value) for key, value in (topic.config or {}).items()})
        for name in topic.topics:
            specs.append(
                TopicSpec(
                    kind="changelog",
                    name=name,
                    role=TopicRole.INTERNAL,
                    value_schema=None,
                    key="",
                    partitions=topic.partitions or app.conf.topic_partitions,
                    replication_factor=topic.replicas or app.conf.topic_replication_factor or 1,
                    config=config,
                    doc=f"Changelog of table {table.name}.",
                )
            )
    return specs


def build_worker(settings: Settings) -> Pipeline:
    """The pipeline, with the schema registry refreshed in the background, ready for faust.Worker."""
    registry = SchemaRegistry(settings.kafka_bootstrap_servers, TopicCatalog(settings)["schemas"].name)
    # Writer schemas we don't ship (newer producers, other languages) are found in the registry.
    pipeline = build_pipeline(settings, codec=AvroCodec(lookup=registry.lookup))
    pipeline.intake.reload_schemas = registry.load_if_due  # an unknown writer may have been registered since
    asyncio.run(prepare_cluster(settings, registry, pipeline.app))
    for processor in pipeline.processors:
        refresh = getattr(processor, "refresh_policies", None)  # policies pushed before this start
        if refresh is not None:
            asyncio.run(refresh())
    add_metrics_page(pipeline)
    pipeline.enabled_processors = describe_processors(pipeline)
    FirstInput.path(settings).unlink(missing_ok=True)
    pipeline.app.on_first_input = lambda: mark_first_input(settings)
    if settings.gpu_sample_seconds > 0:
        add_gpu_telemetry(pipeline, GpuTelemetry(pipeline.metrics.registry))

    @pipeline.app.task
    async def refresh_schemas() -> None:
        while True:
            await asyncio.sleep(10)
            try:
                await registry.load()
            except Exception as exc:  # the registry is an optimisation for unknown writers, never fatal
                log.warning("could not refresh the schema registry: %s", exc)

    return pipeline


def mark_first_input(settings: Settings) -> None:
    """Leave FirstInput (time and process CPU now) for a benchmark's clock."""
    FirstInput(pid=os.getpid(), read_at=time.time(), cpu_s=time.process_time()).write(settings)


def describe_processors(pipeline: Pipeline, registry: ProcessorRegistry | None = None) -> str:
    """`name (kind, distribution version)` of each processor the worker runs, for its start log; also sets
    treadle_processor_info, so a scrape says which plugin versions are live."""
    registry = registry or ProcessorRegistry.discover()
    parts = []
    for processor in pipeline.processors:
        distribution, version = registry.provenance(processor.name)
        pipeline.metrics.processor_info.labels(processor.name, processor.kind, version or "unknown").set(1)
        made_by = f", {distribution} {version}" if distribution else ""
        parts.append(f"{processor.name} ({processor.kind}{made_by})")
    return ", ".join(parts)


def add_gpu_telemetry(pipeline: Pipeline, telemetry: GpuTelemetry) -> None:
    @pipeline.app.task
    async def sample_gpus() -> None:
        if not telemetry.start():
            return
        key = telemetry.host.encode()
        try:
            while True:
                for record in telemetry.sample():
                    await pipeline.publish(RESOURCE_SAMPLE, record, key=key)
                await asyncio.sleep(pipeline.settings.gpu_sample_seconds)
        finally:
            telemetry.stop()


class SinkChild:
    """`treadle sink` as a child of the worker (TREADLE_SINK=child): its own process, its own core."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.proc: subprocess.Popen[bytes] | None = None
        # Set when the worker begins to stop: a SIGTERM to the process group reaches the child first, and it must
        # not be started again while the worker winds down.
        self.stopping = False

    def start(self) -> None:
        SqlEndpoint.path(self.settings).unlink(missing_ok=True)
        SinkRefusal.path(self.settings).unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "treadle.cli", "sink", "--parent", str(os.getpid())],
            env={**os.environ, **self.settings.to_env()},
        )

    async def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() == SINK_REFUSED_EXIT:
                return  # refused by its group, which has a sink already; supervise() says so
            if self.proc.poll() is not None:
                raise RuntimeError(f"the sink process exited with code {self.proc.returncode}")
            info = SqlEndpoint.read(self.settings)
            if info is not None and info.pid == self.proc.pid:
                return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"the sink process did not serve SQL within {timeout:.0f} s")

    def stop(self, wait_s: float = 30.0) -> None:
        self.stopping = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    async def supervise(self) -> None:
        """Start the sink child again whenever it exits while the worker runs (it was simply gone after a crash),
        waiting longer between restarts while it keeps dying soon after each start, up to SINK_RESTART_MAX_S."""
        pause, started = SINK_CHECK_S, time.monotonic()
        while True:
            await asyncio.sleep(SINK_CHECK_S)
            if self.stopping:
                return
            if self.proc is None or self.proc.poll() is None:
                continue
            if self.proc.returncode == SINK_REFUSED_EXIT:
                log.error("this worker runs without a sink: its sink child (pid %d) was refused (the reason is above); "
                          "the group's other sink writes the rows", self.proc.pid)  # fmt: skip
                return
            lived = time.monotonic() - started
            pause = SINK_CHECK_S if lived > SINK_STABLE_S else min(pause * 2, SINK_RESTART_MAX_S)
            log.error("the sink child (pid %d) exited with code %s after %.0f s; starting it again in %.0f s (its log "
                      "lines are above; rows wait in Kafka meanwhile)", self.proc.pid, self.proc.returncode, lived,
                      pause)  # fmt: skip
            await asyncio.sleep(pause)
            if self.stopping:
                return
            started = time.monotonic()
            self.start()
            try:
                await self.wait_ready()
            except RuntimeError as exc:
                log.error("the restarted sink child is not serving: %s", exc)


def run_worker(settings: Settings, loglevel: str = "info") -> None:
    """Run until SIGTERM/SIGINT; exits the process like any Faust worker."""
    settings.worker_dir.mkdir(parents=True, exist_ok=True)
    tune_collector(settings.gc_thresholds)
    pipeline = build_worker(settings)
    pipeline.metrics.gc_pauses.watch()
    sink = SinkChild(settings) if settings.sink == "child" else None
    worker = TreadleWorker(pipeline.app, settings, sink, loglevel=loglevel, quiet=True)
    worker.processors_line = pipeline.enabled_processors
    try:
        if sink is not None:
            sink.start()
        worker.execute_from_commandline()
    finally:
        if sink is not None:
            sink.stop()


class TreadleWorker(faust.Worker):
    """A Faust worker that announces itself (WorkerInfo) once recovery is done and the web server is up."""

    def __init__(self, app: faust.App, settings: Settings, sink: SinkChild | None, **kwargs: object) -> None:
        super().__init__(app, **kwargs)
        self.treadle_settings = settings
        self.sink = sink
        self._deadline: threading.Timer | None = None
        self.processors_line = ""  # what describe_processors said, logged once the worker runs

    async def stop(self) -> None:
        """Faust's stop, bounded: a batch that never finishes (or a hook waiting on it) cannot keep the process up
        past STOP_DEADLINE_S. Ending it then is as safe as a crash: uncommitted input is processed again."""
        if self.sink is not None:
            self.sink.stopping = True
        if self._deadline is None:
            self._deadline = threading.Timer(STOP_DEADLINE_S, self._stop_now)
            self._deadline.daemon = True
            self._deadline.start()
        await super().stop()

    def _stop_now(self) -> None:
        log.error("the worker did not stop within %.0f s; ending it now (uncommitted input is processed again after "
                  "the restart)", STOP_DEADLINE_S)  # fmt: skip
        if self.sink is not None:
            self.sink.stop(wait_s=5.0)
        logging.shutdown()
        os._exit(1)

    async def on_startup_finished(self) -> None:
        # The schema and policy readers assign a consumer every few seconds; aiokafka logs each assignment.
        logging.getLogger("aiokafka.consumer.subscription_state").setLevel(logging.WARNING)
        await super().on_startup_finished()
        freeze_startup_objects()
        if self.sink is not None:
            await self.sink.wait_ready()
            self.add_future(self.sink.supervise())
        s = self.treadle_settings
        log.info("Avro codec: %s", native_codec.describe())
        log.info("processors enabled (TREADLE_PROCESSORS): %s", self.processors_line)
        WorkerInfo(pid=os.getpid(), web_port=s.web_port, embedded_clickhouse=s.embedded_clickhouse).write(s)
