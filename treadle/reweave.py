"""Re-weaving history and backfilling a reward source, into a named variant beside the live rows.

`reweave_history` reads the past step events from raw_events (sinks' variants module says why not the topics), runs
the live worker's core over them (processors.steps.reweave: StepAssembler's fold, then every window settled) under a
reward policy, and writes the final rows as a variant. `backfill` first runs a reward-source plugin over the past
events with a RecordingContext, as the worker would hand them to it, and re-weaves the steps with its signals.

It lives in the shell because it needs both the processors (the core, the plugins) and the sinks (the store), and
sinks never import processors. It runs beside the worker: while the worker's sink owns embedded chDB (one process per
data path), the events are read through its SQL service and the rows written through its `/variant` endpoint, the
one write that service takes (never to live rows); otherwise it opens the database itself.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from itertools import count
from typing import Any

from pydantic import BaseModel, Field

from processors.steps.policy import PolicyBook, RewardPolicy, load_policy_file
from processors.steps.reweave import Reweave, Row, policy_book, reweave
from sinks.clickhouse import ClickHouseStore
from sinks.export_sql import utc
from sinks.variants import checked_variant, past_events, read_past_events, write_variant, write_variant_rows
from streams.runtime.plugins import ProcessorKind, ProcessorRegistry
from streams.runtime.processor import EventProcessor, InputEvent
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.intake import SourceMessage
from topics.names import REWARD, TRANSITION
from topics.output_size import fit
from topics.settings import Settings
from treadle.testing import RecordingContext

log = logging.getLogger(__name__)

PLUGIN_BATCH = 500  # events per process() call, about a worker's batch


class ReweaveError(ValueError):
    """Something the user has to fix before a re-weave can run; one line."""


class ReweaveReport(BaseModel):
    """What one re-weave or backfill read and wrote."""

    variant: str
    reward_policy: str = Field(description="Version of the reward policy the rows were woven with.")
    since: datetime | None = None
    until: datetime | None = None
    processor: str | None = Field(default=None, description="The plugin a backfill ran.")
    events: int = Field(default=0, description="Step events folded (each event_id once; a backfill's signals too).")
    signals: int = Field(default=0, description="Reward signals the backfilled plugin published.")
    steps: int = 0
    orphans: int = 0
    rows: dict[str, int] = Field(default_factory=dict, description="Rows written per table.")
    seconds: float = 0.0

    def summary(self) -> str:
        rows = ", ".join(f"{n:,} {table}" for table, n in self.rows.items() if n)
        ran = f" with {self.processor}'s {self.signals:,} signals" if self.processor else ""
        return (f"variant {self.variant!r}: {self.steps:,} steps re-woven under reward policy {self.reward_policy!r}"
                f"{ran} from {self.events:,} events in {self.seconds:.1f} s; wrote {rows or 'no rows'}")  # fmt: skip


def live_policy(settings: Settings) -> RewardPolicy:
    """The worker's reward policy file (TREADLE_REWARD_POLICY), else the built-in default."""
    return load_policy_file(settings.reward_policy) if settings.reward_policy is not None else RewardPolicy()


def as_published(rows: Sequence[Row], codec: AvroCodec, limit: int) -> list[Row]:
    """`rows` as the worker publishes them: a Transition above TREADLE_MAX_EVENT_BYTES has its large fields cut
    (topics.output_size), so a re-weave with the live policy gives the live row there too."""
    out = []
    for schema_name, record in rows:
        if schema_name == TRANSITION and _rough_size(record) > limit // 2:
            value, cut = fit(schema_name, record, codec.encode, limit, 2 * limit)
            if cut:
                record = codec.decode(value)[1]
        out.append((schema_name, record))
    return out


def _rough_size(record: dict[str, Any]) -> int:
    """At least the bytes of the record's long text fields (a cheap test for the rare row that may need cutting)."""
    texts = [record.get("output"), record.get("params_json"), record.get("error")]
    texts += [c.get("evidence") for c in record.get("reward_components") or []]
    return sum(len(t) for t in texts if t)


def weave_variant(
    events: Sequence[tuple[str, dict[str, Any]]], policies: PolicyBook, settings: Settings
) -> tuple[list[Row], Reweave]:
    """The final rows of the steps in `events`, as the worker would publish them."""
    done = reweave(events, policies)
    return as_published(done.rows, AvroCodec(), settings.max_event_bytes), done


def reweave_history(
    settings: Settings,
    policy: RewardPolicy,
    variant: str,
    since: datetime | None = None,
    until: datetime | None = None,
    store: ClickHouseStore | None = None,
) -> ReweaveReport:
    """Re-weave the steps dispatched in [since, until) under `policy` into `variant`."""
    return _run(settings, policy, variant, since, until, store, plugin=None)


def backfill(
    settings: Settings,
    processor: str,
    variant: str,
    since: datetime | None = None,
    until: datetime | None = None,
    policy: RewardPolicy | None = None,
    store: ClickHouseStore | None = None,
    registry: ProcessorRegistry | None = None,
) -> ReweaveReport:
    """Run the reward-source plugin `processor` over the past events of the steps dispatched in [since, until), and
    re-weave them with its signals into `variant` (under `policy`, by default the worker's)."""
    plugin = load_reward_source(processor, registry or ProcessorRegistry.discover())
    return _run(settings, policy or live_policy(settings), variant, since, until, store, plugin=plugin)


def load_reward_source(name: str, registry: ProcessorRegistry) -> EventProcessor:
    """An instance of the plugin `name`, which must be a reward source (its signals are what a backfill weaves)."""
    from streams.runtime.plugins import PluginError

    try:
        cls = registry.load(name)
    except PluginError as exc:
        raise ReweaveError(str(exc)) from None
    if cls.kind != ProcessorKind.REWARD_SOURCE:
        raise ReweaveError(f"processor {name!r} is a {cls.kind}, not a reward source: a backfill weaves the reward "
                           "signals a plugin publishes")  # fmt: skip
    return cls()


def run_plugin(plugin: EventProcessor, events: Sequence[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The reward signals `plugin` publishes for `events` (those of its inputs), handed over as the worker hands
    them: InputEvents in batches, each session's events in its producer's order. Its setup() is not called (it needs
    a Faust app), so a plugin that keeps state in Faust tables cannot be backfilled this way."""
    codec, catalog, offsets = AvroCodec(), TopicCatalog(Settings()), count()
    mine = sorted(
        (e for e in events if e[0] in plugin.inputs),
        key=lambda e: (e[1]["envelope"]["session_id"], e[1]["envelope"]["seq"], e[1]["envelope"]["event_id"]),
    )
    inputs = []
    for schema_name, record in mine:
        env = record["envelope"]
        source = SourceMessage(catalog.for_schema(schema_name).name, 0, next(offsets), env["session_id"].encode(),
                               codec.encode(schema_name, record), env["event_time"] // 1000)  # fmt: skip
        inputs.append(InputEvent(schema_name, record, source))
    ctx = RecordingContext(processor=plugin.name)

    async def feed() -> None:
        for start in range(0, len(inputs), PLUGIN_BATCH):
            await plugin.process(inputs[start : start + PLUGIN_BATCH], ctx)

    asyncio.run(feed())
    if ctx.failures:
        first = ctx.failures[0]
        log.warning("%s sent %d events to dead letters during the backfill (they get no signal), the first: %s",
                    plugin.name, len(ctx.failures), first.error)  # fmt: skip
    return ctx.rewards


def _run(
    settings: Settings,
    policy: RewardPolicy,
    variant: str,
    since: datetime | None,
    until: datetime | None,
    store: ClickHouseStore | None,
    plugin: EventProcessor | None,
) -> ReweaveReport:
    checked_variant(variant)
    with _few_collections(settings.gc_thresholds):
        return _reweave(settings, policy, variant, utc(since), utc(until), store, plugin)


@contextmanager
def _few_collections(thresholds: tuple[int, int, int]) -> Iterator[None]:
    """The worker's collector thresholds (TREADLE_GC_THRESHOLDS) for the run: a re-weave makes records by the
    hundred thousand and keeps them, and the default thresholds walk them again and again (measured: mapping the
    rows took 5x longer)."""
    before = gc.get_threshold()
    gc.set_threshold(*thresholds)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _reweave(
    settings: Settings,
    policy: RewardPolicy,
    variant: str,
    since: datetime | None,
    until: datetime | None,
    store: ClickHouseStore | None,
    plugin: EventProcessor | None,
) -> ReweaveReport:
    started = time.perf_counter()
    events = read_past_events(store, since, until) if store is not None else past_events(settings, since, until)
    signals: list[dict[str, Any]] = []
    if plugin is not None:
        signals = run_plugin(plugin, events)
        replaced = {s["source"] for s in signals}  # the source's earlier signals give way to this run's
        events = [e for e in events if not (e[0] == REWARD and e[1]["source"] in replaced)]
        events += [(REWARD, s) for s in signals]
    rows, done = weave_variant(events, policy_book(policy), settings)
    records = [*rows, *((REWARD, s) for s in signals)]
    if store is not None:
        written = write_variant(store, variant, records)
    else:
        written = write_variant_rows(settings, variant, records)
    return ReweaveReport(
        variant=variant, reward_policy=policy.version, since=since, until=until,
        processor=plugin.name if plugin is not None else None, events=done.events, signals=len(signals),
        steps=done.steps, orphans=done.orphans, rows=written, seconds=time.perf_counter() - started,
    )  # fmt: skip
