"""Sinks on a real chDB: migrations, row mappers, the batched writer, and the latest-revision views.

chDB allows one data path per process, so this module opens one path (module-scoped) and gives each test its
own database on it; every store is closed by the end of the module so other modules can open other paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from processors.evaluation import metric_record
from sinks import migrations
from sinks.chdb_insert import chdb_handle
from sinks.clickhouse import (
    ClickHouseStore,
    ClickHouseUnavailableError,
    checked_identifier,
    database_name,
)
from sinks.rejected_rows import RowSource
from sinks.rows import INPUT_SCHEMAS, ROW_FORMAT_REVISION, TABLE_COLUMNS, micros, rows_for
from sinks.sql_guard import ReadOnlyQueryError
from sinks.variants import VARIANT_TABLES
from sinks.writer import ClickHouseSink
from streams.runtime.metrics import SinkMetrics
from tests.paths import REPO_ROOT
from topics.catalog import TopicCatalog
from topics.settings import Settings

T0 = 1_760_000_000_000_000  # 2025-10-09, in microseconds
MONTH = 31 * 24 * 3600 * 1_000_000
VIEWS = ["raw_events_latest", "transitions_latest", "reward_components_latest", "woven_rewards_latest"]
VIEWS += ["dead_letters_latest", "evaluation_metrics_latest"]
# The state graph's migrations (0012, 0013): tables and views.
STATE_OBJECTS = {"state_versions", "state_nodes", "state_node_causes", "state_node_ends", "state_edges"}
STATE_OBJECTS |= {"state_edge_ends"}
STATE_OBJECTS |= {f"{table}_latest" for table in STATE_OBJECTS}
STATE_OBJECTS |= {"state_node_intervals", "state_edge_intervals", "transitions_with_state"}
_DATABASES = itertools.count()


# --- realistic records, as the codec decodes them (timestamps int micros, enums str) ----------------------------


def envelope(session: str, lid: str, seq: int, event_id: str, event_time: int) -> dict[str, Any]:
    return {
        "event_id": event_id,
        "session_id": session,
        "agent_id": "support-bot",
        "episode_id": f"{session}-ep1",
        "logical_event_id": lid,
        "seq": seq,
        "event_time": event_time,
        "policy_version": "pi-2025-10-01",
        "trace_id": f"trace-{lid}",
        "attributes": {"env": "staging", "region": "eu"},
    }


def action(session: str = "s-1", lid: str = "l-1", step: int = 0) -> dict[str, Any]:
    return {
        "envelope": envelope(session, lid, 1, f"0199c9a0-0000-7000-8000-{step:012d}", T0),
        "step": step,
        "tool": "search_orders",
        "params_json": '{"customer": "c-42", "limit": 5}',
        "deadline": T0 + 30_000_000,
    }


def tool_result(session: str = "s-1", lid: str = "l-1") -> dict[str, Any]:
    return {
        "envelope": envelope(session, lid, 2, "0199c9a0-0001-7000-8000-000000000001", T0 + 850_000),
        "tool": "search_orders",
        "status": "TIMEOUT",
        "output": "",
        "error": "deadline exceeded after 850 ms",
        "latency_ms": 850.25,
        "cost_usd": 0.0021,
        "tokens_in": 312,
        "tokens_out": 0,
        "retries": 2,
    }


def reward_signal(session: str = "s-1", lid: str = "l-1", event_id: str = "0199c9a0-0002-7000-8000-000000000001"):
    return {
        "envelope": envelope(session, lid, 3, event_id, T0 + 2_000_000),
        "source": "llm_judge",
        "name": "helpfulness",
        "value": -0.3,
        "confidence": 0.8,
        "annotator": "LLM",
        "evidence": "answer ignored the order id; see trace",
    }


def state_delta(session: str = "s-1", lid: str = "l-1") -> dict[str, Any]:
    return {
        "envelope": envelope(session, lid, 4, "0199c9a0-0003-7000-8000-000000000001", T0 + 900_000),
        "node_upserts": [{"id": "order:9", "type": "order", "data_json": '{"status": "open"}', "ttl_seconds": None}],
        "node_deletes": ["draft:1"],
        "edge_upserts": [{"src": "customer:42", "dst": "order:9", "type": "references", "data_json": "{}"}],
        "edge_deletes": [],
        "rollback_to": None,
    }


def state_version(session: str = "s-1") -> dict[str, Any]:
    """Version 2 of a session: it replaced order:9 (opened by version 1) and added an edge."""
    old = {"type": "order", "data_json": '{"status":"new"}', "from_ordinal": 1, "valid_from": T0, "expires_at": None}
    new = {**old, "data_json": '{"status":"open"}', "from_ordinal": 2, "valid_from": T0 + 900_000}
    return {
        "session_id": session, "version_id": f"{session}.2.00ff", "parent_id": f"{session}.1.00aa", "ordinal": 2,
        "kind": "delta", "event_id": "0199c9a0-0003-7000-8000-000000000001", "seq": 4, "logical_event_id": "l-1",
        "episode_id": "ep-1", "tool": None, "step": None, "event_time": T0 + 900_000, "rollback_to": None,
        "late": False, "node_count": 1, "edge_count": 1,
        "node_changes": [{"node_id": "order:9", "op": "upsert", "prev": {**old, "caused_by_tool": ""},
                          "next": {**new, "caused_by_tool": ""}}],
        "edge_changes": [{"src": "customer:42", "dst": "order:9", "type": "references", "op": "upsert", "prev": None,
                          "next": {"data_json": "{}", "from_ordinal": 2, "valid_from": T0 + 900_000}}],
    }  # fmt: skip


def lifecycle(session: str = "s-1") -> dict[str, Any]:
    return {
        "envelope": envelope(session, "", 5, "0199c9a0-0004-7000-8000-000000000001", T0 + 3_000_000),
        "kind": "EPISODE_ENDED",
        "done": True,
        "truncated": False,
        "reason": "customer satisfied",
    }


def component(event_id: str, value: float, event_time: int = T0 + 2_000_000, source: str = "llm_judge"):
    return {
        "event_id": event_id,
        "source": source,
        "name": "helpfulness",
        "value": value,
        "confidence": 0.8,
        "weight": 1.0,
        "annotator": "LLM",
        "event_time": event_time,
    }


def transition(
    revision: int, session: str = "s-1", step: int = 0, lid: str = "l-1", dispatched_at: int = T0
) -> dict[str, Any]:
    """Revision 1: dispatch only; 2: tool result; 3 and up: that many minus 2 reward components."""
    components = [component(f"r-{i}", -0.3 + i) for i in range(max(0, revision - 2))]
    has_result = revision >= 2
    return {
        "session_id": session,
        "step": step,
        "logical_event_id": lid,
        "revision": revision,
        "agent_id": "support-bot",
        "episode_id": f"{session}-ep1",
        "trace_id": f"trace-{lid}",
        "policy_version": "pi-2025-10-01",
        "tool": "search_orders",
        "params_json": '{"customer": "c-42"}',
        "dispatched_at": dispatched_at,
        "tool_status": "OK" if has_result else None,
        "output": '{"orders": [9]}' if has_result else None,
        "error": None,
        "latency_ms": 120.5 if has_result else None,
        "cost_usd": 0.002 if has_result else 0.0,
        "tokens_in": 300 if has_result else 0,
        "tokens_out": 40 if has_result else 0,
        "result_at": dispatched_at + 120_500 if has_result else None,
        "reward": sum(c["value"] for c in components) / len(components) if components else None,
        "reward_status": "complete" if components else "pending",
        "reward_revision": len(components),
        "reward_components": components,
        "updated_at": dispatched_at + revision * 1_000_000,
    }


def woven(revision: int, session: str = "s-1", lid: str = "l-1", woven_at: int = T0) -> dict[str, Any]:
    components = [component(f"r-{i}", float(i)) for i in range(revision)]
    return {
        "logical_event_id": lid,
        "session_id": session,
        "episode_id": f"{session}-ep1",
        "step": 0 if revision > 1 else -1,
        "revision": revision,
        "value": float(revision * 10),
        "status": "complete" if revision >= 2 else "partial",
        "fusion": "confidence_weighted_mean",
        "policy_version": "rp-1",
        "components": components,
        "woven_at": woven_at,
    }


def dead_letter(offset: int = 17) -> dict[str, Any]:
    return {
        "dead_letter_id": f"treadle.actions:2:{offset}",
        "stage": "DECODE",
        "reason": "not Avro single-object encoding (expected marker C3 01 and an 8-byte schema fingerprint)",
        "topic": "treadle.actions",
        "partition": 2,
        "offset": offset,
        "key": b"s-1",
        "value": b"\x00\xffgarbage\xc3",
        "event_id": None,
        "session_id": "s-1",
        "schema_name": None,
        "failed_at": T0 + 5_000_000,
    }


def evaluation_metric(rule: str = "email", value: float = 1.0, evidence: str | None = "j***@example.com"):
    metric = "pii_leak" if rule == "any_pii" else "safety_alert"
    return metric_record("safety", metric, rule, value, "medium", tool_result(), evidence)


INPUT_RECORDS = {
    "actions": action(),
    "tool_results": tool_result(),
    "rewards": reward_signal(),
    "state_deltas": state_delta(),
    "lifecycle": lifecycle(),
}


# --- fixtures -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chdb_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """Settings whose chdb_path is this module's one chDB data path, kept open for the module's duration."""
    settings = Settings(home=tmp_path_factory.mktemp("sinks-home"))
    with ClickHouseStore.open(settings, database="anchor"):  # keeps the engine up between per-test stores
        yield settings


@pytest.fixture
def store(chdb_settings: Settings) -> Iterator[ClickHouseStore]:
    """A store on a fresh database of the module's chDB path, with every migration applied."""
    with ClickHouseStore.open(chdb_settings, database=f"t{next(_DATABASES)}") as opened:
        assert migrations.apply_migrations(opened) == [m.version for m in migrations.load_migrations()]
        yield opened


@pytest.fixture
def bare_store(chdb_settings: Settings) -> Iterator[ClickHouseStore]:
    """A store on a fresh, empty database."""
    with ClickHouseStore.open(chdb_settings, database=f"t{next(_DATABASES)}") as opened:
        yield opened


def tables_in(store: ClickHouseStore) -> set[str]:
    rows = store.query_sync("SELECT name FROM system.tables WHERE database = currentDatabase()").result_rows
    return {name for (name,) in rows}


def rows_of(store: ClickHouseStore, sql: str) -> list[dict[str, Any]]:
    return list(store.query_sync(sql).named_results())


# --- migrations ---------------------------------------------------------------------------------------------------


def test_migrations_apply_are_idempotent_roll_back_and_reapply(bare_store: ClickHouseStore) -> None:
    db = bare_store.database
    apply = lambda: bare_store.call_sync(lambda c: migrations.apply_pending(c, db))  # noqa: E731
    all_versions = [m.version for m in migrations.load_migrations()]
    later = [v for v in all_versions if v > 2]  # other engineers' migrations (0007+) may be on disk too
    tables = {"raw_events", "transitions", "reward_components", "woven_rewards", "dead_letters"}
    tables |= {"evaluation_metrics"}

    assert apply() == all_versions and all_versions[:6] == [1, 2, 3, 4, 5, 6]
    assert tables_in(bare_store) >= tables | set(VIEWS) | {"schema_migrations"} | STATE_OBJECTS
    assert apply() == []

    assert bare_store.call_sync(lambda c: migrations.rollback(c, 2, db)) == later[::-1]
    assert tables_in(bare_store) == {"raw_events", "raw_events_latest", "transitions", "transitions_latest"} | {
        "schema_migrations"
    }
    assert [m.version for m in bare_store.call_sync(lambda c: migrations.pending(c, db))] == later
    assert bare_store.call_sync(lambda c: migrations.rollback(c, 0, db)) == [2, 1]
    assert tables_in(bare_store) == {"schema_migrations"}

    assert bare_store.call_sync(lambda c: migrations.apply_pending(c, db, target=3)) == [1, 2, 3]
    assert apply() == later[1:]
    assert bare_store.call_sync(lambda c: migrations.applied_checksums(c, db)).keys() == set(all_versions)


def test_migrations_create_the_database_and_refuse_an_edited_one(bare_store: ClickHouseStore, tmp_path: Path) -> None:
    db = f"fresh_{next(_DATABASES)}"
    folder = tmp_path / "migrations"
    shutil.copytree(migrations.MIGRATIONS_DIR, folder)
    assert bare_store.call_sync(lambda c: migrations.apply_pending(c, db, migrations.load_migrations(folder)))
    assert rows_of(bare_store, f"SELECT count() AS n FROM system.databases WHERE name = '{db}'") == [{"n": 1}]

    edited = folder / "0002_transitions.up.sql"
    edited.write_text(edited.read_text() + "\n-- edited\n")
    with pytest.raises(migrations.MigrationError, match=r"0002_transitions changed after it was applied"):
        bare_store.call_sync(lambda c: migrations.apply_pending(c, db, migrations.load_migrations(folder)))


def test_merge_settings_apply_to_the_busy_tables_and_skip_what_the_server_lacks(store: ClickHouseStore) -> None:
    from sinks.merge_settings import BUSY_TABLES, MERGE_SETTINGS, apply_merge_settings

    assert apply_merge_settings(store) == MERGE_SETTINGS  # chDB knows both
    assert apply_merge_settings(store, {"no_such_setting": 1, "merge_selector_base": 12}) == {"merge_selector_base": 12}
    for table in BUSY_TABLES:
        [(create,)] = store.query_sync(f"SHOW CREATE TABLE {table}").result_rows
        assert "merge_selector_enable_heuristic_to_lower_max_parts_to_merge_at_once = 0" in create, table
        assert "merge_selector_base = 12" in create and "no_such_setting" not in create, table
    [(create,)] = store.query_sync("SHOW CREATE TABLE dead_letters").result_rows
    assert "merge_selector" not in create


def test_load_migrations_checks_the_folder(tmp_path: Path) -> None:
    (tmp_path / "0001_a.up.sql").write_text("SELECT 1")
    with pytest.raises(migrations.MigrationError, match="0001 has no down script"):
        migrations.load_migrations(tmp_path)
    (tmp_path / "0001_a.down.sql").write_text("SELECT 1")
    (tmp_path / "2_b.up.sql").write_text("SELECT 1")
    with pytest.raises(migrations.MigrationError, match=r"NNNN_name\.up\.sql"):
        migrations.load_migrations(tmp_path)


def test_every_up_script_is_reversible_and_uses_the_database_placeholder() -> None:
    for migration in migrations.load_migrations():
        up, down = migration.up_statements("db_x"), migration.down_statements("db_x")
        assert up and down, migration.label
        assert all("db_x." in statement for statement in up + down), migration.label
        # Re-runnable statements only; a backfill INSERT must be idempotent too (eval_tool_stats_hourly's set state).
        rerunnable = ("CREATE TABLE IF NOT EXISTS", "CREATE OR REPLACE VIEW", "CREATE MATERIALIZED VIEW IF NOT EXISTS")
        assert all(s.startswith((*rerunnable, "INSERT INTO", "ALTER TABLE")) for s in up), migration.label
        assert all(_alters_only_if_needed(s, "ADD COLUMN", "IF NOT EXISTS") for s in up), migration.label
        # A down may restore an earlier view (CREATE OR REPLACE) before it drops the columns an up added.
        undo = ("DROP TABLE IF EXISTS", "DROP VIEW IF EXISTS", "ALTER TABLE", "CREATE OR REPLACE VIEW")
        assert all(s.startswith(undo) for s in down), migration.label
        assert all(_alters_only_if_needed(s, "DROP COLUMN", "IF EXISTS") for s in down), migration.label


def _alters_only_if_needed(statement: str, action: str, guard: str) -> bool:
    """An ALTER TABLE is re-runnable when it only does `action` and every one of them carries `guard`.

    Clauses that set a state rather than change it (MODIFY SETTING, RESET SETTING, MODIFY COLUMN to a type)
    are re-runnable as they are.
    """
    if not statement.startswith("ALTER TABLE"):
        return True
    body = re.sub(r"^ALTER TABLE\s+\S+\s+", "", statement)
    clauses = re.split(r",\s*(?=(?:ADD|DROP|MODIFY|RENAME|CLEAR|COMMENT|MATERIALIZE|UPDATE|DELETE|RESET)\s)", body)
    settled = (
        r"(MODIFY SETTING|RESET SETTING|MODIFY ORDER BY|DELETE WHERE "
        r"|MODIFY COLUMN \w+ [A-Za-z]\w*(\(\w+\))?( DEFAULT '\w+')?( COMMENT '[^']*')?$)"
    )
    return all(re.match(rf"{action} {guard} ", clause) or re.match(settled, clause) for clause in clauses)


def test_table_columns_match_the_ddl(store: ClickHouseStore) -> None:
    for table, columns in TABLE_COLUMNS.items():
        described = [row[0] for row in store.query_sync(f"DESCRIBE TABLE {table}").result_rows]
        if table in VARIANT_TABLES:  # the sink leaves variant to its default, 'live' (re-weaves write the others)
            described.remove("variant")
        assert tuple(described) == columns, table
        in_view = [row[0] for row in store.query_sync(f"DESCRIBE TABLE {table}_latest").result_rows]
        if table in VARIANT_TABLES:
            in_view.remove("variant")
        assert sorted(in_view) == sorted(columns), table


# --- row mappers --------------------------------------------------------------------------------------------------


def test_input_events_map_to_raw_events_and_rewards_also_to_components() -> None:
    for kind, record in INPUT_RECORDS.items():
        rows = rows_for(kind, record)
        assert [table for table, _ in rows] == (
            ["raw_events", "reward_components"] if kind == "rewards" else ["raw_events"]
        )
        raw = rows[0][1]
        assert set(raw) == set(TABLE_COLUMNS["raw_events"])
        assert raw["kind"] == kind and raw["schema_name"] == INPUT_SCHEMAS[kind]
        assert TopicCatalog(Settings())[kind].value_schema == INPUT_SCHEMAS[kind]
        assert raw["event_id"] == record["envelope"]["event_id"]
        assert raw["event_time"] == record["envelope"]["event_time"]
        assert raw["attributes"] == {"env": "staging", "region": "eu"}
        assert raw["ingested_revision"] == ROW_FORMAT_REVISION
        assert "envelope" not in raw["payload_json"]
        assert rows_for(kind, record) == rows, "mapping must be deterministic"

    payload = rows_for("actions", action())[0][1]["payload_json"]
    assert payload == (
        '{"deadline":1760000030000000,"params_json":"{\\"customer\\": \\"c-42\\", \\"limit\\": 5}",'
        '"step":0,"tool":"search_orders"}'
    )
    component_row = rows_for("rewards", reward_signal())[1][1]
    assert component_row == {
        "logical_event_id": "l-1",
        "session_id": "s-1",
        "event_id": "0199c9a0-0002-7000-8000-000000000001",
        "agent_id": "support-bot",
        "episode_id": "s-1-ep1",
        "source": "llm_judge",
        "name": "helpfulness",
        "value": -0.3,
        "confidence": 0.8,
        "annotator": "LLM",
        "evidence": "answer ignored the order id; see trace",
        "event_time": T0 + 2_000_000,
        "policy_version": "pi-2025-10-01",
        "trace_id": "trace-l-1",
        "ingested_revision": ROW_FORMAT_REVISION,
    }


def test_derived_records_map_to_their_tables() -> None:
    [(table, row)] = rows_for("transitions", transition(4))
    assert table == "transitions" and set(row) == set(TABLE_COLUMNS["transitions"])
    assert row["reward_components.event_id"] == ["r-0", "r-1"]
    assert row["reward_components.value"] == [-0.3, 0.7]
    assert row["result_at"] == T0 + 120_500 and row["tool_status"] == "OK"
    [(_, pending_row)] = rows_for("transitions", transition(1))
    assert pending_row["result_at"] is None and pending_row["reward"] is None
    assert pending_row["reward_components.source"] == []

    [(table, row)] = rows_for("woven_rewards", woven(2))
    assert table == "woven_rewards" and set(row) == set(TABLE_COLUMNS["woven_rewards"])
    assert row["components.event_id"] == ["r-0", "r-1"] and row["step"] == 0
    # Records written before the explanation fields existed map to the schema's defaults.
    assert row["components.contribution"] == [0.0, 0.0] and row["components.adjusted_value"] == [None, None]
    assert row["components.imputed"] == [False, False] and row["components.evidence"] == [None, None]
    assert (row["reward_policy_version"], row["rules_fired"], row["conflicts.a_event_id"]) == ("", [], [])

    [(table, row)] = rows_for("dead_letters", dead_letter())
    assert table == "dead_letters" and set(row) == set(TABLE_COLUMNS["dead_letters"])
    assert row["value"] == b"\x00\xffgarbage\xc3" and row["event_id"] is None

    [(table, row)] = rows_for("evaluation_metrics", evaluation_metric())
    assert table == "evaluation_metrics" and set(row) == set(TABLE_COLUMNS["evaluation_metrics"])
    assert row["metric_id"] == "safety:safety_alert:email:0199c9a0-0001-7000-8000-000000000001"
    assert row["event_time"] == T0 + 850_000 and row["policy_version"] == "pi-2025-10-01"

    state_tables = [table for table, _ in rows_for("state_versions", state_version())]
    assert state_tables == ["state_versions", "state_node_ends", "state_nodes", "state_edges"]
    for table, row in rows_for("state_versions", state_version()):
        assert set(row) == set(TABLE_COLUMNS[table]), table

    with pytest.raises(ValueError, match="no ClickHouse table takes records of topic kind 'schemas'"):
        rows_for("schemas", {})


def test_micros_accepts_ints_and_datetimes() -> None:
    from datetime import UTC, datetime

    assert micros(T0) == T0
    assert micros(datetime(2025, 10, 9, 8, 53, 20, 1, tzinfo=UTC)) == T0 + 1
    assert micros(datetime(2025, 10, 9, 8, 53, 20, 1)) == T0 + 1


# --- writer and views on chDB -------------------------------------------------------------------------------------


def all_records() -> list[tuple[str, dict[str, Any]]]:
    return [
        *INPUT_RECORDS.items(),
        ("rewards", reward_signal(event_id="0199c9a0-0002-7000-8000-000000000002")),
        ("transitions", transition(1)),
        ("transitions", transition(3)),
        ("transitions", transition(2, step=1, lid="l-2")),
        ("woven_rewards", woven(1)),
        ("woven_rewards", woven(2)),
        ("dead_letters", dead_letter(17)),
        ("dead_letters", dead_letter(18)),
        ("evaluation_metrics", evaluation_metric()),
        ("evaluation_metrics", evaluation_metric("any_pii", 1.0, "email")),
    ]


def view_snapshot(store: ClickHouseStore) -> dict[str, list[dict[str, Any]]]:
    order = {
        "raw_events_latest": "session_id, event_id",
        "transitions_latest": "session_id, step, logical_event_id",
        "reward_components_latest": "session_id, logical_event_id, event_id",
        "woven_rewards_latest": "session_id, logical_event_id",
        "dead_letters_latest": "dead_letter_id",
        "evaluation_metrics_latest": "metric_id",
    }
    return {view: rows_of(store, f"SELECT * FROM {view} ORDER BY {key}") for view, key in order.items()}


async def test_replayed_records_do_not_change_the_views(store: ClickHouseStore) -> None:
    sink = ClickHouseSink(store, batch_size=1000)
    for kind, record in all_records():
        sink.add(kind, record)
    expected = {"raw_events": 6, "reward_components": 2, "transitions": 3, "woven_rewards": 2, "dead_letters": 2}
    expected["evaluation_metrics"] = 2
    assert sink.pending_rows == expected and sink.pending == 17
    assert await sink.flush() == expected
    assert sink.pending_rows == {}
    first = view_snapshot(store)
    assert [len(first[view]) for view in VIEWS] == [6, 2, 2, 1, 2, 2]

    for kind, record in reversed(all_records()):  # a replay after a crash, in other batches and another order
        await sink.put(kind, record)
    await sink.flush()
    assert sink.rows_written["transitions"] == 6
    assert view_snapshot(store) == first
    [stored] = rows_of(store, "SELECT count() AS n FROM transitions")
    assert 3 <= stored["n"] <= 6  # duplicates stay in the table until a background merge; the views hide them


async def test_views_return_the_newest_revision_whatever_the_insert_order(store: ClickHouseStore) -> None:
    sink = ClickHouseSink(store, batch_size=1000)
    for revision in (4, 2):
        sink.add("transitions", transition(revision))
    sink.add("woven_rewards", woven(3, woven_at=T0 + 2 * MONTH))  # a later month: another partition
    await sink.flush()
    for revision in (1, 3, 2):
        sink.add("transitions", transition(revision))
        sink.add("woven_rewards", woven(revision, woven_at=T0 + (revision - 1) * MONTH))
    await sink.flush()

    [step] = rows_of(store, "SELECT * FROM transitions_latest")
    expected = transition(4)
    assert step["revision"] == 4 and step["reward_revision"] == 2
    assert step["reward"] == pytest.approx(expected["reward"])
    assert step["reward_components.event_id"] == ["r-0", "r-1"]
    assert step["tool_status"] == "OK" and step["latency_ms"] == 120.5
    assert micros(step["dispatched_at"]) == T0 and micros(step["result_at"]) == T0 + 120_500

    [fused] = rows_of(store, "SELECT * FROM woven_rewards_latest")
    assert (fused["revision"], fused["value"], fused["status"]) == (3, 30.0, "complete")
    assert fused["components.event_id"] == ["r-0", "r-1", "r-2"]
    assert micros(fused["woven_at"]) == T0 + 2 * MONTH
    history = rows_of(store, "SELECT revision FROM woven_rewards FINAL ORDER BY revision")
    assert history == [{"revision": 1}, {"revision": 2}, {"revision": 3}], "every revision is kept"

    components = rows_of(
        store,
        "SELECT c.source AS source, c.value AS value FROM transitions_latest "
        "ARRAY JOIN reward_components AS c ORDER BY value",
    )
    assert components == [{"source": "llm_judge", "value": -0.3}, {"source": "llm_judge", "value": 0.7}]


async def test_records_round_trip_through_the_avro_codec(store: ClickHouseStore) -> None:
    from topics.codec import AvroCodec

    codec = AvroCodec()
    catalog = TopicCatalog(Settings())
    sink = ClickHouseSink(store)
    for kind, record in all_records():
        schema = catalog[kind].value_schema
        assert schema is not None
        _, decoded = codec.decode(codec.encode(schema, record), expect=schema)
        sink.add(kind, decoded)
    await sink.flush()

    [letter, _] = rows_of(store, "SELECT dead_letter_id, hex(value) AS raw FROM dead_letters_latest ORDER BY 1")
    assert letter == {"dead_letter_id": "treadle.actions:2:17", "raw": b"\x00\xffgarbage\xc3".hex().upper()}
    [timeout] = rows_of(
        store,
        "SELECT JSONExtractString(payload_json, 'status') AS status, "
        "JSONExtractInt(payload_json, 'retries') AS retries FROM raw_events_latest WHERE kind = 'tool_results'",
    )
    assert timeout == {"status": "TIMEOUT", "retries": 2}
    why = rows_of(
        store,
        "SELECT source, value, evidence FROM reward_components_latest WHERE logical_event_id = 'l-1' ORDER BY event_id",
    )
    assert [row["value"] for row in why] == [-0.3, -0.3] and why[0]["evidence"].startswith("answer ignored")
    alerts = rows_of(store, "SELECT metric, rule, value, evidence FROM evaluation_metrics_latest ORDER BY metric")
    assert alerts == [
        {"metric": "pii_leak", "rule": "any_pii", "value": 1.0, "evidence": "email"},
        {"metric": "safety_alert", "rule": "email", "value": 1.0, "evidence": "j***@example.com"},
    ]


async def test_sink_flushes_full_batches_and_counts_rows(store: ClickHouseStore) -> None:
    sink = ClickHouseSink(store, batch_size=3)
    assert sink.add("dead_letters", dead_letter(1)) is False
    assert sink.add("dead_letters", dead_letter(2)) is False
    assert sink.add("dead_letters", dead_letter(3)) is True
    await sink.put("dead_letters", dead_letter(4))  # the batch is full: put flushes all four
    assert sink.pending_rows == {} and sink.rows_written["dead_letters"] == 4
    await sink.put("dead_letters", dead_letter(5))
    assert sink.pending_rows == {"dead_letters": 1} and sink.pending == 1
    assert await sink.flush() == {"dead_letters": 1}
    assert await sink.flush() == {}
    assert rows_of(store, "SELECT count() AS n FROM dead_letters_latest") == [{"n": 5}]
    with pytest.raises(ValueError):
        ClickHouseSink(store, batch_size=0)


async def test_the_sink_consumer_inserts_when_one_table_fills_its_batch(
    store: ClickHouseStore, deployment: Settings
) -> None:
    """TREADLE_SINK_BATCH_SIZE is rows per insert: two rewards buffer four rows, two per table, and wait for the
    timer; the fourth reward fills both tables' batches, which go in one insert each (real Kafka, chDB)."""
    from sinks.consumer import SinkConsumer
    from tests.factories import RawProducer
    from tests.factories import reward as reward_record
    from topics.codec import AvroCodec
    from topics.intake import Intake
    from topics.tool_schemas import ToolSchemas
    from topics.validation import InputValidator

    settings = deployment.model_copy(update={"sink_batch_size": 4, "sink_flush_seconds": 600.0})
    catalog, codec = TopicCatalog(settings), AvroCodec()
    intake = Intake(codec, catalog, InputValidator(ToolSchemas.load(settings.tool_schemas)))
    consumer = SinkConsumer(settings, catalog, codec, intake, store)
    running = asyncio.create_task(consumer.run())

    async def until(done: Callable[[], bool], what: str) -> None:
        for _ in range(300):
            if done():
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"{what}: buffered {consumer.sink.pending_rows}, wrote {consumer.sink.rows_written}")

    try:
        async with RawProducer(settings, codec) as producer:
            for seq in (1, 2):
                await producer.send("treadle.events.RewardSignal", reward_record("s-batch", f"l-{seq}", seq, 0.5))
            await producer.flush()
            await until(lambda: consumer.sink.pending == 4, "four rows buffered")
            await asyncio.sleep(1.0)  # several polls later: still buffered, nothing inserted
            assert consumer.sink.pending_rows == {"raw_events": 2, "reward_components": 2}
            assert consumer.sink.rows_written["raw_events"] == 0
            for seq in (3, 4):
                await producer.send("treadle.events.RewardSignal", reward_record("s-batch", f"l-{seq}", seq, 0.5))
            await producer.flush()
            await until(lambda: consumer.sink.rows_written["reward_components"] == 4, "both tables inserted")
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    assert {t: n for t, n in consumer.sink.rows_written.items() if n} == {"raw_events": 4, "reward_components": 4}
    batches = consumer.metrics.batch_rows.labels("raw_events").collect()[0].samples
    assert [s.value for s in batches if s.name.endswith("_count")] == [1.0]  # one insert of four rows
    assert rows_of(store, "SELECT count() AS n FROM raw_events_latest WHERE session_id = 's-batch'") == [{"n": 4}]


async def test_a_failed_flush_keeps_its_rows_for_the_retry(store: ClickHouseStore) -> None:
    db = store.database
    await store.call(lambda c: migrations.rollback(c, 1, db))  # the transitions table is gone
    sink = ClickHouseSink(store)
    sink.add("transitions", transition(2))
    sink.add("actions", action())
    with pytest.raises(Exception, match="transitions"):
        await sink.flush()
    sink.add("transitions", transition(3))
    assert sink.pending_rows["transitions"] == 2

    await store.call(lambda c: migrations.apply_pending(c, db))
    await sink.flush()
    assert sink.pending_rows == {}
    assert rows_of(store, "SELECT revision FROM transitions_latest") == [{"revision": 3}]
    assert rows_of(store, "SELECT count() AS n FROM raw_events_latest") == [{"n": 1}]


async def test_sink_insert_speed(store: ClickHouseStore) -> None:
    """Not a benchmark, a floor: 20k raw events through the sink in well under the worker's budget."""
    sink = ClickHouseSink(store, batch_size=5000)
    records = []
    for i in range(20_000):
        record = action(session=f"s-{i % 50}", lid=f"l-{i}", step=i)
        record["envelope"]["event_id"] = f"0199c9a0-0000-7000-8000-{i:012d}"
        records.append(record)
    started = time.perf_counter()
    for record in records:
        await sink.put("actions", record)
    await sink.flush()
    elapsed = time.perf_counter() - started
    assert sink.rows_written["raw_events"] == 20_000
    assert elapsed < 10, f"{20_000 / elapsed:.0f} rows/s"


# --- the store ------------------------------------------------------------------------------------------------------


async def test_store_runs_every_call_on_one_thread_without_blocking_the_loop(store: ClickHouseStore) -> None:
    threads: set[int] = set()

    def which_thread(client: Any) -> int:
        threads.add(threading.get_ident())
        return int(client.query("SELECT 1").result_rows[0][0])

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    slow = store.query("SELECT sum(sleepEachRow(0.05)) FROM numbers(6) SETTINGS max_block_size = 1")
    results = await asyncio.gather(slow, *(store.call(which_thread) for _ in range(20)))
    task.cancel()
    assert results[1:] == [1] * 20
    assert threads and threading.get_ident() not in threads and len(threads) == 1
    assert ticks >= 10, "the event loop kept running while chDB worked"
    assert store.query_sync("SELECT 2").result_rows == [(2,)]


async def test_read_pairs_run_two_reads_at_once_in_order_and_only_reads(store: ClickHouseStore) -> None:
    """read_only_queries_arrow: two read-only sessions at once, answers in statement order, no write meanwhile."""
    slow = "SELECT sum(sleepEachRow(0.05)) AS s, {} AS i FROM numbers(8)"
    started = time.monotonic()
    tables = await store.read_only_queries_arrow([slow.format(i) for i in range(4)])
    elapsed = time.monotonic() - started
    assert [t.column("i").to_pylist() for t in tables] == [[0], [1], [2], [3]]
    assert elapsed < 4 * 0.4 * 0.9, f"{elapsed:.2f} s: the statements did not run two at a time"
    with pytest.raises(ReadOnlyQueryError):
        await store.read_only_queries_arrow(["SELECT 1", "DROP TABLE transitions"])
    assert store.read_only_queries_arrow_sync(["SELECT 7 AS x"])[0].column("x").to_pylist() == [7]


async def test_formatted_inserts_on_chdb_go_in_from_memory_with_their_settings(
    store: ClickHouseStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """insert_formatted on chDB makes no temporary file (raw_insert's FROM INFILE would need one) and keeps its
    settings: optimize_on_insert=1 collapses a key inside the block, 0 keeps both rows."""
    await store.command("CREATE TABLE kv (k String, v UInt32) ENGINE = ReplacingMergeTree(v) ORDER BY k")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))  # any temporary file would fail here
    block = b"a\t1\na\t2\nb\t3\n"
    assert await store.insert_formatted("kv", block, ["k", "v"], "TabSeparated", {"optimize_on_insert": 0}) == 3
    assert store.query_sync("SELECT count() FROM kv").result_rows == [(3,)]
    await store.command("TRUNCATE TABLE kv")
    await store.insert_formatted("kv", bytearray(block), ["k", "v"], "TabSeparated", {"optimize_on_insert": 1})
    assert store.query_sync("SELECT k, v FROM kv ORDER BY k").result_rows == [("a", 2), ("b", 3)]
    assert chdb_handle(object()) is None  # not chDB's client: insert_formatted keeps raw_insert


async def test_a_formatted_insert_chdb_refuses_raises_writes_nothing_and_frees_the_handle(
    store: ClickHouseStore,
) -> None:
    await store.command("CREATE TABLE kv (k String, v UInt32) ENGINE = MergeTree ORDER BY k")
    with pytest.raises(DatabaseError, match=r"(?i)parse|cannot|number"):
        await store.insert_formatted("kv", b"a\t1\nb\tnot-a-number\n", ["k", "v"], "TabSeparated")
    with pytest.raises(DatabaseError):
        await store.insert_formatted("no_such_table", b"a\t1\n", ["k", "v"], "TabSeparated")
    assert store.query_sync("SELECT count() FROM kv").result_rows == [(0,)]
    assert await store.insert_formatted("kv", b"c\t4\n", ["k", "v"], "TabSeparated") == 1  # the handle is free
    assert store.query_sync("SELECT k, v FROM kv").result_rows == [("c", 4)]


def test_a_closed_store_says_so(chdb_settings: Settings) -> None:
    opened = ClickHouseStore.open(chdb_settings, database="closing")
    opened.close()
    opened.close()
    assert opened.closed
    with pytest.raises(ClickHouseUnavailableError, match="closed"):
        opened.query_sync("SELECT 1")


def test_a_second_chdb_path_in_this_process_is_a_clear_error(chdb_settings: Settings, tmp_path: Path) -> None:
    with pytest.raises(ClickHouseUnavailableError) as caught:
        ClickHouseStore.open(Settings(home=tmp_path))
    message = str(caught.value)
    assert "\n" not in message and "one data path per process" in message
    assert str(chdb_settings.chdb_path.resolve()) in message


OPEN_IN_SUBPROCESS = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from sinks.clickhouse import ClickHouseStore, ClickHouseUnavailableError
    from topics.settings import Settings
    settings = Settings(home=Path(sys.argv[1]))
    if sys.argv[2] == "hold":
        store = ClickHouseStore.open(settings)
        print("ready", flush=True)
        sys.stdin.read()
    else:
        try:
            ClickHouseStore.open(settings)
        except ClickHouseUnavailableError as exc:
            print("ERROR", exc)
    """
)


def test_a_path_held_by_another_process_is_explained_in_one_line(tmp_path: Path) -> None:
    run = [sys.executable, "-c", OPEN_IN_SUBPROCESS, str(tmp_path)]
    holder = subprocess.Popen([*run, "hold"], cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"ready"
        second = subprocess.run([*run, "open"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        lines = second.stdout.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ERROR "), second.stdout + second.stderr
        assert str(tmp_path / "chdb") in lines[0] and "treadle sql" in lines[0]
        if importlib.util.find_spec("sinks.chdb_lock") is not None:
            assert f"PID {holder.pid}" in lines[0]
    finally:
        holder.kill()
        holder.wait()


def test_database_names_are_plain_identifiers() -> None:
    assert database_name(Settings()) == "treadle"
    assert database_name(Settings(clickhouse_url="http://u:p@ch:8123/replay")) == "replay"
    assert database_name(Settings(clickhouse_url="http://ch:8123")) == "treadle"
    with pytest.raises(ValueError):
        checked_identifier("treadle; DROP DATABASE x")
    with pytest.raises(ValueError):
        database_name(Settings(clickhouse_url="http://ch:8123/a-b"))


async def test_gpu_samples_join_the_tool_calls_they_overlap(store: ClickHouseStore) -> None:
    """resource_samples + gpu_utilization_during_tool_calls: the mean of exactly the samples inside each call."""
    from streams.runtime.gpu import GpuReading, sample_record

    sink = ClickHouseSink(store)
    await sink.put("transitions", transition(2, step=0, lid="l-0", dispatched_at=T0))  # runs T0 .. T0+120.5 ms
    await sink.put("transitions", transition(2, step=1, lid="l-1", dispatched_at=T0 + 10_000_000))
    gpu = GpuReading(0, "GPU-1", "NVIDIA H200", 0, 2**30, 2**37, 500_000)
    inside = [(T0 + 10_000, 20), (T0 + 60_000, 40), (T0 + 120_000, 90)]
    outside = [(T0 - 1, 100), (T0 + 5_000_000, 100)]
    for at, percent in inside + outside + inside[:1]:  # the repeated sample is a replay: one row
        reading = GpuReading(**{**gpu.__dict__, "utilization_percent": percent})
        await sink.put("resource_samples", sample_record("host-a", reading, at))
    await sink.flush()
    rows = rows_of(store, "SELECT step, samples, mean_utilization FROM gpu_utilization_during_tool_calls")
    assert rows == [{"step": 0, "samples": 3, "mean_utilization": pytest.approx(0.5)}]
    [count] = rows_of(store, "SELECT count() AS n, max(power_watts) AS w FROM resource_samples_latest")
    assert count == {"n": 5, "w": 500.0}


# --- records the sink cannot write (issue 25) ---------------------------------------------------------------------


def _source(offset: int, value: bytes = b"raw-bytes") -> RowSource:
    return RowSource(topic="t.transitions", partition=1, offset=offset, timestamp_ms=T0 // 1000, value=value)


async def test_a_record_that_cannot_become_rows_goes_to_rejected_rows_and_the_batch_goes_on(
    store: ClickHouseStore,
) -> None:
    sink = ClickHouseSink(store)
    sink.add("transitions", transition(2, lid="l-good"), _source(1))
    sink.add("transitions", {"session_id": "s-1"}, _source(2, b"x" * 100_000))  # no step, no revision...
    await sink.flush()
    assert rows_of(store, "SELECT logical_event_id FROM transitions_latest") == [{"logical_event_id": "l-good"}]
    [rejected] = rows_of(store, "SELECT * FROM rejected_rows_latest")
    assert (rejected["rejected_id"], rejected["stage"], rejected["target_table"]) == ("t.transitions/1/2", "MAP",
                                                                                      "transitions")  # fmt: skip
    assert rejected["reason"].startswith("mapping the record to rows failed: KeyError")
    assert (rejected["topic"], rejected["partition"], rejected["offset"]) == ("t.transitions", 1, 2)
    assert len(rejected["value"]) == 65_536  # a sample; the whole record stays in Kafka at its offset


async def test_a_row_clickhouse_refuses_is_found_and_rejected_alone(store: ClickHouseStore) -> None:
    metrics = SinkMetrics()
    sink = ClickHouseSink(store, metrics=metrics)
    for i in range(7):
        sink.add("transitions", transition(2, lid=f"l-{i}"), _source(i))
    refused = transition(2, lid="l-refused")
    refused["tokens_in"] = "many"  # maps to a row, but not into an Int64 column
    sink.add("transitions", refused, _source(99))
    assert (await sink.flush())["transitions"] == 7
    lids = rows_of(store, "SELECT logical_event_id FROM transitions_latest ORDER BY logical_event_id")
    assert [r["logical_event_id"] for r in lids] == [f"l-{i}" for i in range(7)]
    [rejected] = rows_of(store, "SELECT rejected_id, stage, reason FROM rejected_rows_latest")
    assert (rejected["rejected_id"], rejected["stage"]) == ("t.transitions/1/99/transitions", "INSERT")
    assert rejected["reason"].startswith("ClickHouse refused the row: ")
    assert metrics.rejected_rows.labels("transitions", "INSERT")._value.get() == 1


async def test_a_batch_every_row_of_which_fails_is_a_sink_problem_not_a_record_problem(
    store: ClickHouseStore,
) -> None:
    db = store.database
    await store.call(lambda c: store_command(c, f"DROP TABLE {db}.transitions"))
    sink = ClickHouseSink(store)
    sink.add("transitions", transition(2, lid="l-1"), _source(1))
    sink.add("transitions", transition(2, lid="l-2"), _source(2))
    with pytest.raises(Exception, match="transitions"):
        await sink.flush()
    assert sink.pending_rows == {"transitions": 2}  # kept for the retry, none rejected
    assert rows_of(store, "SELECT count() AS n FROM rejected_rows") == [{"n": 0}]


def store_command(client: Any, sql: str) -> None:
    client.command(sql)
