"""`GET /metrics` on the worker's web port: its own registry, then its sink child's.

Consumer lag is measured at scrape time (end offsets from the broker minus the next offset the
worker will process), so it is exact when scraped rather than as of the last commit.
"""

from __future__ import annotations

import logging

import aiohttp
from faust.web import Request, Response, View

from streams.runtime.app import Pipeline
from streams.runtime.metrics import CONTENT_TYPE

log = logging.getLogger(__name__)


async def refresh_consumer_lag(pipeline: Pipeline) -> None:
    consumer = pipeline.app.consumer
    inputs = {spec.name for spec in pipeline.catalog.inputs}
    tps = [tp for tp in consumer.assignment() if tp.topic in inputs]
    if not tps:
        return
    end_offsets = await consumer.highwaters(*tps)
    for tp, end in end_offsets.items():
        processed = pipeline.next_offsets.get((tp.topic, tp.partition))
        if processed is None:
            processed = await consumer.position(tp)
        if processed is not None:
            lag = max(0, end - processed)
            pipeline.metrics.consumer_lag.labels(pipeline.settings.app_id, tp.topic, str(tp.partition)).set(lag)


async def sink_exposition(pipeline: Pipeline) -> bytes:
    """The sink child's metrics, or nothing (with a log line) if it does not answer."""
    if pipeline.settings.sink != "child":
        return b""
    url = f"http://127.0.0.1:{pipeline.settings.sql_port}/metrics"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
            session.get(url) as response,
        ):
            response.raise_for_status()
            return await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("the sink's metrics at %s did not answer (%s); serving the worker's only", url, exc)
        return b""


def add_metrics_page(pipeline: Pipeline) -> None:
    @pipeline.app.page("/metrics")
    class Metrics(View):
        async def get(self, request: Request) -> Response:
            try:
                await refresh_consumer_lag(pipeline)
            except Exception as exc:  # a scrape must still answer while partitions move
                log.warning("consumer lag not refreshed: %r", exc)
            body = pipeline.metrics.exposition() + await sink_exposition(pipeline)
            return self.bytes(body, content_type=CONTENT_TYPE.split(";")[0])
