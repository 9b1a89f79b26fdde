"""The state graph end to end: real Kafka, a worker subprocess, chDB and Valkey.

Workloads come from tests/test_state_graph.py (random deltas, auto nodes, rollbacks, TTL, deletes), and are
sent with the three topics interleaved at random and duplicates; the state at every version, read back from
ClickHouse, and the latest state in Redis must equal the in-memory oracle. A closed session leaves the worker's
tables (tombstones in the changelog) and Redis, and keeps its history in ClickHouse.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import orjson
import pytest
import redis
from aiokafka import AIOKafkaConsumer, TopicPartition

from processors.state.cache import StateCache, connect, redis_url
from processors.state.graph import MemoryStore, SessionState, StateFold
from sinks.sql_client import run_sql
from streams.sdk.batching import default_partition
from tests.factories import published_versions, scrape, send_records, total, wait_for
from tests.integration.test_state_graph import arrival, build, delta, dispatch, env
from topics.names import DISPATCH, LIFECYCLE, STATE_DELTA
from topics.settings import Settings
from treadle import AgentStreamSync
from treadle.state.history import state_at

pytestmark = pytest.mark.integration


def random_ops(rng: random.Random, n: int) -> list[tuple]:
    ids = [f"n{i}" for i in range(6)]
    ops: list[tuple] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.5:
            ups = [(rng.choice(ids), rng.choice(["note", "doc"]), rng.randint(0, 3), rng.choice([None, None, 30]))
                   for _ in range(rng.randint(0, 3))]  # fmt: skip
            edges = [(rng.choice(ids), rng.choice(ids)) for _ in range(rng.randint(0, 2))]
            ops.append(("delta", ups, rng.sample(ids, rng.randint(0, 1)), edges, [], rng.random() < 0.5))
        elif r < 0.8:
            ops.append(("step", rng.choice(["search", "write"]), rng.random() < 0.8))
        elif r < 0.9:
            ops.append(("rollback", rng.randint(0, 5)))
        else:
            ops.append(("sleep", rng.randint(5, 40)))
    return ops


def version_rows(settings: Settings, session: str) -> list[list]:
    _, rows = run_sql(
        settings,
        f"SELECT ordinal, version_id FROM state_versions WHERE session_id = '{session}' ORDER BY ordinal, version_id",
    )
    return rows


def distinct_versions(settings: Settings, session: str) -> list[list]:
    _, rows = run_sql(
        settings,
        f"SELECT ordinal, version_id FROM state_versions_latest WHERE session_id = '{session}' ORDER BY ordinal",
    )
    return rows


def redis_state(settings: Settings, session: str, at_time: int):
    async def read():
        client = connect(settings)
        try:
            return await StateCache(client, settings.topic_prefix).read(session, now_micros=at_time)
        finally:
            await client.aclose()

    return asyncio.run(read())


def workloads(seed: int, sessions: int, ops: int, prefix: str):
    # Event time an hour ahead of the wall clock, taken when the test runs (not when the module is collected: a
    # long suite outlived a lead taken at import, and Valkey's HPEXPIREAT dropped TTL'd nodes the oracle still had).
    t0 = int(time.time() * 1_000_000) + 3_600_000_000
    rng = random.Random(seed)
    out = []
    for s in range(sessions):
        session = f"{prefix}-s{s}"
        events, oracle, ids = build(random_ops(rng, ops), 256, session=session, t0=t0)
        out.append((session, events, oracle, ids))
    return out


@pytest.fixture
def deployment(deployment: Settings) -> Settings:
    """conftest's deployment with the (opt-in) state-graph processor running beside the step assembler."""
    return deployment.model_copy(update={"processors": ("steps", "state")})


def redis_keys(settings: Settings) -> list[bytes]:
    client = redis.Redis.from_url(redis_url(settings))
    try:
        return list(client.scan_iter(f"{settings.topic_prefix}:state:*"))
    finally:
        client.close()


def test_state_at_every_version_matches_the_oracle_in_clickhouse_and_redis(deployment, worker_factory):
    worker = worker_factory().start()
    runs = workloads(11, 3, 40, deployment.topic_prefix)
    rng = random.Random(5)
    arrived = [e for _, events, _, _ in runs for e in arrival(events, rng, 0.1)]
    worker.wait_ready()
    asyncio.run(send_records(deployment, arrived))
    for session, _, oracle, ids in runs:
        expected = [[i, v] for i, v in enumerate(ids) if i > 0]
        wait_for(lambda s=session, e=expected: distinct_versions(deployment, s) == e, 90, f"versions of {session}")
        for ordinal in range(len(oracle.snapshots)):
            graph = state_at(deployment, session, ordinal)
            nodes, edges = graph.content()
            want_nodes, want_edges = oracle.view(ordinal)
            assert {k: (t, d) for k, (t, d) in nodes.items()} == want_nodes, f"{session} @ {ordinal}"
            assert set(edges) == want_edges, f"{session} @ {ordinal}"
        cached = redis_state(deployment, session, oracle.time)
        assert cached is not None and cached.version_id == ids[-1]
        assert cached.content()[0] == oracle.view(len(oracle.snapshots) - 1)[0]
        assert set(cached.content()[1]) == oracle.view(len(oracle.snapshots) - 1)[1]
        by_time = state_at(deployment, session, ids[-1])
        assert by_time.version_id == ids[-1]
    with AgentStreamSync(deployment, agent_id="reader", session_id=session) as stream:  # the sync facade reads too
        assert stream.state_at(ids[-1]).version_id == ids[-1] and stream.state().version_id == ids[-1]  # type: ignore[union-attr]

    # Redis wiped (this deployment's keys): the worker rebuilds the latest state from its tables.
    keys = redis_keys(deployment)
    assert keys
    client = redis.Redis.from_url(redis_url(deployment))
    client.delete(*keys)
    client.close()
    for session, _, oracle, ids in runs:
        wait_for(lambda s=session, o=oracle: redis_state(deployment, s, o.time), 30, f"{session} rebuilt in Redis")
        cached = redis_state(deployment, session, oracle.time)
        assert cached.version_id == ids[-1]
        assert cached.content()[0] == oracle.view(len(oracle.snapshots) - 1)[0]

    # transitions carry the versions before and after their action
    _, rows = run_sql(
        deployment,
        f"SELECT step, state_before, state_after FROM transitions_with_state WHERE session_id = '{runs[0][0]}' "
        "ORDER BY step",
    )
    assert rows and all(b.startswith(runs[0][0] + ".") and a.startswith(runs[0][0] + ".") for _, b, a in rows)
    assert all(int(b.split(".")[-2]) < int(a.split(".")[-2]) for _, b, a in rows)


def first_half_versions(events: list[tuple[str, dict]]) -> int:
    """Versions the events make once all are applied (the last ones by a flush)."""
    session = events[0][1]["envelope"]["session_id"]
    fold, state, store = StateFold(), SessionState(session), MemoryStore()
    made = sum(len(fold.accept(state, store, schema, record).versions) for schema, record in events)
    request = fold.flush_request(state)
    return made + (len(fold.flush(state, store, request).versions) if request else 0)


def split_at_seq(runs, fraction: float) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """Each session's events below a seq boundary, then the rest: whenever the worker flushes a session between
    the two halves, the second half is still above everything applied, so the oracle (seq order) holds."""
    first, second = [], []
    for _, events, _, _ in runs:
        cut = events[int(len(events) * fraction)][1]["envelope"]["seq"]
        first.append([e for e in events if e[1]["envelope"]["seq"] < cut])
        second.append([e for e in events if e[1]["envelope"]["seq"] >= cut])
    return first, second


@pytest.mark.parametrize("moment", ["busy", "after_flush"])
def test_kill_9_leaves_no_missing_or_duplicate_versions(deployment, worker_factory, moment):
    """kill -9 while the first half is being folded, or once its last events were released by an early flush
    (a tick in the log that the restarted worker may replay before the events it saw)."""
    runs = workloads(23, 4, 60, deployment.topic_prefix)
    first, second = split_at_seq(runs, 0.5)
    rng = random.Random(9)
    worker = worker_factory().start()
    worker.wait_ready()
    asyncio.run(send_records(deployment, [e for events in first for e in arrival(events, rng, 0.05)]))
    if moment == "busy":  # conditions, not sleeps: once some versions are in ClickHouse...
        wait_for(lambda: sum(len(distinct_versions(deployment, s)) for s, *_ in runs) > 20, 90, "some versions")
    else:  # ... or once every session's first half is, the last of it released by a flush
        halves = [first_half_versions(events) for events in first]
        for (session, *_), n in zip(runs, halves, strict=True):
            wait_for(lambda s=session, n=n: len(distinct_versions(deployment, s)) == n, 90, f"first half of {session}")
    worker.kill()
    asyncio.run(send_records(deployment, [e for events in second for e in arrival(events, rng, 0.05)]))
    worker_factory().start().wait_ready()
    for session, _, _, ids in runs:
        expected = [[i, v] for i, v in enumerate(ids) if i > 0]
        wait_for(
            lambda s=session, e=expected: distinct_versions(deployment, s) == e,
            120,
            f"versions of {session}",
            explain=lambda s=session, e=expected: f"have {distinct_versions(deployment, s)[-3:]}, want {e[-3:]}",
        )
        rows = version_rows(deployment, session)
        assert {tuple(r) for r in rows} == {tuple(r) for r in expected}  # no stray version from a divergent replay


def changelog_last(settings: Settings, table: str, prefix: bytes) -> dict[bytes, bytes | None]:
    """The last changelog record (None: a tombstone) of each key of a processor table that starts with prefix."""

    async def read() -> dict[bytes, bytes | None]:
        consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, enable_auto_commit=False)
        await consumer.start()
        try:
            topic = f"{settings.app_id}-{table}-changelog"
            tps = [TopicPartition(topic, p) for p in range(settings.partitions)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            end = await consumer.end_offsets(tps)
            remaining = {tp for tp in tps if end[tp] > 0}
            last: dict[bytes, bytes | None] = {}
            deadline = time.monotonic() + 30
            while remaining and time.monotonic() < deadline:
                for tp, messages in (await consumer.getmany(timeout_ms=500)).items():
                    for m in messages:
                        if m.key.startswith(prefix):
                            last[m.key] = m.value
                        if m.offset + 1 >= end[tp]:
                            remaining.discard(tp)
            assert not remaining, f"did not reach the end of {remaining}"
            return last
        finally:
            await consumer.stop()

    return asyncio.run(read())


def close_event(session: str, seq: int, t: int) -> tuple[str, dict]:
    record = {"envelope": env(seq, t, session=session), "kind": "SESSION_CLOSED", "done": True, "truncated": False,
              "reason": "done", "reward": None, "steps": None}  # fmt: skip
    return LIFECYCLE, record


def edge_rows(settings: Settings, session: str, edges: set[tuple]) -> dict[str, list]:
    """The interval rows behind edges a read got wrong, and the session's versions (what a failure needs)."""
    found: dict[str, list] = {"versions": version_rows(settings, session)}
    tables = (("state_edges", "from_ordinal, open_op"), ("state_edge_ends", "from_ordinal, to_ordinal, close_op"))
    for table, columns in tables:
        for src, dst, kind in sorted(edges):
            _, rows = run_sql(
                settings,
                f"SELECT '{src}', '{dst}', {columns} FROM {table} WHERE session_id = '{session}' "
                f"AND src = '{src}' AND dst = '{dst}' AND type = '{kind}' ORDER BY from_ordinal",
            )
            found.setdefault(table, []).extend(rows)
    return found


def dead_letter_reasons(settings: Settings, session: str) -> list[str]:
    _, rows = run_sql(settings, f"SELECT reason FROM dead_letters_latest WHERE session_id = '{session}'")
    return [r[0] for r in rows]


@pytest.mark.parametrize("crash", [False, True], ids=["clean", "kill_9"])
def test_a_closed_session_leaves_the_worker_and_redis_and_keeps_its_history(deployment, worker_factory, crash):
    """SESSION_CLOSED (sent before the session's last events arrive): every version is still made, then each of
    the session's keys in the state-graph table ends in a tombstone, its Redis keys expire, state_at still
    answers from ClickHouse and a later event goes to dead letters. kill_9: the worker dies once the versions are
    in ClickHouse and a restarted one recovers the tables without bringing the session back."""
    settings = deployment.model_copy(update={"state_ended_ttl_s": 2.0})
    (closed, events, oracle, ids), (still_open, open_events, _, open_ids) = workloads(31, 2, 30, settings.topic_prefix)
    last_seq = events[-1][1]["envelope"]["seq"]
    rng = random.Random(3)
    arrived = arrival(events, rng, 0.1)
    arrived.insert(len(arrived) - 4, close_event(closed, last_seq + 1, oracle.time))  # ahead of events below it
    worker = worker_factory(settings).start()
    worker.wait_ready()
    asyncio.run(send_records(settings, [*arrived, *arrival(open_events, rng, 0.1)]))
    for session, session_ids in ((closed, ids), (still_open, open_ids)):
        expected = [[i, v] for i, v in enumerate(session_ids) if i > 0]
        wait_for(lambda s=session, e=expected: distinct_versions(settings, s) == e, 90, f"versions of {session}")
    if crash:
        worker.kill()
        worker_factory(settings).start().wait_ready()

    prefix = f"{closed}\0".encode()

    def purged() -> bool:
        last = changelog_last(settings, "state-graph", prefix)
        return bool(last) and all(v is None for v in last.values())

    wait_for(purged, 60, f"tombstones for every key of {closed}")
    graph_keys = changelog_last(settings, "state-graph", prefix)
    assert any(k.startswith(prefix + b"n\0") for k in graph_keys) and any(b"\0v\0" in k for k in graph_keys)
    (marker,) = changelog_last(settings, "state-sessions", closed.encode()).values()
    state = orjson.loads(marker)["state"]
    assert state["z"] == last_seq + 1 and state["v"] == ids[-1] and state["b"] == []
    kept = changelog_last(settings, "state-graph", f"{still_open}\0".encode())
    assert any(v is not None for v in kept.values())  # an open session keeps its graph

    wait_for(lambda: redis_state(settings, closed, oracle.time) is None, 30, f"{closed} expired in Redis")
    assert redis_state(settings, still_open, oracle.time).version_id == open_ids[-1]

    def history_errors() -> list[str]:
        errors = []
        for ordinal in range(len(oracle.snapshots)):
            nodes, edges = state_at(settings, closed, ordinal).content()
            want_nodes, want_edges = oracle.view(ordinal)
            if {k: (t, d) for k, (t, d) in nodes.items()} != want_nodes:
                errors.append(f"nodes @ {ordinal}")
            if set(edges) != want_edges:
                errors.append(f"edges @ {ordinal}: {edge_rows(settings, closed, set(edges) ^ want_edges)}")
        return errors

    # History is untouched. kill_9: the killed sink may have inserted a flush's first tables and not the rest, and
    # not committed it; the restarted sink inserts it again (at least once) only once the group has dropped the
    # dead member (its session timeout), which can be after the checks above.
    wait_for(lambda: not history_errors(), 90, f"the history of {closed}", explain=lambda: "; ".join(history_errors()))

    after = delta(last_seq + 2, oracle.time, ups=[("late", "note", {"v": 1}, None)], session=closed)
    asyncio.run(send_records(settings, [(STATE_DELTA, after)]))
    wait_for(lambda: any("ended" in r for r in dead_letter_reasons(settings, closed)), 60, "a dead letter")
    refused = total(scrape(settings), "treadle_dead_letters_total", stage="PROCESS", schema=STATE_DELTA)
    assert refused >= 1  # the refusal is counted like any dead letter
    assert len(distinct_versions(settings, closed)) == len(ids) - 1
    assert changelog_last(settings, "state-graph", prefix) == graph_keys  # nothing written for it again


@pytest.mark.parametrize("long_wait_s", [30.0, 0.0], ids=["waits_while_behind", "long_wait_off"])
def test_a_lagging_worker_applies_a_backlog_in_seq_order(deployment, worker_factory, long_wait_s):
    """A session's dispatch (seq 0) is behind 3,000 other sessions' dispatches on its partition and its delta (seq 1)
    alone on the deltas partition, all in Kafka before the worker starts: the worker reads the delta about a second
    before the dispatch (batches of 500), past TREADLE_STATE_IDLE_FLUSH_S (0.2 s here). Since the dispatch was in
    Kafka when the delta began to wait, the delta waits until the worker folded that far (at most
    TREADLE_STATE_IDLE_FLUSH_MAX_S), so the versions are the in-order fold's, none late, whatever the worker's lag.
    With the long wait off (0 s, the rule before it existed) the delta is applied first and the dispatch late, the
    `long` flushes are counted and the worker says it lags."""
    settings = deployment.model_copy(
        update={"state_idle_flush_s": 0.2, "state_idle_flush_max_s": long_wait_s, "process_batch_size": 500}
    )
    prefix, partitions = settings.topic_prefix, settings.partitions
    target = f"{prefix}-lagging"
    partition = default_partition(target.encode(), partitions)
    names = (f"{prefix}-f{i}" for i in itertools.count())
    same = (n for n in names if default_partition(n.encode(), partitions) == partition)
    fillers = list(itertools.islice(same, 3_000))
    t0 = int(time.time() * 1_000_000)
    mine = [
        (DISPATCH, dispatch(0, t0 + len(fillers), f"{target}-step0", "write", session=target)),
        (STATE_DELTA, delta(1, t0 + len(fillers) + 1, ups=[("n0", "note", {"v": 1}, None)], session=target)),
    ]
    others = [(DISPATCH, dispatch(0, t0 + i, f"{f}-step0", "search", session=f)) for i, f in enumerate(fillers)]
    # The delta's record timestamp 1.5 s before the dispatches' (more than TREADLE_INPUT_MAX_SKEW_S): the input
    # alignment reads it first, whichever partition the worker's first fetches bring.
    asyncio.run(send_records(settings, mine[1:]))
    time.sleep(1.5)
    asyncio.run(send_records(settings, [*others, mine[0]]))
    worker = worker_factory(settings).start()
    worker.wait_ready()

    def published() -> dict[str, list[dict]] | None:
        chains = asyncio.run(published_versions(settings, [target, *fillers]))
        return chains if all(chains.values()) and len(chains[target]) == 2 else None

    chains = wait_for(published, 180, "every session's versions")
    got = chains[target]
    assert all(len(chains[f]) == 1 and not chains[f][0]["late"] for f in fillers)
    samples = scrape(settings)
    assert total(samples, "treadle_state_flushes_total", wait="short" if long_wait_s else "long") >= len(fillers)
    if not long_wait_s:
        assert [(v["ordinal"], v["seq"], v["late"]) for v in got] == [(1, 1, False), (2, 0, True)]
        assert "session(s) applied after waiting TREADLE_STATE_IDLE_FLUSH_MAX_S=0s" in worker.log_path.read_text()
        return
    fold, state, store = StateFold(), SessionState(target), MemoryStore()
    expected = [v for schema, record in mine for v in fold.accept(state, store, schema, record).versions]
    request = fold.flush_request(state)
    expected += fold.flush(state, store, request).versions if request else []
    assert [(v["ordinal"], v["seq"], v["late"]) for v in got] == [(1, 0, False), (2, 1, False)]
    assert [v["version_id"] for v in got] == [v["version_id"] for v in expected]
    assert total(samples, "treadle_state_flushes_total", wait="long") == 0


def test_a_session_with_an_unapplied_event_is_counted_as_waiting_until_its_idle_flush(deployment, worker_factory):
    """A lone dispatch waits for the session's other state topics to pass its seq: the session counts in
    treadle_state_waiting_sessions until TREADLE_STATE_IDLE_FLUSH_S (5 s here) applies it, then no longer."""
    settings = deployment.model_copy(update={"state_idle_flush_s": 5.0})
    session = f"{settings.topic_prefix}-waits"
    worker = worker_factory(settings).start()
    worker.wait_ready()

    def waiting() -> float:
        return total(scrape(settings), "treadle_state_waiting_sessions")

    assert waiting() == 0
    now = int(time.time() * 1_000_000)
    asyncio.run(send_records(settings, [(DISPATCH, dispatch(0, now, f"{session}-step0", "write", session=session))]))
    wait_for(lambda: waiting() == 1, 30, "the session counted as waiting", explain=lambda: f"gauge {waiting()}")
    chains = wait_for(lambda: asyncio.run(published_versions(settings, [session]))[session] or None, 60, "its version")
    assert [(v["ordinal"], v["seq"]) for v in chains] == [(1, 0)]
    wait_for(lambda: waiting() == 0, 30, "the session no longer counted", explain=lambda: f"gauge {waiting()}")
    assert total(scrape(settings), "treadle_state_flushes_total", wait="short") == 1
