"""What a processor is: something that folds validated input events into state and derived records.

The worker's intake takes input in fetched batches (streams/runtime/faust_transport.py), decodes and
validates each event once, then hands each processor the events whose schema it declared. A processor
owns its Faust tables (created in `setup`) and publishes derived records through its `ProcessingContext`.

Batches matter for speed (one state write and one output per step per batch instead of per event),
but Faust tables pick their RocksDB partition and changelog partition from "the current event";
`ctx.bind(event)` makes an event current so a table read through Faust (`table.get`) lands in that
event's partition. streams/runtime/table_writes.py reads and writes a given partition directly instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import faust

from streams.runtime.metrics import WorkerMetrics
from topics.codec import AvroCodec
from topics.intake import SourceMessage
from topics.settings import Settings


@dataclass(slots=True)  # not frozen: one per input event, and a frozen dataclass takes ~4x longer to build
class InputEvent:
    """A decoded, valid input event with where it came from (never changed once built)."""

    schema_name: str
    record: dict[str, Any]
    source: SourceMessage

    @property
    def session_key(self) -> bytes:
        return self.record["envelope"]["session_id"].encode()


class ProcessingContext(Protocol):
    metrics: WorkerMetrics  # the worker's Prometheus metrics, for processors that measure something
    codec: AvroCodec  # the worker's codec (it knows the schema registry), for processors that store input events

    async def publish(self, schema_name: str, record: dict[str, Any], key: bytes | None) -> None:
        """Send a derived record to the topic its schema belongs to (acked before input offsets commit). A record the
        worker would not accept (one that does not encode; a RewardSignal that fails the input checks) raises
        PublishError here, naming the processor and the field (topics.publish_checks)."""
        ...

    async def send(self, topic: str, key: bytes | None, value: bytes | None, partition: int | None = None) -> None:
        """Send raw bytes (e.g. a table changelog record), acked like `publish`."""
        ...

    def bind(self, event: InputEvent) -> None:
        """Make `event` current, so Faust table reads/writes use its partition."""
        ...

    def bind_partition(self, partition: int) -> None:
        """Like `bind`, for work outside any input event (timers): table reads/writes use `partition`."""
        ...

    async def failed(self, processor: str, event: InputEvent, exc: Exception) -> None:
        """Send `event` to dead letters (stage PROCESS) because `processor` could not fold it."""
        ...

    def input_backlog(self, partition: int) -> int | None:
        """Input records of `partition` still in Kafka past those handed out, as of the last fetch (None until a fetch
        has reported on every input topic, right after start): how far behind the worker is there, e.g. to do less
        per event while catching up."""
        ...


class EventProcessor(Protocol):
    """`name` is unique per app (it prefixes table names); `inputs` are the schema names it takes.

    `kind` (core, reward_source or evaluator) says what it emits; plugins declare all three as class
    attributes and are registered under `name` in the `treadle.processors` entry points (streams/runtime/plugins.py).
    """

    name: str
    kind: str
    inputs: frozenset[str]

    def setup(self, app: faust.App, settings: Settings) -> None:
        """Create tables and timers; called once while the app is built."""
        ...

    async def process(self, events: list[InputEvent], ctx: ProcessingContext) -> None:
        """Fold a batch (in arrival order); an event that cannot be folded goes to ctx.failed."""
        ...

    # Optional: `def attach(self, ctx: ProcessingContext) -> None`, called once after the pipeline is built,
    # for processors that also act outside batches (a timer that closes windows when no input arrives).
