"""The `contracts` processor: contract checks over the state graph's versions, and each step's provenance.

Two inputs. Dispatches and tool results (handed like any processor's input) give one StepEvidence each: a SHA-256
of the event's bytes as received and its envelope attributes. The state processor's StateVersion records (read
back from `state_versions`, co-partitioned with the inputs, a fetch at a time: ResumingApp.read_in_batches) drive
the contract fold (processors.contracts.fold), which publishes ContractCheck records and `contract` RewardSignals.

Crash safety, per batch of versions: the outputs are published and acked first, then each changed session's fold
record goes to the changelog (acked), then to the local table. A kill -9 before the record is acked redoes the
batch with the same outputs (same ids, so ClickHouse and the step assembler keep one of each); after it, the
versions are recognised by ordinal and skipped. Contracts are loaded before the first version is folded, and
refreshed every few seconds; a step uses the contracts effective at its dispatch's event time.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

import faust

from processors.contracts.fold import ContractBook, SessionContracts, check_records, contract_signal, fold
from streams.runtime import table_writes
from streams.runtime.faust_transport import ResumingApp
from streams.runtime.processor import InputEvent, ProcessingContext
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.contract_registry import ContractRegistry
from topics.contracts import ContractError, WorldCache
from topics.names import CONTRACT_CHECK, DISPATCH, REWARD, STATE_VERSION, STEP_EVIDENCE, TOOL_RESULT
from topics.settings import Settings

log = logging.getLogger(__name__)

_REFRESH_S = 5.0


def evidence_record(event: InputEvent) -> dict[str, Any]:
    """The StepEvidence of one dispatch or tool result: the hash of its value bytes as they arrived."""
    env = event.record["envelope"]
    value = event.source.value or b""
    return {
        "event_id": env["event_id"],
        "session_id": env["session_id"],
        "episode_id": env["episode_id"],
        "logical_event_id": env["logical_event_id"],
        "schema_name": event.schema_name,
        "tool": event.record.get("tool", ""),
        "sha256": hashlib.sha256(value).hexdigest(),
        "size_bytes": len(value),
        "attributes": dict(env.get("attributes") or {}),
        "event_time": env["event_time"],
    }


class ContractsProcessor:
    """Action contracts: pre/postcondition checks per step, a `contract` reward signal, and step provenance."""

    name = "contracts"
    kind = "reward_source"
    inputs = frozenset({DISPATCH, TOOL_RESULT})

    def __init__(self, book: ContractBook | None = None) -> None:
        self.book = book or ContractBook()
        self.worlds = WorldCache()  # each session's converted world, reused while it is unchanged
        self.app: faust.App | None = None
        self.ctx: ProcessingContext | None = None
        self.sessions: Any = None  # faust.Table[bytes, bytes]: SessionContracts per session
        self._loaded = asyncio.Event()
        self._attached = asyncio.Event()
        self._codec = AvroCodec()
        if book is not None:
            self._loaded.set()

    def setup(self, app: faust.App, settings: Settings) -> None:
        if not isinstance(app, ResumingApp):
            raise TypeError("the contracts processor reads StateVersions through the worker's app (build_pipeline)")
        self.app = app
        if "state" not in settings.processors:
            log.warning("the contracts processor checks steps against the state graph's versions, but the state "
                        "processor is not enabled: only step evidence will be written. Set "
                        "TREADLE_PROCESSORS=steps,state,contracts")  # fmt: skip
        self.sessions = table_writes.bytes_table(
            app, f"{self.name}-sessions", settings, help="Contract fold state per session (orjson)."
        )
        catalog = TopicCatalog(settings)
        registry = ContractRegistry(
            settings.kafka_bootstrap_servers, catalog["contracts"].name, catalog["node_types"].name
        )
        versions = app.topic(catalog["state_versions"].name, key_serializer="raw", value_serializer="raw")

        async def read_versions(messages: list[Any]) -> None:
            await self._attached.wait()
            await self._loaded.wait()
            assert self.ctx is not None
            await self.on_versions([(m.partition, m.value) for m in messages], self.ctx)

        app.read_in_batches(versions, read_versions)

        @app.task
        async def contracts_start() -> None:
            while not self._loaded.is_set():
                if not await self._refresh(registry):
                    await asyncio.sleep(1.0)

        @app.timer(interval=_REFRESH_S, name=f"{self.name}-refresh")
        async def contracts_refresh() -> None:
            await self._refresh(registry)

    def attach(self, ctx: ProcessingContext) -> None:
        self.ctx = ctx
        self._attached.set()

    async def _refresh(self, registry: ContractRegistry) -> bool:
        try:
            contracts = await registry.load()
        except Exception as exc:  # keep checking with what we have
            log.warning("could not load contracts from %s: %s", registry.topic, exc)
            return False
        before = len(self.book)
        for contract in contracts:
            try:
                self.book.add(contract)
            except ContractError as exc:  # registered by an older treadle that accepted it: skip it, loudly
                log.error("contract %s v%d cannot be used: %s", contract.name, contract.version, exc)
        if len(self.book) != before:
            log.info("contracts now known: %d version(s)", len(self.book))
        self._loaded.set()
        return True

    async def process(self, events: list[InputEvent], ctx: ProcessingContext) -> None:
        """Provenance: one StepEvidence per dispatch and tool result."""
        for event in events:
            await ctx.publish(STEP_EVIDENCE, evidence_record(event), key=event.session_key)

    async def on_versions(self, batch: list[tuple[int, bytes | None]], ctx: ProcessingContext) -> None:
        """Fold a batch of StateVersion records (see the module doc for the order of writes)."""
        assert self.app is not None
        changed: dict[bytes, tuple[int, SessionContracts]] = {}
        for partition, value in batch:
            if value is None:
                continue
            _, version = self._codec.decode(value, STATE_VERSION)
            key = version["session_id"].encode()
            known = changed.get(key)
            session = known[1] if known else SessionContracts.from_bytes(
                table_writes.get_in_partition(self.sessions, key, partition))  # fmt: skip
            checked = fold(session, version, self.book, self.worlds)
            changed[key] = (partition, session)
            if checked is None:
                continue
            for record in check_records(checked):
                await ctx.publish(CONTRACT_CHECK, record, key=key)
            signal = contract_signal(checked)
            if signal is not None:
                await ctx.publish(REWARD, signal, key=key)
        if not changed:
            return
        await self.app.producer.flush()  # the checks are on the broker before the fold state says they were made
        records = [(key, session.to_bytes(), partition) for key, (partition, session) in changed.items()]
        await table_writes.put_acked(self.sessions, records, ctx)
