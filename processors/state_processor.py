"""The state graph as a Faust processor: the pure fold of processors/state_graph.py over RocksDB tables.

Tables (all co-partitioned with the inputs, keyed by session_id first): `state-sessions` (SessionState:
version, reorder buffer, undo window, TTL heap), `state-nodes` / `state-edges` (one key per node / edge),
`state-events` (applied event ids, and the versions each input or tick produced, so a replayed duplicate
re-emits exactly what was lost in a crash).

Idle flush: a timer notices sessions whose reorder buffer has waited `state_idle_flush_s`, and sends a tick
to the internal `<app id>-state-ticks` topic on the session's partition; this processor's own agent
applies the tick inside a stream event, so table writes land in the right changelog partition and the flush
decision itself is in the log (a replayed tick releases no more than it did the first time: `upto` seq).

Latest state goes to Redis after every version (streams/state_cache.py); when the cache lost a session (a
gap) or was wiped (no epoch key), the timer rewrites the sessions this worker owns from the tables.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Any, Protocol

import faust
import orjson
from aiokafka.partitioner import murmur2
from faust.streams import _current_event

from processors.base import InputEvent, ProcessingContext
from processors.dead_letters import dead_letter
from processors.state_graph import (
    DELTA,
    STATE_INPUTS,
    STATE_VERSION,
    EdgeKey,
    EdgeRec,
    FoldConfig,
    FoldOutput,
    NodeRec,
    SessionState,
    StateFold,
)
from streams.settings import Settings
from streams.state_cache import StateCache, connect
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec, DeadLetterStage
from topics.ids import uuid7
from topics.node_types import NodeTypeRegistry, NodeTypes

log = logging.getLogger(__name__)

DEAD_LETTER = "treadle.derived.DeadLetter"
_SEP = b"\x00"
_SCAN_EVERY_S = 5.0


def _k(*parts: str) -> bytes:
    return _SEP.join(p.encode() for p in parts)


class FaustStore:
    """GraphStore over Faust tables; writes must happen inside a stream event of the session's partition."""

    def __init__(self, nodes: Any, edges: Any, events: Any) -> None:
        self.nodes, self.edges, self.events = nodes, edges, events

    def get_node(self, session: str, node_id: str) -> NodeRec | None:
        raw = self.nodes.get(_k(session, node_id))
        return None if raw is None else NodeRec.from_dict(orjson.loads(raw))

    def put_node(self, session: str, node_id: str, rec: NodeRec | None) -> None:
        key = _k(session, node_id)
        if rec is None:
            self.nodes.pop(key, None)
        else:
            self.nodes[key] = orjson.dumps(rec.to_dict())

    def get_edge(self, session: str, key: EdgeKey) -> EdgeRec | None:
        raw = self.edges.get(_k(session, *key))
        return None if raw is None else EdgeRec.from_dict(orjson.loads(raw))

    def put_edge(self, session: str, key: EdgeKey, rec: EdgeRec | None) -> None:
        table_key = _k(session, *key)
        if rec is None:
            self.edges.pop(table_key, None)
        else:
            self.edges[table_key] = orjson.dumps(rec.to_dict())

    def get_event(self, session: str, event_id: str) -> list[dict[str, Any]] | None:
        raw = self.events.get(_k(session, event_id))
        return None if raw is None else orjson.loads(raw)

    def put_event(self, session: str, event_id: str, outputs: list[dict[str, Any]]) -> None:
        self.events[_k(session, event_id)] = orjson.dumps(outputs)

    def outputs_of(self, session: str, trigger: str) -> list[dict[str, Any]] | None:
        raw = self.events.get(_k(session, "out:" + trigger))
        return None if raw is None else orjson.loads(raw)

    def set_outputs(self, session: str, trigger: str, versions: list[dict[str, Any]]) -> None:
        self.events[_k(session, "out:" + trigger)] = orjson.dumps(versions)


class _Publisher(Protocol):
    async def publish(self, schema_name: str, record: dict[str, Any], key: bytes | None) -> None: ...


class _TopicPublisher:
    """Publishing for records made outside the intake agent (ticks): encode, send, await the acks."""

    def __init__(self, app: faust.App, catalog: TopicCatalog, codec: AvroCodec) -> None:
        self.app, self.codec = app, codec
        self.topics = {schema: catalog.for_schema(schema).name for schema in (STATE_VERSION, DEAD_LETTER)}
        self._sends: list[Any] = []

    async def publish(self, schema_name: str, record: dict[str, Any], key: bytes | None) -> None:
        value = self.codec.encode(schema_name, record)
        self._sends.append(await self.app.producer.send(self.topics[schema_name], key, value, None, None, None))

    async def flush(self) -> None:
        sends, self._sends = self._sends, []
        if sends:
            await asyncio.gather(*sends)


class StateProcessor:
    name = "state"
    inputs = frozenset(STATE_INPUTS)

    def __init__(self, config: FoldConfig | None = None, node_types: NodeTypes | None = None) -> None:
        self._config = config
        self.fold = StateFold(config)
        self.node_types = node_types or NodeTypes()
        self.settings: Settings | None = None
        self.store: FaustStore | None = None
        self.sessions: Any = None
        self.cache: StateCache | None = None
        self._lock = asyncio.Lock()
        self._waiting: dict[str, tuple[int, float, int]] = {}  # session -> (partition, last activity, max seq)
        self._gaps: set[str] = set()
        self._last_scan = 0.0
        self._codec = AvroCodec()

    # -- wiring -----------------------------------------------------------------------------------

    def setup(self, app: faust.App, settings: Settings) -> None:
        self.settings = settings
        if self._config is None:
            self.fold = StateFold(
                FoldConfig(
                    auto_nodes=settings.state_auto_nodes,
                    max_buffer=settings.state_max_buffer,
                    max_nodes=settings.state_max_nodes,
                    history=settings.state_history,
                )
            )
        table = {"partitions": settings.partitions, "key_type": bytes, "value_type": bytes}  # raw, not JSON
        self.sessions = app.Table(f"{self.name}-sessions", help="SessionState per session (orjson).", **table)
        nodes = app.Table(f"{self.name}-nodes", help="Live node per session\\0node_id.", **table)
        edges = app.Table(f"{self.name}-edges", help="Live edge per session\\0src\\0dst\\0type.", **table)
        events = app.Table(f"{self.name}-events", help="Applied event ids and each trigger's versions.", **table)
        self.store = FaustStore(nodes, edges, events)
        catalog = TopicCatalog(settings)
        publisher = _TopicPublisher(app, catalog, self._codec)
        self._delta_topic = catalog.for_schema(DELTA).name
        ticks = app.topic(
            f"{settings.app_id}-state-ticks",
            key_serializer="raw",
            value_serializer="raw",
            partitions=settings.partitions,
            internal=True,
        )
        node_registry = NodeTypeRegistry(settings.kafka_bootstrap_servers, catalog["schemas"].name)

        @app.agent(ticks, name=f"{self.name}-ticks")
        async def state_ticks(stream: faust.StreamT) -> None:
            async for event in stream.events():
                _current_event.set(weakref.ref(event))  # table writes go to the tick's (= session's) partition
                try:
                    await self._on_tick(orjson.loads(event.value), publisher)
                    await publisher.flush()
                except Exception:  # a tick is an optimisation; the next one retries
                    log.exception("state tick failed")

        @app.task
        async def state_start() -> None:
            self.cache = StateCache(connect(settings), settings.topic_prefix)
            await self._refresh_node_types(node_registry)

        @app.timer(interval=10.0)
        async def state_node_types() -> None:
            await self._refresh_node_types(node_registry)

        @app.timer(interval=max(0.1, settings.state_idle_flush_s / 4))
        async def state_idle() -> None:
            try:
                await self._sweep(ticks)
            except Exception:
                log.exception("state sweep failed")

    async def _refresh_node_types(self, registry: NodeTypeRegistry) -> None:
        try:
            self.node_types = await registry.load()
        except Exception as exc:  # keep validating with what we have
            log.warning("could not load node types: %s", exc)

    # -- input ------------------------------------------------------------------------------------

    def problem(self, schema_name: str, record: dict[str, Any]) -> str | None:
        """Why a delta cannot be applied whatever the state (checked before it is buffered), or None."""
        if schema_name != DELTA:
            return None
        session = record["envelope"]["session_id"]
        for node in record.get("node_upserts") or []:
            try:
                data = orjson.loads(node.get("data_json") or "{}")
            except orjson.JSONDecodeError as exc:
                return f"node {node['id']!r}: data_json is not JSON: {exc}"
            if node.get("ttl_seconds") is not None and node["ttl_seconds"] <= 0:
                return f"node {node['id']!r}: ttl_seconds must be positive, got {node['ttl_seconds']}"
            problem = self.node_types.problem(node["type"], data)
            if problem is not None:
                return f"node {node['id']!r}: {problem}"
        for edge in [*(record.get("edge_upserts") or []), *(record.get("edge_deletes") or [])]:
            try:
                orjson.loads(edge.get("data_json") or "{}")
            except orjson.JSONDecodeError as exc:
                return f"edge {edge['src']}->{edge['dst']}: data_json is not JSON: {exc}"
        target = record.get("rollback_to")
        if target and not target.startswith(f"{session}."):
            return f"rollback_to {target!r} is not a version of session {session!r}"
        return None

    async def process(self, events: list[InputEvent], ctx: ProcessingContext) -> None:
        """Fold a batch session by session: each session's state is read and written once per batch."""
        assert self.store is not None
        by_session: dict[str, list[InputEvent]] = {}
        for event in events:
            by_session.setdefault(event.record["envelope"]["session_id"], []).append(event)
        async with self._lock:
            for session, mine in by_session.items():
                ctx.bind(mine[0])
                state = self._load(session)
                versions: list[dict[str, Any]] = []
                rejected: list[tuple[str, dict[str, Any], str]] = []
                changed = False
                for event in mine:
                    ctx.bind(event)
                    problem = self.problem(event.schema_name, event.record)
                    if problem is not None:
                        await ctx.failed(self.name, event, ValueError(problem))
                        continue
                    event_id = event.record["envelope"]["event_id"]
                    out = self.fold.accept(state, self.store, event.schema_name, event.record)
                    if out.duplicate:  # re-emit what it produced, in case a crash lost the first emission
                        versions += self.store.outputs_of(session, event_id) or []
                        continue
                    changed = True
                    self.store.set_outputs(session, event_id, out.versions)
                    versions += out.versions
                    rejected += out.rejected
                if changed:
                    self.sessions[session.encode()] = state.to_bytes()
                self._track(session, state, mine[0].source.partition)
                await self._emit(session, FoldOutput(versions, rejected), ctx)

    def _load(self, session: str) -> SessionState:
        raw = self.sessions.get(session.encode())
        return SessionState.from_bytes(raw) if raw is not None else SessionState(session)

    def _track(self, session: str, state: SessionState, partition: int) -> None:
        if state.buffer:
            self._waiting[session] = (partition, time.monotonic(), state.buffer[-1].seq)
        else:
            self._waiting.pop(session, None)

    async def _emit(self, session: str, out: FoldOutput, outputs: _Publisher) -> None:
        key = session.encode()
        for version in out.versions:
            await outputs.publish(STATE_VERSION, version, key=key)
        for schema_name, record, reason in out.rejected:
            await outputs.publish(DEAD_LETTER, self._dead_letter(schema_name, record, reason), key=key)
        if self.cache is not None and out.versions:
            try:
                self._gaps |= await self.cache.apply_versions(out.versions)
            except Exception as exc:  # Redis down: the tables are the truth; rebuild when it is back
                log.warning("could not update the state cache: %s", exc)
                self._gaps.add(session)

    def _dead_letter(self, schema_name: str, record: dict[str, Any], reason: str) -> dict[str, Any]:
        env = record["envelope"]
        letter = dead_letter(
            DeadLetterStage.PROCESS,
            f"processor {self.name}: {reason}",
            topic=self._delta_topic,
            partition=-1,
            offset=-1,
            key=env["session_id"].encode(),
            value=self._codec.encode(schema_name, record),
            timestamp_ms=env["event_time"] // 1000,
            schema_name=schema_name,
            record=record,
        )
        letter["dead_letter_id"] = f"state/{env['session_id']}/{env['event_id']}"
        return letter

    # -- idle flush and cache repair ----------------------------------------------------------------

    async def _sweep(self, ticks: faust.TopicT) -> None:
        assert self.settings is not None
        now = time.monotonic()
        if now - self._last_scan >= _SCAN_EVERY_S:
            self._last_scan = now
            self._scan_waiting()
        for session, (partition, last, upto) in list(self._waiting.items()):
            if now - last >= self.settings.state_idle_flush_s:
                self._waiting.pop(session, None)
                value = orjson.dumps({"session": session, "upto": upto, "id": uuid7()})
                await ticks.send(key=session.encode(), value=value, partition=partition)
        if self.cache is None:
            return
        try:
            wiped = not await self.cache.filled()
        except Exception:
            return
        if wiped or self._gaps:
            await self._rebuild_cache(None if wiped else set(self._gaps))

    async def _on_tick(self, tick: dict[str, Any], publisher: _TopicPublisher) -> None:
        assert self.store is not None
        session, tick_id = tick["session"], "tick:" + tick["id"]
        async with self._lock:
            stored = self.store.outputs_of(session, tick_id)
            if stored is not None:
                await self._emit(session, FoldOutput(stored, []), publisher)
                return
            state = self._load(session)
            out = self.fold.flush(state, self.store, upto_seq=int(tick["upto"]))
            self.sessions[session.encode()] = state.to_bytes()
            self.store.set_outputs(session, tick_id, out.versions)
            event = faust.current_event()
            self._track(session, state, event.message.partition if event is not None else 0)
            await self._emit(session, out, publisher)

    async def _rebuild_cache(self, only: set[str] | None) -> None:
        """Rewrite cached sessions from the local tables (every owned session when `only` is None)."""
        assert self.store is not None and self.cache is not None
        async with self._lock:
            # Read synchronously: no other coroutine runs until the snapshot is taken.
            states = {}
            for key, raw in self.sessions.items():
                session = key.decode()
                if only is None or session in only:
                    states[session] = SessionState.from_bytes(raw)
            nodes: dict[str, list[tuple[str, NodeRec]]] = {s: [] for s in states}
            edges: dict[str, list[tuple[EdgeKey, EdgeRec]]] = {s: [] for s in states}
            for key, raw in self.store.nodes.items():
                session, node_id = key.decode().split("\x00", 1)
                if session in nodes:
                    nodes[session].append((node_id, NodeRec.from_dict(orjson.loads(raw))))
            for key, raw in self.store.edges.items():
                session, src, dst, kind = key.decode().split("\x00")
                if session in edges:
                    edges[session].append(((src, dst, kind), EdgeRec.from_dict(orjson.loads(raw))))
            for session, state in states.items():
                meta = {
                    "ordinal": state.ordinal,
                    "version_id": state.version_id,
                    "time": state.time,
                    "node_count": state.node_count,
                    "edge_count": state.edge_count,
                }
                await self.cache.write_snapshot(session, meta, nodes[session], edges[session])
            if only is None:
                await self.cache.mark_filled()
            self._gaps -= set(states) if only is not None else set(self._gaps)
            log.info("state cache rebuilt for %d session(s)", len(states))

    def _scan_waiting(self) -> None:
        """Find sessions restored from the changelog with a waiting buffer (after a restart or rebalance)."""
        assert self.settings is not None
        for key, raw in self.sessions.items():
            session = key.decode()
            if session in self._waiting:
                continue
            state = SessionState.from_bytes(raw)
            if state.buffer:
                partition = (murmur2(key) & 0x7FFFFFFF) % self.settings.partitions  # Kafka's default partitioner
                self._waiting[session] = (partition, time.monotonic(), state.buffer[-1].seq)
