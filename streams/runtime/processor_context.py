"""The context a processor's `process()` is handed: the pipeline's, seen through the processor that uses it.

Three things differ from the bare pipeline. A publish is checked where it is made (topics.publish_checks), so a
bad record raises in the plugin that made it, with its name. Records are counted per processor. And a batch that
raised is retried event by event (`process_isolated` in streams.runtime.app) without sending anything twice: the
failed attempt's sends are remembered, each retried event's publishes are held until it returns, and then only
those the failed attempt did not already send go out; an event that raises again sends nothing from its retry.
"""

from __future__ import annotations

from typing import Any

from streams.runtime.metrics import WorkerMetrics
from streams.runtime.processor import InputEvent
from topics.codec import AvroCodec
from topics.publish_checks import checked_publish

Sent = tuple[str, bytes | None, bytes]  # (schema, key, value) as sent


class ProcessorContext:
    """One processor's view of a Pipeline (streams.runtime.app) for one call of its `process()`."""

    def __init__(self, pipeline: Any, processor: str, sent_before: set[Sent] | None = None) -> None:
        self.pipeline = pipeline
        self.processor = processor
        self.metrics: WorkerMetrics = pipeline.metrics
        self.codec: AvroCodec = pipeline.codec
        self.sent: list[Sent] = []  # what this call sent (a failed batch attempt's are not sent again on its retry)
        self._sent_before = sent_before  # set on a retry: what the failed attempt sent
        self._held: list[Sent] | None = [] if sent_before is not None else None
        self._out_counters: dict[str, Any] = {}

    async def publish(self, schema_name: str, record: dict[str, Any], key: bytes | None) -> None:
        """Check, encode and send (held until the event returns on a retry); PublishError names this processor."""
        value = self._checked(schema_name, record, key)
        if self._held is not None:
            self._held.append((schema_name, key, value))
        else:
            await self._send(schema_name, key, value)

    def _checked(self, schema_name: str, record: dict[str, Any], key: bytes | None) -> bytes:
        pipeline = self.pipeline
        return checked_publish(
            self.processor, schema_name, record, key,
            encode=lambda schema, checked: pipeline.encode_output(schema, checked, key),  # type: ignore[no-any-return]
            codec=self.codec, validator=pipeline.intake.validator, publishable=pipeline.outputs,
        )  # fmt: skip

    async def _send(self, schema_name: str, key: bytes | None, value: bytes) -> None:
        await self.pipeline.send_output(schema_name, key, value)
        self.sent.append((schema_name, key, value))
        counter = self._out_counters.get(schema_name)
        if counter is None:
            counter = self._out_counters[schema_name] = self.metrics.processor_records_out.labels(
                self.processor, schema_name
            )
        counter.inc()

    async def release(self) -> None:
        """The retried event returned: send what it published, less what the failed attempt already sent."""
        held, self._held = self._held or [], None
        skipped = 0
        for schema_name, key, value in held:
            if self._sent_before is not None and (schema_name, key, value) in self._sent_before:
                skipped += 1
                continue
            await self._send(schema_name, key, value)
        if skipped:
            self.metrics.processor_duplicates_skipped.labels(self.processor).inc(skipped)

    def drop(self) -> None:
        """The retried event raised again: what it published on this try is not sent."""
        self._held = None

    async def send(self, topic: str, key: bytes | None, value: bytes | None, partition: int | None = None) -> None:
        await self.pipeline.send(topic, key, value, partition)

    def bind(self, event: InputEvent) -> None:
        self.pipeline.bind(event)

    def bind_partition(self, partition: int) -> None:
        self.pipeline.bind_partition(partition)

    async def failed(self, processor: str, event: InputEvent, exc: Exception) -> None:
        await self.pipeline.failed(processor, event, exc)

    def input_backlog(self, partition: int) -> int | None:
        return self.pipeline.input_backlog(partition)  # type: ignore[no-any-return]
