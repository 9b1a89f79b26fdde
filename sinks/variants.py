"""Re-woven rows in ClickHouse: the past events a re-weave reads, and the variant rows it writes beside the live ones.

A variant is a name a re-weave or backfill writes its rows under; the worker's rows are `live`. Every table that gets
re-woven rows has `variant` in its sort key, so variants never replace each other or the live rows; the `*_latest`
views show the live rows only, the `*_variants` views every variant (migration 0017).

The past comes from raw_events, not the input topics: raw_events holds every valid input event for as long as the
database keeps it, while a topic holds it only within its retention (a week by default), and reading it needs the
broker and a consumer per partition. Both hold the same events (the sink writes raw_events from the input topics);
what raw_events lacks is LLM calls, which weaving never reads.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from sinks.clickhouse import ClickHouseStore
from sinks.export_sql import LIVE, timestamp
from sinks.rows import INPUT_SCHEMAS, TABLE_COLUMNS, rows_for
from sinks.sql_auth import bearer
from sinks.sql_client import QueryFailedError, post_json, run_sql_arrow
from sinks.sql_params import quote
from streams.runtime.run_info import SqlEndpoint, WorkerInfo
from topics.names import LATE_REWARD, REWARD, TRANSITION, WOVEN_REWARD
from topics.settings import Settings

VARIANT_TABLES = ("transitions", "woven_rewards", "late_rewards", "reward_components")
# what the live worker publishes -> the topic kind whose row mapper makes its row
_KINDS = {
    TRANSITION: "transitions",
    WOVEN_REWARD: "woven_rewards",
    LATE_REWARD: "late_rewards",
}
_STEP_KINDS = ("actions", "tool_results", "rewards")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
INSERT_ROWS = 20_000  # rows per INSERT
VARIANT_PART_BYTES = 8 * 1024 * 1024  # JSON per /variant request to the sink (its limit is larger)


class VariantError(ValueError):
    """A variant name that cannot be written; the message says why."""


def checked_variant(name: str) -> str:
    """`name` if a re-weave may write under it: not `live` (the worker's), letters, digits, `_`, `.`, `-`."""
    if name == LIVE:
        raise VariantError("variant 'live' is the worker's own rows: re-woven rows need another name (--as NAME)")
    if not _NAME.fullmatch(name):
        raise VariantError(f"variant name {name!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a "
                           "letter or digit")  # fmt: skip
    return name


def past_events_sql(since: datetime | None, until: datetime | None) -> str:
    """Every step event (dispatch, tool result, reward) of the steps dispatched in [since, until), in raw_events.

    A step is in the range by its dispatch's event time, with all its events whenever they came (a reward a day
    later still counts); a step that never had a dispatch is in it by its first event (its rewards are orphans).
    """
    anchor = "if(countIf(kind = 'actions') > 0, minIf(event_time, kind = 'actions'), min(event_time))"
    bounds = []
    if since is not None:
        bounds.append(f"{anchor} >= {timestamp(since)}")
    if until is not None:
        bounds.append(f"{anchor} < {timestamp(until)}")
    having = f"HAVING {' AND '.join(bounds)}" if bounds else ""
    kinds = ", ".join(quote(k) for k in _STEP_KINDS)
    return f"""SELECT e.kind, e.event_id, e.session_id, e.agent_id, e.episode_id, e.logical_event_id, e.seq,
    toUnixTimestamp64Micro(e.event_time) AS event_time_us, e.policy_version, e.trace_id, e.attributes, e.payload_json
FROM raw_events_latest AS e
WHERE e.kind IN ({kinds}) AND (e.session_id, e.logical_event_id) IN (
    SELECT session_id, logical_event_id FROM raw_events_latest
    WHERE kind IN ({kinds})
    GROUP BY session_id, logical_event_id
    {having}
)
ORDER BY e.session_id, e.logical_event_id, e.event_id"""


def event_from_row(row: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(schema name, record) of a raw_events row, as the worker decoded the event (the row mapper's inverse)."""
    record: dict[str, Any] = orjson.loads(row["payload_json"])
    record["envelope"] = {
        "event_id": row["event_id"],
        "session_id": row["session_id"],
        "agent_id": row["agent_id"],
        "episode_id": row["episode_id"],
        "logical_event_id": row["logical_event_id"],
        "seq": int(row["seq"]),
        "event_time": int(row["event_time_us"]),
        "policy_version": row["policy_version"],
        "trace_id": row["trace_id"],
        "attributes": dict(row["attributes"] or {}),
    }
    return INPUT_SCHEMAS[row["kind"]], record


def read_past_events(
    store: ClickHouseStore, since: datetime | None, until: datetime | None
) -> list[tuple[str, dict[str, Any]]]:
    """The step events past_events_sql selects, as records (whole, in memory: one re-weave's range must fit)."""
    result = store.query_sync(past_events_sql(since, until))
    names = result.column_names
    return [event_from_row(dict(zip(names, row, strict=True))) for row in result.result_rows]


def past_events(settings: Settings, since: datetime | None, until: datetime | None) -> list[tuple[str, dict]]:
    """read_past_events wherever the database is: through the sink's SQL service while it owns embedded chDB."""
    rows = run_sql_arrow(settings, past_events_sql(since, until), timeout=600.0).to_pylist()
    return [event_from_row(row) for row in rows]


def write_variant_rows(settings: Settings, variant: str, records: list[tuple[str, dict[str, Any]]]) -> dict:
    """write_variant wherever the database is: while a sink owns embedded chDB, through its `/variant` endpoint
    (in parts), else on a store opened here."""
    checked_variant(variant)
    endpoint = SqlEndpoint.read(settings) if settings.embedded_clickhouse else None
    if endpoint is None:
        worker = WorkerInfo.read(settings)
        if worker is not None and settings.embedded_clickhouse:
            raise QueryFailedError(f"worker pid {worker.pid} runs but its sink is not serving SQL yet; retry shortly")
        with ClickHouseStore.open(settings) as store:
            return write_variant(store, variant, records)
    written: dict[str, int] = dict.fromkeys(VARIANT_TABLES, 0)
    for number, part in enumerate(_parts(records)):
        payload = {"variant": variant, "replace": number == 0, "records": part}
        answer = orjson.loads(post_json(endpoint, "/variant", payload, timeout=600.0, auth=bearer(settings)))
        for table, count in answer["rows"].items():
            written[table] += count
    return written


def _parts(records: list[tuple[str, dict[str, Any]]]) -> Iterable[list[dict[str, Any]]]:
    """`records` as /variant parts of about VARIANT_PART_BYTES of JSON each (at least one part, maybe empty)."""
    part: list[dict[str, Any]] = []
    size = 0
    for schema_name, record in records:
        size += len(orjson.dumps(record))
        part.append({"schema_name": schema_name, "record": record})
        if size >= VARIANT_PART_BYTES:
            yield part
            part, size = [], 0
    if part or size == 0:
        yield part


class VariantRecord(BaseModel):
    """One row-making record of a variant: a Transition, WovenReward, LateReward or (backfill) RewardSignal."""

    model_config = ConfigDict(extra="forbid")

    schema_name: str
    record: dict[str, Any]


class VariantWrite(BaseModel):
    """What the sink's `/variant` endpoint takes: a part of one variant's records (a re-weave sends several)."""

    model_config = ConfigDict(extra="forbid")

    variant: str
    replace: bool = Field(description="Delete the variant's earlier rows first (the first part of a run).")
    records: list[VariantRecord]


def variant_rows(variant: str, records: Iterable[tuple[str, dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Table -> rows of `records` (Transition, WovenReward, LateReward, and RewardSignal: its reward_components row),
    each tagged with `variant`."""
    tables: dict[str, list[dict[str, Any]]] = {table: [] for table in VARIANT_TABLES}
    for schema_name, record in records:
        kind = _KINDS.get(schema_name, "rewards" if schema_name == REWARD else None)
        if kind is None:
            raise ValueError(f"a variant holds no {schema_name} rows")
        for table, row in rows_for(kind, record):
            if table in tables:
                row["variant"] = variant
                tables[table].append(row)
    return tables


def clear_variant(store: ClickHouseStore, variant: str) -> None:
    """Delete every row of `variant` (a variant is one run: an earlier run's rows under the name go first)."""
    checked_variant(variant)
    for table in VARIANT_TABLES:
        store.command_sync(f"ALTER TABLE {store.database}.{table} DELETE WHERE variant = {quote(variant)} "
                           "SETTINGS mutations_sync = 2")  # fmt: skip


def insert_variant(store: ClickHouseStore, variant: str, records: Iterable[tuple[str, dict[str, Any]]]) -> dict:
    """Insert `records`' rows under `variant`; rows written per table. Live rows are never touched: every row
    names the variant, and `live` is refused."""
    checked_variant(variant)
    written = {}
    for table, rows in variant_rows(variant, records).items():
        columns = (*TABLE_COLUMNS[table], "variant")
        for start in range(0, len(rows), INSERT_ROWS):
            chunk = rows[start : start + INSERT_ROWS]
            store.insert_sync(table, [[row[c] for c in columns] for row in chunk], columns)
        written[table] = len(rows)
    return written


def write_variant(store: ClickHouseStore, variant: str, records: Iterable[tuple[str, dict[str, Any]]]) -> dict:
    """Replace the rows of `variant` with `records`' rows; rows written per table."""
    clear_variant(store, variant)
    return insert_variant(store, variant, records)


def apply_write(store: ClickHouseStore, write: VariantWrite) -> dict:
    """One `/variant` request, on the sink's store."""
    if write.replace:
        clear_variant(store, write.variant)
    return insert_variant(store, write.variant, [(r.schema_name, r.record) for r in write.records])


def variants(store: ClickHouseStore) -> list[str]:
    """The variant names with transitions, live first."""
    rows = store.query_sync(f"SELECT DISTINCT variant FROM {store.database}.transitions").result_rows
    return sorted((r[0] for r in rows), key=lambda v: (v != LIVE, v))
