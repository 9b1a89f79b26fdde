"""The console's SQL: every statement it runs, with user values only as `{name:Type}` bound parameters.

All of them go through `sinks.sql_client.run_sql` (the read-only guard, and the sink's SQL service while a worker
owns embedded chDB), so the console never opens a second writer. Times come back as UTC micros (integers) so rows
read the same through the sink's JSON endpoint and straight from chDB. Sort columns are picked from a fixed map,
never from the request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from sinks.sql_client import run_sql
from topics.settings import Settings
from treadle.console.params import SessionFilter

Rows = list[dict[str, Any]]
RawRunner = Callable[..., tuple[list[str], list[list[Any]]]]  # (query, params=...) -> (columns, rows)


class SqlReader:
    """Runs the console's read-only statements, one call per statement, and hands rows back as dicts."""

    def __init__(self, settings: Settings, runner: RawRunner | None = None, timeout: float = 30.0) -> None:
        self.settings = settings
        self._run = runner or partial(run_sql, settings, timeout=timeout)

    def rows(self, query: str, **params: Any) -> Rows:
        columns, rows = self._run(query, params=params or None)
        return [dict(zip(columns, row, strict=True)) for row in rows]

    def has_table(self, name: str) -> bool:
        found = self.rows(
            "SELECT count() AS n FROM system.tables WHERE database = currentDatabase() AND name = {name:String}",
            name=name,
        )
        return bool(found and found[0]["n"])


# ---- sessions -------------------------------------------------------------------------------------------------

SESSION_SORTS = {
    "session": "session_id",
    "agent": "agent_id",
    "started": "started_us",
    "last": "last_us",
    "steps": "steps",
    "dead_letters": "dead_letters",
    "late": "late_rewards",
}

_ENDED_KINDS = "('EPISODE_ENDED', 'SESSION_CLOSED', 'SESSION_ARCHIVED')"


def sessions_sql(f: SessionFilter) -> tuple[str, dict[str, Any]]:
    """One page of sessions (sessions with at least one step) and the total that match, with their bound values.

    A session is `ended` when its last lifecycle event (by seq) is EPISODE_ENDED, SESSION_CLOSED or
    SESSION_ARCHIVED. A LEFT JOIN without a match reads 0 or '' (join_use_nulls is 0: readonly mode may not
    change it). Counts read the tables without FINAL (uniqExact over ids), which stays fast on 100k sessions.
    """
    where, having, outer, params = [], [], [], {}
    if f.agent:
        where.append("agent_id = {agent:String}")
        params["agent"] = f.agent
    if f.q:
        where.append(
            "session_id IN (SELECT session_id FROM transitions WHERE session_id = {q:String} "
            "OR startsWith(session_id, {q:String}) OR episode_id = {q:String} OR logical_event_id = {q:String})"
        )
        params["q"] = f.q
    if f.policy:
        having.append("countIf(policy_version = {policy:String}) > 0")
        params["policy"] = f.policy
    if f.since is not None:
        having.append("max(updated_at) >= {since:DateTime64}")
        params["since"] = f.since
    if f.until is not None:
        having.append("min(dispatched_at) <= {until:DateTime64}")
        params["until"] = f.until
    if f.status != "any":
        outer.append("status = {status:String}")
        params["status"] = f.status
    sort = SESSION_SORTS[f.sort]
    direction = "ASC" if f.order == "asc" else "DESC"
    params["limit"], params["offset"] = f.size, (f.page - 1) * f.size
    query = f"""
SELECT s.session_id AS session_id, s.agent AS agent_id, s.policy_versions AS policy_versions,
    s.started_us AS started_us, s.last_us AS last_us, s.steps AS steps,
    d.n AS dead_letters, l.late AS late_rewards, l.orphans AS orphans,
    if(e.last_kind IN {_ENDED_KINDS}, 'ended', 'open') AS status,
    count() OVER () AS total
FROM (
    SELECT session_id, any(agent_id) AS agent, arraySort(groupUniqArray(policy_version)) AS policy_versions,
        toUnixTimestamp64Micro(min(dispatched_at)) AS started_us, toUnixTimestamp64Micro(max(updated_at)) AS last_us,
        uniqExact(logical_event_id) AS steps
    FROM transitions
    {"WHERE " + " AND ".join(where) if where else ""}
    GROUP BY session_id
    {"HAVING " + " AND ".join(having) if having else ""}
) AS s
LEFT JOIN (
    SELECT assumeNotNull(session_id) AS session_id, uniqExact(dead_letter_id) AS n FROM dead_letters
    WHERE session_id IS NOT NULL GROUP BY session_id
) AS d ON d.session_id = s.session_id
LEFT JOIN (
    SELECT session_id, uniqExactIf(event_id, reason = 'AFTER_GRACE') AS late,
        uniqExactIf(event_id, reason = 'ORPHAN') - uniqExactIf(event_id, reason = 'ORPHAN_RESOLVED') AS orphans
    FROM late_rewards GROUP BY session_id
) AS l ON l.session_id = s.session_id
LEFT JOIN (
    SELECT session_id, argMax(JSONExtractString(payload_json, 'kind'), seq) AS last_kind
    FROM raw_events WHERE kind = 'lifecycle' GROUP BY session_id
) AS e ON e.session_id = s.session_id
{"WHERE " + " AND ".join(outer) if outer else ""}
ORDER BY {sort} {direction}, session_id {direction}
LIMIT {{limit:UInt32}} OFFSET {{offset:UInt64}}"""
    return query, params


@dataclass(frozen=True)
class SessionPage:
    rows: Rows
    total: int
    filter: SessionFilter

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // self.filter.size))


def sessions(reader: SqlReader, f: SessionFilter) -> SessionPage:
    query, params = sessions_sql(f)
    rows = reader.rows(query, **params)
    total = int(rows[0]["total"]) if rows else 0
    if not rows and f.page > 1:  # past the end: count what matches for the pager
        total = sessions_total(reader, f)
    return SessionPage(rows, total, f)


def sessions_total(reader: SqlReader, f: SessionFilter) -> int:
    first = f.model_copy(update={"page": 1, "size": 1})
    query, params = sessions_sql(first)
    rows = reader.rows(query, **params)
    return int(rows[0]["total"]) if rows else 0


def sessions_fingerprint(reader: SqlReader) -> tuple[Any, ...]:
    """What changes when any session changes: the live view polls it."""
    rows = reader.rows(
        "SELECT count() AS n, toUnixTimestamp64Micro(max(updated_at)) AS last, sum(revision) AS revisions "
        "FROM transitions"
    )
    late = reader.rows("SELECT count() AS n FROM late_rewards")
    return (rows[0]["n"], rows[0]["last"], rows[0]["revisions"], late[0]["n"])


# ---- one session: the trace timeline --------------------------------------------------------------------------


def session_steps(reader: SqlReader, session: str) -> Rows:
    return reader.rows(
        "SELECT logical_event_id, step, episode_id, agent_id, policy_version, tool, tool_status, latency_ms, cost_usd, "
        "tokens_in, tokens_out, reward, reward_status, revision, reward_revision, "
        "toUnixTimestamp64Micro(dispatched_at) AS dispatched_us, toUnixTimestamp64Micro(result_at) AS result_us, "
        "toUnixTimestamp64Micro(updated_at) AS updated_us, reward_components.event_id AS woven_ids "
        "FROM transitions_latest WHERE session_id = {session:String} ORDER BY step, logical_event_id",
        session=session,
    )


def session_rewards(reader: SqlReader, session: str) -> Rows:
    """Every reward signal of the session, with its late verdict (if any) and how many copies ClickHouse holds.

    Copies: the same event_id sent twice lands as two raw rows until ClickHouse merges them; the worker ignores
    the second, and the timeline shows it as a duplicate while both rows are still there.
    """
    return reader.rows(
        "SELECT r.event_id AS event_id, r.logical_event_id AS logical_event_id, r.source AS source, r.name AS name, "
        "r.value AS value, r.confidence AS confidence, toUnixTimestamp64Micro(r.event_time) AS event_us, "
        "l.reason AS late_reason, l.lateness_ms AS lateness_ms, l.detail AS late_detail, "
        "greatest(c.copies, 1) AS copies "
        "FROM reward_components_latest AS r "
        "LEFT JOIN (SELECT event_id, reason, lateness_ms, detail FROM late_rewards_latest "
        "WHERE session_id = {session:String}) AS l ON l.event_id = r.event_id "
        "LEFT JOIN (SELECT event_id, count() AS copies FROM raw_events WHERE session_id = {session:String} "
        "AND kind = 'rewards' GROUP BY event_id) AS c ON c.event_id = r.event_id "
        "WHERE r.session_id = {session:String} ORDER BY r.event_time, r.event_id",
        session=session,
    )


def session_revisions(reader: SqlReader, session: str) -> Rows:
    """Every revision of every woven reward of the session (woven_rewards keeps them all)."""
    return reader.rows(
        "SELECT logical_event_id, revision, value, status, toUnixTimestamp64Micro(woven_at) AS woven_us "
        "FROM woven_rewards FINAL WHERE session_id = {session:String} ORDER BY logical_event_id, revision",
        session=session,
    )


def session_llm_calls(reader: SqlReader, session: str) -> Rows | None:
    """The session's LLM calls when an `llm_calls` table exists (another processor adds it); None when absent."""
    if not reader.has_table("llm_calls"):
        return None
    return reader.rows("SELECT * FROM llm_calls WHERE session_id = {session:String} LIMIT 500", session=session)


def session_fingerprint(reader: SqlReader, session: str) -> tuple[Any, ...]:
    rows = reader.rows(
        "SELECT count() AS n, sum(revision) AS revisions, toUnixTimestamp64Micro(max(updated_at)) AS last "
        "FROM transitions WHERE session_id = {session:String}",
        session=session,
    )
    late = reader.rows("SELECT count() AS n FROM late_rewards WHERE session_id = {session:String}", session=session)
    return (rows[0]["n"], rows[0]["revisions"], rows[0]["last"], late[0]["n"])


# ---- state explorer -------------------------------------------------------------------------------------------


def state_versions(reader: SqlReader, session: str, limit: int = 2000) -> Rows:
    return reader.rows(
        "SELECT ordinal, version_id, kind, tool, step, late, node_count, edge_count, node_changes, edge_changes, "
        "toUnixTimestamp64Micro(event_time) AS event_us FROM state_versions "
        "WHERE session_id = {session:String} ORDER BY ordinal LIMIT 1 BY ordinal LIMIT {limit:UInt32}",
        session=session,
        limit=limit,
    )


# ---- reward flow ----------------------------------------------------------------------------------------------


def reward_delays(reader: SqlReader, policy: str | None, per_source: int = 5000) -> Rows:
    """Arrival delays (reward event_time - dispatch event_time, seconds) per source, up to `per_source` each."""
    pv = " AND r.policy_version = {policy:String}" if policy else ""
    return reader.rows(
        "SELECT r.source AS source, r.name AS name, "
        "(toUnixTimestamp64Micro(r.event_time) - toUnixTimestamp64Micro(t.dispatched_at)) / 1e6 AS delay_s "
        "FROM reward_components_latest AS r INNER JOIN (SELECT logical_event_id, any(dispatched_at) AS dispatched_at "
        "FROM transitions GROUP BY logical_event_id) AS t ON t.logical_event_id = r.logical_event_id "
        f"WHERE 1 = 1{pv} LIMIT {{per_source:UInt32}} BY source",
        **({"policy": policy} if policy else {}),
        per_source=per_source,
    )


def reward_source_counts(reader: SqlReader, policy: str | None) -> Rows:
    """Per source: components received, late (AFTER_GRACE), orphans, conflicts and imputed components."""
    pv_r = "WHERE policy_version = {policy:String}" if policy else ""
    pv_w = "WHERE policy_version = {policy:String}" if policy else ""
    params = {"policy": policy} if policy else {}
    received = reader.rows(
        f"SELECT source, uniqExact(event_id) AS received FROM reward_components {pv_r} GROUP BY source", **params
    )
    late = reader.rows(
        "SELECT source, uniqExactIf(event_id, reason = 'AFTER_GRACE') AS late, "
        "uniqExactIf(event_id, reason = 'ORPHAN') - uniqExactIf(event_id, reason = 'ORPHAN_RESOLVED') AS orphans "
        f"FROM late_rewards {pv_r} GROUP BY source",
        **params,
    )
    conflicts = reader.rows(
        "SELECT `components.source`[indexOf(`components.event_id`, eid)] AS source, count() AS conflicts "
        f"FROM woven_rewards_latest ARRAY JOIN arrayConcat(`conflicts.a_event_id`, `conflicts.b_event_id`) AS eid "
        f"{pv_w} GROUP BY source",
        **params,
    )
    imputed = reader.rows(
        "SELECT src AS source, countIf(imp) AS imputed, count() AS woven FROM woven_rewards_latest "
        f"ARRAY JOIN `components.source` AS src, `components.imputed` AS imp {pv_w} GROUP BY source",
        **params,
    )
    by_source: dict[str, dict[str, Any]] = {}
    for rows in (received, late, conflicts, imputed):
        for row in rows:
            entry = by_source.setdefault(
                str(row["source"]),
                {"received": 0, "late": 0, "orphans": 0, "conflicts": 0, "imputed": 0, "woven": 0},
            )
            entry.update({k: v for k, v in row.items() if k != "source"})
    return [{"source": source, **counts} for source, counts in sorted(by_source.items())]


def policy_versions(reader: SqlReader) -> list[str]:
    rows = reader.rows("SELECT DISTINCT policy_version FROM transitions ORDER BY policy_version LIMIT 200")
    return [str(r["policy_version"]) for r in rows]


def agents(reader: SqlReader) -> list[str]:
    rows = reader.rows("SELECT DISTINCT agent_id FROM transitions ORDER BY agent_id LIMIT 200")
    return [str(r["agent_id"]) for r in rows]


# ---- dead letters ---------------------------------------------------------------------------------------------


def dead_letter_groups(reader: SqlReader) -> Rows:
    return reader.rows(
        "SELECT stage, reason, uniqExact(dead_letter_id) AS n, toUnixTimestamp64Micro(max(failed_at)) AS last_us "
        "FROM dead_letters GROUP BY stage, reason ORDER BY n DESC, stage, reason LIMIT 200"
    )


def dead_letter_rows(reader: SqlReader, stage: str | None, limit: int = 50) -> Rows:
    where = "WHERE stage = {stage:String}" if stage else ""
    return reader.rows(
        "SELECT dead_letter_id, stage, reason, topic, partition, offset, ifNull(session_id, '') AS session_id, "
        "ifNull(schema_name, '') AS schema_name, toUnixTimestamp64Micro(failed_at) AS failed_us, "
        "hex(ifNull(key, '')) AS key_hex, isNull(value) AS value_null, hex(ifNull(value, '')) AS value_hex "
        f"FROM dead_letters_latest {where} ORDER BY failed_at DESC, dead_letter_id LIMIT {{limit:UInt32}}",
        **({"stage": stage} if stage else {}),
        limit=limit,
    )
