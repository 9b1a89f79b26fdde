"""The state graph as a Faust processor: the pure fold of processors/state/graph.py over RocksDB tables.

Tables (co-partitioned with the inputs): `state-sessions` holds one small commit record per session (its
SessionState, the ordinals its last commit made, and what that commit refused), `state-graph` its nodes,
edges, recent versions and TTL heap (processors/state/store.py).

Crash safety without transactions. A kill -9 can land between any two sends, and changelog records of
different tables (or keys) are not written atomically, so the session's commit record is the only truth:
per batch the processor (1) folds in memory, (2) writes the new versions' key (the write-ahead log) and
waits until everything sent so far is acked, (3) sends each changed session's commit record and waits for
its ack, then (4) writes the nodes, edges and TTLs and publishes the versions. After a restart the first
load of a session re-applies and re-publishes its last commit's versions from their keys (idempotent
downstream), so a crash in (4) loses nothing; a crash before (3) is acked leaves the previous commit, whose
inputs Kafka redelivers, and the next commit overwrites the orphaned version keys. Versions are published
only once committed, so a replay that decides differently never meets a published version it contradicts.
Redelivered events are recognised by seq (SessionState.heads), which is committed in the same record.

Early release. A timer notices sessions whose oldest buffered event waited `state_idle_flush_s` and sends a
flush request (with each topic's head) to the internal `<app id>-state-ticks` topic on the session's
partition; this processor's agent applies it under the same commit protocol. Being in the log, a flush
replays; its heads make it release on a replay exactly what it released the first time. Until the worker has
folded what the session's input partitions held when the wait began (their end offsets, asked of the broker at
the next sweep; a lagging worker), the wait is up to `state_idle_flush_max_s` instead: what the session waits for
is most likely among those records, and releasing early would make the versions depend on how far behind the
worker was.

Ending a session. SESSION_CLOSED/ARCHIVED ends a session once released (processors/state/graph.py). The
commit that ends it is acked first (its record, with `ended` set, is the marker), then its versions are
flushed, then every key of the session in `state-graph` gets a changelog tombstone, acked before the local
RocksDB entries go; every later commit of an ended session (and its first load after a restart) repeats
that purge of whatever keys are left, so a crash in between only delays it. What remains per ended session
is its small commit record: the marker that sends later events to dead letters ("session ... ended") and
recognises redeliveries. The session's Redis keys get an expiry of `state_ended_ttl_s`.

Latest state goes to Redis after every commit (StateCache); when the cache lost a session (a gap) or was wiped
(no epoch key, or one of an older layout), the timer rewrites the sessions this worker owns from the tables.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import faust
import orjson
from aiokafka import TopicPartition
from aiokafka.partitioner import murmur2

from processors.state.cache import StateCache, connect
from processors.state.graph import (
    ORDERED,
    STATE_INPUTS,
    EdgeRec,
    Flush,
    FoldConfig,
    FoldOutput,
    NodeRec,
    Rejected,
    SessionState,
    StateFold,
    apply_changes,
)
from processors.state.store import TableGraphStore, session_items, session_keys
from streams.runtime import table_writes
from streams.runtime.processor import InputEvent, ProcessingContext
from streams.runtime.value_limits import LIMIT_SETTING
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec, DeadLetterStage
from topics.dead_letters import dead_letter
from topics.names import DEAD_LETTER, STATE_DELTA, STATE_VERSION
from topics.node_types import NodeTypeRegistry, NodeTypes
from topics.settings import Settings

log = logging.getLogger(__name__)

_CACHED_SESSIONS = 4096  # decoded commit records kept in memory
_COMMIT_BYTES = 1024 * 1024  # commit a session mid-batch once its uncommitted versions are this large
# ... or this many: a commit's versions are re-published after a crash. Not tied to the rollback window: the
# window drops whole version keys after a commit, never those of the commit itself (TableGraphStore).
_COMMIT_VERSIONS = 4096


@dataclass
class _Work:
    """One session during a batch: its state, staged graph writes and what the commit will publish."""

    session: str
    partition: int
    state: SessionState
    store: TableGraphStore
    versions: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    replay: list[dict[str, Any]] = field(default_factory=list)  # the last commit's versions, re-published
    replay_rejected: list[Rejected] = field(default_factory=list)
    changed: bool = False
    size: int = 0

    def add(self, out: FoldOutput) -> None:
        self.changed = True
        self.versions += out.versions
        self.rejected += out.rejected
        changes = (c["next"] for v in out.versions for c in v["node_changes"])
        self.size += sum(100 + (len(c["data_json"]) if c else 0) for c in changes)

    def record(self) -> bytes:
        """The commit record: the fold state, and which outputs to re-publish after a crash."""
        made = [self.versions[0]["ordinal"], self.versions[-1]["ordinal"]] if self.versions else []
        return orjson.dumps({"state": self.state.to_dict(), "made": made, "rejected": self.rejected})


@dataclass(slots=True)
class _Wait:
    """A session whose oldest buffered event waits for its other topics: since when, and its ordered input
    partitions' end offsets then, asked of the broker at the next sweep (None until it answers): the worker folds up
    to those before a short wait ends. Asked, not taken from the last fetch: a partition not fetched yet, or paused
    by the input alignment, has no end offset there or an old one."""

    partition: int
    since: float
    oldest: str  # event id
    ends: list[int] | None = None


class StateProcessor:
    """Versioned state graph per session: StateVersion records, Redis latest state, ClickHouse history."""

    name = "state"
    kind = "core"
    inputs = frozenset(STATE_INPUTS)

    def __init__(self, config: FoldConfig | None = None, node_types: NodeTypes | None = None) -> None:
        self._config = config
        self.fold = StateFold(config)
        self.node_types = node_types or NodeTypes()
        self.settings: Settings | None = None
        self.app: faust.App | None = None
        self.ctx: ProcessingContext | None = None
        self.sessions: Any = None  # faust.Table[bytes, bytes]: commit records
        self.graph: Any = None  # faust.Table[bytes, bytes]: see processors/state/store.py
        self.cache: StateCache | None = None
        self._lock = asyncio.Lock()
        self._states: OrderedDict[str, SessionState] = OrderedDict()  # committed, decoded, LRU
        self._fresh: set[str] = set()  # sessions whose last commit was re-materialized in this assignment
        self._assigned: frozenset[Any] | None = None
        self._waiting: dict[str, _Wait] = {}
        self._scanned = False
        self._gaps: set[str] = set()
        self._codec = AvroCodec()
        self._delta_topic = ""
        self._ordered_topics: tuple[str, ...] = ()  # the topics whose seq heads release a session's buffer

    # -- wiring -----------------------------------------------------------------------------------

    def setup(self, app: faust.App, settings: Settings) -> None:
        self.settings, self.app = settings, app
        if self._config is None:
            self.fold = StateFold(
                FoldConfig(
                    auto_nodes=settings.state_auto_nodes,
                    max_buffer=settings.state_max_buffer,
                    max_nodes=settings.state_max_nodes,
                    history=settings.state_history,
                    max_value_bytes=settings.max_event_bytes,
                )
            )
        self.sessions = table_writes.bytes_table(
            app, f"{self.name}-sessions", settings, help="Commit record per session (orjson)."
        )
        self.graph = table_writes.bytes_table(
            app, f"{self.name}-graph", settings, help="Nodes, edges, versions, TTLs per session."
        )
        catalog = TopicCatalog(settings)
        self._delta_topic = catalog.for_schema(STATE_DELTA).name
        self._ordered_topics = tuple(sorted({catalog.for_schema(schema).name for schema in ORDERED}))
        ticks = app.topic(
            f"{settings.app_id}-state-ticks",
            key_serializer="raw",
            value_serializer="raw",
            partitions=settings.partitions,
            internal=True,
        )
        node_registry = NodeTypeRegistry(settings.kafka_bootstrap_servers, catalog["node_types"].name)

        @app.agent(ticks, name=f"{self.name}-ticks")
        async def state_ticks(stream: faust.StreamT) -> None:
            async for event in stream.events():
                if self.ctx is not None:
                    await self.on_tick(orjson.loads(event.value), event.message.partition, self.ctx)

        @app.task
        async def state_start() -> None:
            self.cache = StateCache(connect(settings), settings.topic_prefix)
            await self._refresh_node_types(node_registry)

        @app.timer(interval=10.0, name=f"{self.name}-node-types")
        async def state_node_types() -> None:
            await self._refresh_node_types(node_registry)

        @app.timer(interval=max(0.1, settings.state_idle_flush_s / 4), name=f"{self.name}-sweep")
        async def state_sweep() -> None:
            if self.ctx is None:
                return
            try:
                await self.sweep(ticks, self.ctx)
            except Exception:
                log.exception("state sweep failed")

    def attach(self, ctx: ProcessingContext) -> None:
        self.ctx = ctx

    async def _refresh_node_types(self, registry: NodeTypeRegistry) -> None:
        try:
            self.node_types = await registry.load()
        except Exception as exc:  # keep validating with what we have
            log.warning("could not load node types: %s", exc)

    # -- input ------------------------------------------------------------------------------------

    def problem(self, schema_name: str, record: dict[str, Any]) -> str | None:
        """Why a delta cannot be applied whatever the state (checked before it is buffered), or None."""
        if schema_name != STATE_DELTA:
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
        """Fold a batch session by session, then commit every changed session (see the module doc)."""
        async with self._lock:
            self._check_assignment()
            works: dict[str, _Work] = {}
            try:
                for event in events:
                    session = event.record["envelope"]["session_id"]
                    work = works.get(session)
                    if work is None:
                        work = works[session] = self._open(session, event.source.partition)
                    problem = self.problem(event.schema_name, event.record)
                    out = self.fold.accept(
                        work.state, work.store, event.schema_name, event.record, apply=problem is None
                    )
                    if out.duplicate:
                        continue
                    work.add(out)
                    if problem is not None:
                        await ctx.failed(self.name, event, ValueError(problem))
                    if work.size > _COMMIT_BYTES or len(work.versions) >= _COMMIT_VERSIONS:
                        await self._commit([work], ctx)
                        works[session] = self._open(session, event.source.partition)
                await self._commit(list(works.values()), ctx)
            except BaseException:
                self._forget()  # the in-memory states may hold uncommitted changes
                raise
            for work in works.values():
                self._track(work)

    async def on_tick(self, tick: dict[str, Any], partition: int, ctx: ProcessingContext) -> None:
        """A decided flush for one session, in the session's partition."""
        async with self._lock:
            self._check_assignment()
            try:
                work = self._open(tick["session"], partition)
                request = Flush(int(tick["upto"]), {k: int(v) for k, v in tick["seen"].items()})
                before = orjson.dumps(work.state.to_dict())
                out = self.fold.flush(work.state, work.store, request)
                if out.versions or out.rejected or orjson.dumps(work.state.to_dict()) != before:
                    work.add(out)
                await self._commit([work], ctx)
            except BaseException:
                self._forget()
                raise
            self._track(work)

    # -- sessions and commits ---------------------------------------------------------------------

    def _open(self, session: str, partition: int) -> _Work:
        """The session's committed state; on its first load here, its last commit is re-materialized."""
        store = TableGraphStore(self.graph, partition)
        state = self._states.get(session)
        if state is not None and session in self._fresh:
            self._states.move_to_end(session)
            return _Work(session, partition, state, store)
        raw = _read(self.sessions, partition, session.encode())
        work = _Work(session, partition, SessionState(session), store)
        if raw is not None:
            record = orjson.loads(raw)
            work.state = SessionState.from_dict(record["state"])
            if record["made"]:  # their keys were acked before the record: re-apply them, a crash may have lost that
                first, last = record["made"]
                work.replay = [v for o in range(first, last + 1) if (v := store.get_version(session, o)) is not None]
            work.replay_rejected = [tuple(r) for r in record["rejected"]]  # type: ignore[misc]
            for version in work.replay:
                apply_changes(store, version)
            _merge_expiries(store, session, work.replay)
        self._remember(session, work.state)
        self._fresh.add(session)
        return work

    async def _commit(self, works: list[_Work], ctx: ProcessingContext) -> None:
        assert self.app is not None
        changed = [w for w in works if w.changed]
        if changed:
            for work in changed:
                await work.store.materialize(ctx, versions_only=True)  # the write-ahead log of this commit
            await self.app.producer.flush()  # those, and earlier graph writes and outputs, are on the broker
            records = [(w.session.encode(), w.record(), w.partition) for w in changed]
            await table_writes.put_acked(self.sessions, records, ctx)  # committed
            for work in changed:
                self._remember(work.session, work.state)
        versions: list[dict[str, Any]] = []
        for work in works:
            await work.store.materialize(ctx)
            key = work.session.encode()
            for version in [*work.replay, *work.versions]:
                await ctx.publish(STATE_VERSION, version, key=key)
            for schema_name, record, reason in [*work.replay_rejected, *work.rejected]:
                await ctx.publish(DEAD_LETTER, self._dead_letter(schema_name, record, reason), key=key)
            for schema_name, _, reason in work.rejected:  # a replayed refusal was counted when it was first made
                ctx.metrics.dead_letters.labels(DeadLetterStage.PROCESS.value, schema_name).inc()
                if LIMIT_SETTING in reason:  # StateTooLargeError (processors.state.graph)
                    ctx.metrics.state_limit_refusals.labels(self.name).inc()
            versions += work.replay + work.versions
            work.replay, work.replay_rejected, work.versions, work.rejected = [], [], [], []
            work.changed, work.size = False, 0
        if self.cache is not None and versions:
            try:
                self._gaps |= await self.cache.apply_versions(versions)
            except Exception as exc:  # Redis down: the tables are the truth; rebuild when it is back
                log.warning("could not update the state cache: %s", exc)
                self._gaps |= {v["session_id"] for v in versions}
        for work in works:
            if work.state.ended is not None:
                await self._purge(work, ctx)

    async def _purge(self, work: _Work, ctx: ProcessingContext) -> None:
        """Delete an ended (committed) session's graph: tombstones acked first, then the local entries."""
        assert self.app is not None and self.settings is not None
        self._waiting.pop(work.session, None)
        self._gaps.discard(work.session)
        keys = session_keys(self.graph, work.partition, work.session)
        if not keys:
            return  # purged already: the common case for a late event of an ended session
        await self.app.producer.flush()  # the session's versions and dead letters are out before its keys go
        topic = self.graph.changelog_topic.get_topic_name()
        for key in keys:
            await ctx.send(topic, key, None, partition=work.partition)
        await self.app.producer.flush()
        for key in keys:
            table_writes.delete_local(self.graph, key, work.partition)
        log.info("state of ended session %s dropped (%d keys)", work.session, len(keys))
        if self.cache is not None:
            try:
                await self.cache.expire(work.session, self.settings.state_ended_ttl_s)
            except Exception as exc:
                log.warning("could not expire the cached state of %s: %s", work.session, exc)

    def _remember(self, session: str, state: SessionState) -> None:
        self._states[session] = state
        self._states.move_to_end(session)
        while len(self._states) > _CACHED_SESSIONS:
            evicted, _ = self._states.popitem(last=False)
            self._fresh.discard(evicted)

    def _forget(self) -> None:
        self._states.clear()
        self._fresh.clear()

    def _check_assignment(self) -> None:
        """After a rebalance, sessions may have been changed elsewhere: reload them from the tables."""
        assert self.app is not None
        assignment = frozenset(self.app.consumer.assignment())
        if assignment != self._assigned:
            self._assigned = assignment
            self._forget()
            self._waiting.clear()
            self._scanned = False

    def _track(self, work: _Work) -> None:
        buffer = work.state.buffer
        if not buffer:
            self._waiting.pop(work.session, None)
            return
        known = self._waiting.get(work.session)
        oldest = buffer[0].event_id
        if known is None or known.oldest != oldest:
            self._waiting[work.session] = _Wait(work.partition, time.monotonic(), oldest)

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

    # -- early release and cache repair -----------------------------------------------------------

    async def sweep(self, ticks: faust.TopicT, ctx: ProcessingContext) -> None:
        """Request flushes for sessions that waited too long; repair the Redis cache."""
        assert self.settings is not None and self.app is not None
        if not self.app.tables.actives_ready:
            return  # recovering: the tables are not complete yet
        unasked = [w for w in self._waiting.values() if w.ends is None]
        long_wait = self.settings.state_idle_flush_max_s > self.settings.state_idle_flush_s
        if unasked and long_wait and hasattr(self.app.consumer, "folded_to"):
            await self._ask_ends(unasked)  # outside the lock: the fold goes on meanwhile
        async with self._lock:
            self._check_assignment()
            if not self._scanned:
                self._scan_waiting()
            now = time.monotonic()
            due = {}
            for session, wait in self._waiting.items():
                kind = self._flush_due(now - wait.since, wait)
                if kind is not None:
                    due[session] = kind
                    ctx.metrics.state_flushes.labels(kind).inc()
            self._warn_long_waits(sum(kind == "long" for kind in due.values()))
            requests = []
            for session in due:
                partition = self._waiting.pop(session).partition
                work = self._open(session, partition)
                await self._commit([work], ctx)  # a session restored after a crash: its last commit again
                request = self.fold.flush_request(work.state)
                if request is not None:
                    requests.append((session, partition, request))
            ctx.metrics.state_waiting.set(len(self._waiting))
        for session, partition, request in requests:
            value = orjson.dumps({"session": session, "upto": request.upto, "seen": request.seen})
            await ticks.send(key=session.encode(), value=value, partition=partition)
        if self.cache is None:
            return
        try:
            wiped = not await self.cache.filled()
        except Exception:
            return
        if wiped or self._gaps:
            await self._rebuild_cache(None if wiped else set(self._gaps), ctx)

    def _flush_due(self, waited_s: float, wait: _Wait) -> str | None:
        """Whether a session that waited `waited_s` for its other topics is flushed now: "short" after
        `state_idle_flush_s` once this worker folded what its ordered input partitions held then (`wait.ends`;
        what the session waits for was not among it), "long" after `state_idle_flush_max_s` (a lagging worker)."""
        assert self.settings is not None and self.app is not None
        if waited_s < self.settings.state_idle_flush_s:
            return None
        if waited_s >= self.settings.state_idle_flush_max_s:
            return "long"
        consumer = self.app.consumer
        if not hasattr(consumer, "folded_to"):
            return "short"
        if wait.ends is None:
            return None  # not known yet: the next sweep asks the broker again
        for topic, end in zip(self._ordered_topics, wait.ends, strict=True):
            folded = consumer.folded_to(TopicPartition(topic, wait.partition))
            if folded is None or folded < end:
                return None
        return "short"

    async def _ask_ends(self, waits: list[_Wait]) -> None:
        """Fill in the end offsets of `waits` (one ListOffsets request); left unknown if the broker does not
        answer, so those sessions wait until `state_idle_flush_max_s` at most."""
        assert self.app is not None
        tps = {TopicPartition(t, w.partition) for w in waits for t in self._ordered_topics}
        try:
            ends = await self.app.consumer.highwaters(*tps)
        except Exception as exc:
            log.warning("state: could not ask the broker for the input partitions' end offsets (%s); sessions waiting "
                        "for their other topics are applied after TREADLE_STATE_IDLE_FLUSH_MAX_S until it answers",
                        exc)  # fmt: skip
            return
        for wait in waits:
            known = [ends.get(TopicPartition(t, wait.partition)) for t in self._ordered_topics]
            if None not in known:
                wait.ends = known

    def _warn_long_waits(self, sessions: int) -> None:
        """One line per sweep, when sessions were flushed at the long wait: the worker is that far behind."""
        if not sessions:
            return
        assert self.settings is not None
        log.warning("state: %d session(s) applied after waiting TREADLE_STATE_IDLE_FLUSH_MAX_S=%gs while this worker "
                    "had not yet folded what their input partitions held; events of theirs still unread will be "
                    "applied late (flagged `late`). The worker lags: add workers (up to TREADLE_PARTITIONS=%d) or "
                    "raise TREADLE_STATE_IDLE_FLUSH_MAX_S.", sessions, self.settings.state_idle_flush_max_s,
                    self.settings.partitions)  # fmt: skip

    def _scan_waiting(self) -> None:
        """Find sessions restored from the changelog with a waiting buffer (after a restart or rebalance)."""
        assert self.settings is not None
        for key, raw in self.sessions.data.items():
            state = SessionState.from_dict(orjson.loads(raw)["state"])
            if state.buffer and state.session_id not in self._waiting:
                partition = (murmur2(key) & 0x7FFFFFFF) % self.settings.partitions  # Kafka's default partitioner
                self._waiting[state.session_id] = _Wait(partition, time.monotonic(), state.buffer[0].event_id)
        self._scanned = True

    async def _rebuild_cache(self, only: set[str] | None, ctx: ProcessingContext) -> None:
        """Rewrite cached sessions from the local tables (every owned session when `only` is None)."""
        assert self.settings is not None and self.cache is not None
        async with self._lock:
            self._check_assignment()
            sessions = [k.decode() for k in self.sessions.data]
            if only is not None:
                sessions = [s for s in sessions if s in only]
            for session in sessions:
                partition = (murmur2(session.encode()) & 0x7FFFFFFF) % self.settings.partitions
                work = self._open(session, partition)
                await self._commit([work], ctx)  # re-materializes (and re-publishes) a restored last commit
                if work.state.ended is not None:
                    continue  # its graph is gone; so is (or soon will be) its cached state
                nodes = [(n, NodeRec.from_dict(orjson.loads(v))) for n, v in session_items(self.graph, partition,
                         session, "n")]  # fmt: skip
                edges = []
                for suffix, value in session_items(self.graph, partition, session, "e"):
                    src, dst, kind = suffix.split("\0")
                    edges.append(((src, dst, kind), EdgeRec.from_dict(orjson.loads(value))))
                state = work.state
                meta = {"ordinal": state.ordinal, "version_id": state.version_id, "time": state.time,
                        "node_count": state.node_count, "edge_count": state.edge_count}  # fmt: skip
                await self.cache.write_snapshot(session, meta, nodes, edges)
            if only is None:
                await self.cache.mark_filled()
            self._gaps -= set(sessions) if only is not None else set(self._gaps)
            log.info("state cache rebuilt for %d session(s)", len(sessions))


def _read(table: Any, partition: int, key: bytes) -> bytes | None:
    return table.data._db_for_partition(partition).get(key)


def _merge_expiries(store: TableGraphStore, session: str, versions: list[dict[str, Any]]) -> None:
    """Add the TTLs a re-materialized commit set (the stored heap may predate it; stale entries are skipped)."""
    fresh = [(c["next"]["expires_at"], c["node_id"]) for v in versions for c in v["node_changes"]
             if c["next"] and c["next"]["expires_at"]]  # fmt: skip
    if fresh:
        heap = store.get_expiries(session)
        for entry in fresh:
            if entry not in heap:
                heapq.heappush(heap, entry)
