"""The console's SQL on real chDB: both ways of building the sessions page agree, and LLM calls show when recorded.

Synthetic rows from the console bench's fill (bench.console_bench.fill_sql), in one chDB path for the module (chDB
allows one per process), read through run_sql as the console reads them with no worker running.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.console_bench import fill_sql
from sinks import migrations
from sinks.clickhouse import ClickHouseStore
from topics.settings import Settings
from treadle.console import queries
from treadle.console.params import SessionFilter
from treadle.console.queries import SqlReader

pytestmark = pytest.mark.integration

LLM_CALLS = """CREATE TABLE llm_calls (event_id String, session_id String, logical_event_id String,
    event_time DateTime64(6, 'UTC'), model LowCardinality(String), completion_text String,
    prompt_token_ids Array(UInt32)) ENGINE = MergeTree ORDER BY (session_id, event_id)"""


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SqlReader]:
    settings = Settings(home=tmp_path_factory.mktemp("console-queries"))
    with ClickHouseStore.open(settings) as store:
        migrations.apply_migrations(store)
        for statement in fill_sql(sessions=300, steps=4):
            store.command_sync(statement)
        yield SqlReader(settings)


@pytest.mark.parametrize(
    "f",
    [
        SessionFilter(),
        SessionFilter(sort="steps", order="asc", page=2, size=20),
        SessionFilter(agent="agent-3", policy="pv-1"),
        SessionFilter(q="bs-1", sort="session", order="asc"),
        SessionFilter(sort="started", page=4, size=100),
    ],
    ids=["default", "steps-page-2", "agent-policy", "search-prefix", "past-the-end"],
)
def test_the_fast_page_and_the_full_join_show_the_same_sessions(reader: SqlReader, f: SessionFilter) -> None:
    fast = queries.sessions(reader, f)
    query, params = queries.sessions_sql(f)
    full = reader.rows(query, **params)
    assert [r["session_id"] for r in fast.rows] == [r["session_id"] for r in full]
    for a, b in zip(fast.rows, full, strict=True):
        assert {k: a[k] for k in b if k != "total"} == {k: b[k] for k in b if k != "total"}
    assert fast.total == (
        full[0]["total"] if full else queries.sessions(reader, f.model_copy(update={"page": 1})).total
    )


def test_status_and_count_sorts_use_the_full_join(reader: SqlReader) -> None:
    ended = queries.sessions(reader, SessionFilter(status="ended", size=500))
    assert ended.total == 150 and {r["status"] for r in ended.rows} == {"ended"}  # every other session ended
    by_dead = queries.sessions(reader, SessionFilter(sort="dead_letters", order="desc", size=5))
    assert by_dead.rows[0]["dead_letters"] == max(r["dead_letters"] for r in by_dead.rows) >= 1


def test_llm_calls_show_only_when_the_table_exists(reader: SqlReader) -> None:
    assert queries.session_llm_calls(reader, "bs-1") is None
    with ClickHouseStore.open(reader.settings) as store:
        store.command_sync(LLM_CALLS)
        store.command_sync(
            "INSERT INTO llm_calls VALUES ('e1', 'bs-1', 'bl-4', now64(6), 'qwen', repeat('x', 500), [1, 2, 3])"
        )
        try:
            calls = queries.session_llm_calls(reader, "bs-1")
        finally:
            store.command_sync("DROP TABLE llm_calls")
    assert calls is not None and len(calls) == 1
    assert set(calls[0]) == {"logical_event_id", "event_time", "model", "completion_text"}  # no token ids
    assert calls[0]["completion_text"] == "x" * 120
