"""Per-key table values stay below TREADLE_MAX_EVENT_BYTES (streams.runtime.value_limits): the credit, llm_judge and
state tables refuse the event that would pass it, as the step table does, and go on with the rest.

The fold-level test is pure (the state fold over its in-memory store); the end-to-end test runs a real broker, worker,
chDB and a judge endpoint on 127.0.0.1, with the limit lowered to 6,000 bytes so a few dozen small events reach it.
"""

from __future__ import annotations

import asyncio
import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processors.state.graph import FoldConfig, MemoryStore, SessionState, StateFold
from sinks.sql_client import run_sql
from streams.runtime.value_limits import ValueBudget
from tests.factories import BASE_TIME, dispatch, result, scrape, send_records, total, wait_for
from tests.integration.test_llm_judge import JudgeServer, judge_components
from tests.integration.test_state_graph import SESSION, T0, delta
from topics.ids import uuid7
from topics.names import STATE_DELTA
from topics.settings import Settings

LIMIT = 6_000

# -- the state fold (pure) ---------------------------------------------------------------------------------------------


def test_a_version_or_ttl_index_past_the_limit_is_refused_and_changes_nothing() -> None:
    fold = StateFold(FoldConfig(auto_nodes=False, max_value_bytes=3_000))
    state, store = SessionState(SESSION), MemoryStore()
    out = fold.accept(state, store, STATE_DELTA, delta(0, T0, ups=[("big", "doc", {"text": "x" * 4_000}, None)]))
    assert out.versions == [] and len(out.rejected) == 1
    reason = out.rejected[0][2]
    assert "past the 3,000-byte limit (TREADLE_MAX_EVENT_BYTES) of one state table value" in reason, reason
    assert store.nodes == {} and store.versions == {} and state.ordinal == 0

    # Ten nodes with a TTL per delta: the session's TTL index (one value) grows until a delta would pass the limit.
    accepted = refused = 0
    for seq in range(1, 30):
        ups = [(f"ttl-{seq:03d}-{n}", "note", {"v": n}, 60) for n in range(10)]
        out = fold.accept(state, store, STATE_DELTA, delta(seq, T0 + seq, ups=ups))
        if out.rejected:
            assert "TTL index would be" in out.rejected[0][2] and out.versions == []
            assert all((SESSION, node_id) not in store.nodes for node_id, *_ in ups)
            refused += 1
        else:
            accepted += 1
        assert len(orjson.dumps(store.expiries.get(SESSION, []))) <= 3_000
    assert accepted and refused
    out = fold.accept(state, store, STATE_DELTA, delta(40, T0 + 40, ups=[("plain", "note", {}, None)]))
    assert len(out.versions) == 1 and not out.rejected, "a delta without a TTL still folds"
    assert state.ordinal == accepted + 1


@settings(max_examples=200, deadline=None)
@given(st.integers(1_000, 100_000), st.lists(st.integers(0, 5_000), max_size=60))
def test_a_budget_asks_to_measure_before_its_bound_could_pass_the_limit(limit: int, events: list[int]) -> None:
    """Whatever the events, a value grown within the per-event bound without a measurement stays under the limit."""
    budget, true_size = ValueBudget(limit), 0
    for size in events:
        growth = 2 * size + 512  # the documented bound of one event's growth
        if budget.near(size):
            if true_size + growth > limit:
                continue  # refused: the value stays as it is
            true_size += growth
            budget.measured(true_size)
        else:
            true_size += growth
            budget.grew(size)
        assert true_size <= limit


# -- end to end ----------------------------------------------------------------------------------------------------


def limit_letters(settings: Settings, sessions: list[str]) -> dict[str, list[str]]:
    where = ", ".join(f"'{s}'" for s in sessions)
    _, rows = run_sql(
        settings,
        f"SELECT session_id, reason FROM dead_letters_latest WHERE session_id IN ({where}) "
        "AND position(reason, 'TREADLE_MAX_EVENT_BYTES') > 0",
    )
    out: dict[str, list[str]] = {}
    for session, reason in rows:
        out.setdefault(session, []).append(reason)
    return out


@pytest.mark.timeout(900)
def test_credit_llm_judge_and_state_refuse_the_event_that_would_pass_the_limit(
    deployment: Settings, worker_factory
) -> None:
    tag = uuid7()[-8:]
    credit_s, judge_s, state_s = f"lim-credit-{tag}", f"lim-judge-{tag}", f"lim-state-{tag}"
    # credit: one episode of 120 steps (its state keeps each dispatch's fields: past 6,000 bytes after a few dozen)
    credit_events = [("treadle.events.ActionDispatched", dispatch(credit_s, uuid7(), n, n + 1)) for n in range(120)]
    # llm_judge: a judged step keeps its dispatch and result as JSON; quotes in the params make it larger than the
    # step's Avro (which the step table counts), so only the judge's table passes the limit
    big, small = uuid7(), uuid7()
    quoted = json.dumps({"q": ["x"] * 450})
    judge_events = [
        ("treadle.events.ActionDispatched", dispatch(judge_s, big, 0, 1, params=quoted)),
        ("treadle.events.ToolResult", {**result(judge_s, big, 2), "output": "o" * 3_000}),
        ("treadle.events.ActionDispatched", dispatch(judge_s, small, 1, 3)),
        ("treadle.events.ToolResult", {**result(judge_s, small, 4), "output": "fine"}),
    ]
    # state: ten nodes with a TTL per delta, then one without
    t = BASE_TIME + 3_600_000_000 * 24 * 365 * 2  # far ahead: the TTLs are not due while the test runs
    state_events = [
        (STATE_DELTA, delta(seq, t + seq, ups=[(f"ttl-{seq:03d}-{n}", "note", {"v": n}, 86_400) for n in range(10)],
                            session=state_s))
        for seq in range(30)
    ]  # fmt: skip
    state_events.append((STATE_DELTA, delta(30, t + 30, ups=[("plain", "note", {}, None)], session=state_s)))

    with JudgeServer() as judge:
        settings = deployment.model_copy(
            update={"processors": ("steps", "state", "credit", "llm_judge"), "max_event_bytes": LIMIT,
                    "llm_judge_url": judge.url}
        )  # fmt: skip
        worker = worker_factory(settings).start()
        worker.wait_ready()
        asyncio.run(send_records(settings, credit_events + judge_events + state_events))

        sessions = [credit_s, judge_s, state_s]
        letters = wait_for(
            lambda: len(found := limit_letters(settings, sessions)) == 3 and found,
            180, "dead letters from credit, llm_judge and state", explain=worker.log_tail,
        )  # fmt: skip
        assert all("of one credit table value" in r for r in letters[credit_s]), letters[credit_s][:2]
        assert len(letters[judge_s]) == 1 and "judged step" in letters[judge_s][0]
        assert "of one llm_judge table value" in letters[judge_s][0]
        assert all("TTL index would be" in r for r in letters[state_s]), letters[state_s][:2]

        # The rest went on: the small step is judged, the big one is a transition without a judgement, the state
        # session's last delta made a version, and every credit dispatch is a transition.
        rows = wait_for(
            lambda: small in (found := judge_components(settings, judge_s)) and found[small]["judge"] and found,
            120, "the small step's judgement", explain=worker.log_tail,
        )  # fmt: skip
        assert rows[big]["judge"] == {}
        _, versions = run_sql(
            settings, f"SELECT max(node_count) FROM state_versions_latest WHERE session_id = '{state_s}'"
        )
        plain = run_sql(
            settings,
            f"SELECT count() FROM state_nodes_latest WHERE session_id = '{state_s}' AND node_id = 'plain'",
        )[1]
        assert plain == [[1]], plain
        assert versions[0][0] < 300, "the refused deltas' nodes are not in the state"
        _, steps = run_sql(settings, f"SELECT count() FROM transitions_latest WHERE session_id = '{credit_s}'")
        assert steps == [[120]]
        metrics = scrape(settings)
        for processor in ("credit", "llm_judge", "state"):
            assert total(metrics, "treadle_state_limit_refusals_total", processor=processor) >= 1, processor
        assert worker.proc is not None and worker.proc.poll() is None
