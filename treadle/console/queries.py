"""The console's SQL: every statement it runs, with user values only as `{name:Type}` bound parameters.

All of them go through `sinks.sql_client.run_sql` (the read-only guard, and the sink's SQL service while a worker
owns embedded chDB), so the console never opens a second writer. Times come back as UTC micros (integers) so rows
read the same through the sink's JSON endpoint and straight from chDB. Sort columns are picked from a fixed map,
never from the request.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from sinks.sql_client import run_sql
from topics.settings import Settings
from treadle.console.params import SessionFilter

Rows = list[dict[str, Any]]
T = TypeVar("T")
_ONE_AT_A_TIME = threading.Lock()


def one_at_a_time(fn: Callable[..., T], *args: Any) -> T:
    """Run `fn` while no other console read runs. With no worker, run_sql opens embedded chDB in this process for
    each statement, and chDB must not be opened or called from two threads at once; through the sink's service the
    sink runs one statement at a time anyway, so this costs nothing there."""
    with _ONE_AT_A_TIME:
        return fn(*args)


RawRunner = Callable[..., tuple[list[str], list[list[Any]]]]  # (query, params=...) -> (columns, rows)


# Tables that hold re-woven variants (`treadle reweave`) beside the worker's own rows; the console shows the live ones.
_VARIANT_TABLES = re.compile(r"\bFROM (transitions|woven_rewards|reward_components|late_rewards)( FINAL)?(?![\w.])")


def live_rows_only(query: str) -> str:
    """`query` with every read of a variant table narrowed to the live rows (a subquery under the table's name)."""
    return _VARIANT_TABLES.sub(
        lambda m: f"FROM (SELECT * FROM {m[1]}{m[2] or ''} WHERE variant = 'live') AS {m[1]}", query
    )


class SqlReader:
    """Runs the console's read-only statements, one call per statement, and hands rows back as dicts."""

    def __init__(self, settings: Settings, runner: RawRunner | None = None, timeout: float = 30.0) -> None:
        self.settings = settings
        self._run = runner or partial(run_sql, settings, timeout=timeout)

    def rows(self, query: str, **params: Any) -> Rows:
        columns, rows = self._run(live_rows_only(query), params=params or None)
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


def _session_filters(f: SessionFilter) -> tuple[list[str], list[str], dict[str, Any]]:
    """(WHERE conditions on steps, HAVING conditions on a session's steps, bound values) of the filters."""
    where, having, params = [], [], {}
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
    return where, having, params


def _clause(keyword: str, conditions: list[str]) -> str:
    return f"{keyword} " + " AND ".join(conditions) if conditions else ""


def _session_steps_sql(f: SessionFilter) -> tuple[str, dict[str, Any]]:
    """Per session with at least one step matching the filters: agent, policies, first and last change, steps."""
    where, having, params = _session_filters(f)
    query = f"""
    SELECT session_id, any(agent_id) AS agent, min(policy_version) AS first_policy, max(policy_version) AS last_policy,
        toUnixTimestamp64Micro(min(dispatched_at)) AS started_us, toUnixTimestamp64Micro(max(updated_at)) AS last_us,
        count() AS steps
    FROM transitions FINAL
    {_clause("WHERE", where)}
    GROUP BY session_id
    {_clause("HAVING", having)}"""
    return query, params


def total_sql(f: SessionFilter) -> tuple[str, dict[str, Any]]:
    """How many sessions match the filters other than status (no FINAL: a replayed row names the same session)."""
    where, having, params = _session_filters(f)
    if not having:
        return f"SELECT uniqExact(session_id) AS total FROM transitions {_clause('WHERE', where)}", params
    return (
        f"SELECT count() AS total FROM (SELECT session_id FROM transitions {_clause('WHERE', where)} "
        f"GROUP BY session_id {_clause('HAVING', having)})",
        params,
    )


def _session_counts_sql(only_page: bool) -> str:
    """Dead letters, late rewards, orphans and the last lifecycle kind per session (of the page's ids, or all)."""
    ids = " AND session_id IN {ids:Array(String)}" if only_page else ""
    return f"""
LEFT JOIN (
    SELECT assumeNotNull(session_id) AS session_id, uniqExact(dead_letter_id) AS n FROM dead_letters
    WHERE session_id IS NOT NULL{ids} GROUP BY session_id
) AS d ON d.session_id = s.session_id
LEFT JOIN (
    SELECT session_id, uniqExactIf(event_id, reason = 'AFTER_GRACE') AS late,
        uniqExactIf(event_id, reason = 'ORPHAN') - uniqExactIf(event_id, reason = 'ORPHAN_RESOLVED') AS orphans
    FROM late_rewards WHERE 1 = 1{ids} GROUP BY session_id
) AS l ON l.session_id = s.session_id
LEFT JOIN (
    SELECT session_id, argMax(JSONExtractString(payload_json, 'kind'), seq) AS last_kind
    FROM raw_events WHERE kind = 'lifecycle'{ids} GROUP BY session_id
) AS e ON e.session_id = s.session_id"""


_SESSION_COLUMNS = f"""s.session_id AS session_id, s.agent AS agent_id, s.first_policy AS first_policy,
    s.last_policy AS last_policy, s.started_us AS started_us, s.last_us AS last_us, s.steps AS steps,
    d.n AS dead_letters, l.late AS late_rewards, l.orphans AS orphans,
    if(e.last_kind IN {_ENDED_KINDS}, 'ended', 'open') AS status"""


def sessions_sql(f: SessionFilter) -> tuple[str, dict[str, Any]]:
    """One page of sessions (sessions with at least one step) and the total that match, with their bound values.

    A session is `ended` when its last lifecycle event (by seq) is EPISODE_ENDED, SESSION_CLOSED or
    SESSION_ARCHIVED. A LEFT JOIN without a match reads 0 or '' (join_use_nulls is 0: readonly mode may not
    change it). Steps are counted on transitions FINAL (one row per step), which on chDB costs half of uniqExact over
    the step ids and a tenth of collecting each session's policy versions (min and max stand in for the list).
    This form joins the counts of every session, for sorting or filtering by them; `page_sql` and `counts_sql`
    are the faster pair for everything else.
    """
    inner, params = _session_steps_sql(f)
    outer = ""
    if f.status != "any":
        outer = "WHERE status = {status:String}"
        params["status"] = f.status
    params["limit"], params["offset"] = f.size, (f.page - 1) * f.size
    direction = "ASC" if f.order == "asc" else "DESC"
    query = f"""
SELECT {_SESSION_COLUMNS}, count() OVER () AS total
FROM ({inner}
) AS s{_session_counts_sql(only_page=False)}
{outer}
ORDER BY {SESSION_SORTS[f.sort]} {direction}, session_id {direction}
LIMIT {{limit:UInt32}} OFFSET {{offset:UInt64}}"""
    return query, params


def page_sql(f: SessionFilter) -> tuple[str, dict[str, Any]]:
    """The page's sessions sorted by a column of their steps, one more than a page (is there a next one?).

    No counts joined and no total: a `count() OVER ()` over 100k sessions cost as much as the page itself.
    """
    inner, params = _session_steps_sql(f)
    params["limit"], params["offset"] = f.size + 1, (f.page - 1) * f.size
    direction = "ASC" if f.order == "asc" else "DESC"
    sort = {"session": "session_id", "agent": "agent"}.get(f.sort, SESSION_SORTS[f.sort])
    query = f"""
SELECT * FROM ({inner}
)
ORDER BY {sort} {direction}, session_id {direction}
LIMIT {{limit:UInt32}} OFFSET {{offset:UInt64}}"""
    return query, params


def counts_sql() -> str:
    """The counts and status of the sessions in {ids:Array(String)}, as `sessions_sql` joins them."""
    return f"""
SELECT {_SESSION_COLUMNS}
FROM (SELECT arrayJoin({{ids:Array(String)}}) AS session_id, '' AS agent, '' AS first_policy, '' AS last_policy,
    0 AS started_us, 0 AS last_us, 0 AS steps) AS s{_session_counts_sql(only_page=True)}"""


@dataclass(frozen=True)
class SessionPage:
    rows: Rows
    total: int
    filter: SessionFilter

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // self.filter.size))


_COUNT_COLUMNS = ("dead_letters", "late_rewards", "orphans", "status")


def sessions(reader: SqlReader, f: SessionFilter) -> SessionPage:
    """A page of sessions. Sorted by a column of the steps (the usual case) and without a status filter, it picks
    the page first, joins the counts of its sessions only, and counts the matches in a query of its own: on 100k
    sessions that is about half the work of joining every session's counts, which sorting or filtering by a count
    needs (sessions_sql)."""
    if f.status == "any" and f.sort not in ("dead_letters", "late"):
        query, params = page_sql(f)
        rows = reader.rows(query, **params)[: f.size]
        if rows:
            counts = {r["session_id"]: r for r in reader.rows(counts_sql(), ids=[r["session_id"] for r in rows])}
            rows = [{**r, "agent_id": r.pop("agent"), **{k: counts[r["session_id"]][k] for k in _COUNT_COLUMNS}}
                    for r in rows]  # fmt: skip
        query, params = total_sql(f)
        return SessionPage(rows, int(reader.rows(query, **params)[0]["total"]), f)
    query, params = sessions_sql(f)
    rows = reader.rows(query, **params)
    total = int(rows[0]["total"]) if rows else 0
    if not rows and f.page > 1:  # past the end: count what matches for the pager
        first = f.model_copy(update={"page": 1, "size": 5})
        query, params = sessions_sql(first)
        again = reader.rows(query, **params)
        total = int(again[0]["total"]) if again else 0
    return SessionPage(rows, total, f)


def sessions_fingerprint(reader: SqlReader) -> tuple[Any, ...]:
    """What changes when any session changes: the live view polls it."""
    rows = reader.rows(
        "SELECT count() AS n, toUnixTimestamp64Micro(max(updated_at)) AS last, sum(revision) AS revisions "
        "FROM transitions"
    )
    others = reader.rows(
        "SELECT (SELECT count() FROM late_rewards) AS late, (SELECT count() FROM dead_letters) AS dead, "
        "(SELECT count() FROM raw_events WHERE kind = 'lifecycle') AS lifecycle"
    )
    return (rows[0]["n"], rows[0]["last"], rows[0]["revisions"], *others[0].values())


# ---- one session: the trace timeline --------------------------------------------------------------------------


STEPS_SHOWN = 1000  # a timeline draws one lane per step; beyond this the page says so


def session_steps(reader: SqlReader, session: str, limit: int = STEPS_SHOWN) -> Rows:
    """The session's first `limit` steps (current rows), in step order."""
    return reader.rows(
        "SELECT logical_event_id, step, episode_id, agent_id, policy_version, tool, tool_status, latency_ms, cost_usd, "
        "tokens_in, tokens_out, reward, reward_status, revision, reward_revision, "
        "toUnixTimestamp64Micro(dispatched_at) AS dispatched_us, toUnixTimestamp64Micro(result_at) AS result_us, "
        "toUnixTimestamp64Micro(updated_at) AS updated_us, reward_components.event_id AS woven_ids "
        "FROM transitions_latest WHERE session_id = {session:String} ORDER BY step, logical_event_id "
        "LIMIT {limit:UInt32}",
        session=session,
        limit=limit,
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


LLM_CALL_COLUMNS = ("logical_event_id", "event_time", "provider", "model", "finish_reason", "prompt_tokens",
                    "completion_tokens", "latency_ms", "cost_usd", "completion_text")  # fmt: skip


def session_llm_calls(reader: SqlReader, session: str, limit: int = 500) -> Rows:
    """The session's LLM calls: only summary columns (never token ids or whole prompts), each cut to 120 characters."""
    shown = ", ".join(f"leftUTF8(toString(`{c}`), 120) AS `{c}`" for c in LLM_CALL_COLUMNS)
    return reader.rows(
        f"SELECT {shown} FROM llm_calls_latest WHERE session_id = {{session:String}} ORDER BY event_time "
        "LIMIT {limit:UInt32}",
        session=session,
        limit=limit,
    )


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
    """Arrival delays after dispatch (seconds) of the rewards woven in time, up to `per_source` per source.

    Read from each step's current transition (its components carry their event time beside the dispatch time), so
    no join: on 800,000 steps a join of reward_components to the dispatches took a second. Late rewards are not
    components; `late_delays` adds them.
    """
    pv = "AND policy_version = {policy:String} " if policy else ""
    return reader.rows(
        "SELECT src AS source, nm AS name, "
        "(toUnixTimestamp64Micro(at) - toUnixTimestamp64Micro(dispatched_at)) / 1e6 AS delay_s FROM transitions FINAL "
        "ARRAY JOIN `reward_components.source` AS src, `reward_components.name` AS nm, "
        "`reward_components.event_time` AS at, `reward_components.imputed` AS imp "
        f"WHERE NOT imp {pv}LIMIT {{per_source:UInt32}} BY src",
        **({"policy": policy} if policy else {}),
        per_source=per_source,
    )


def late_delays(reader: SqlReader, policy: str | None, per_source: int = 5000) -> Rows:
    """Late rewards (AFTER_GRACE) per source with how late they were past their deadline, in seconds."""
    pv = "AND policy_version = {policy:String} " if policy else ""
    return reader.rows(
        "SELECT source, name, lateness_ms / 1000 AS late_s FROM late_rewards FINAL "
        f"WHERE reason = 'AFTER_GRACE' {pv}LIMIT {{per_source:UInt32}} BY source",
        **({"policy": policy} if policy else {}),
        per_source=per_source,
    )


def reward_source_counts(reader: SqlReader, policy: str | None) -> Rows:
    """Per source: rewards received, late (AFTER_GRACE), orphans, components in conflicts, imputed components.

    Conflicts count (step, component) pairs named in any woven revision's conflicts (a later revision only adds
    components, so this is the latest revision's); imputation is read from each step's current transition.
    """
    where = "WHERE policy_version = {policy:String}" if policy else ""
    also = "AND policy_version = {policy:String}" if policy else ""
    params = {"policy": policy} if policy else {}
    received = reader.rows(
        f"SELECT source, count() AS received FROM reward_components FINAL {where} GROUP BY source", **params
    )
    late = reader.rows(
        "SELECT source, uniqExactIf(event_id, reason = 'AFTER_GRACE') AS late, "
        "uniqExactIf(event_id, reason = 'ORPHAN') - uniqExactIf(event_id, reason = 'ORPHAN_RESOLVED') AS orphans "
        f"FROM late_rewards {where} GROUP BY source",
        **params,
    )
    conflicts = reader.rows(
        "SELECT `components.source`[indexOf(`components.event_id`, eid)] AS source, "
        "uniqExact(logical_event_id, eid) AS conflicts FROM woven_rewards "
        "ARRAY JOIN arrayConcat(`conflicts.a_event_id`, `conflicts.b_event_id`) AS eid "
        f"WHERE notEmpty(`conflicts.a_event_id`) {also} GROUP BY source",
        **params,
    )
    imputed = reader.rows(
        "SELECT src AS source, countIf(imp) AS imputed, count() AS woven FROM transitions FINAL "
        f"ARRAY JOIN `reward_components.source` AS src, `reward_components.imputed` AS imp {where} GROUP BY source",
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


MAX_DECODED_BYTES = 65_536  # a dead letter's value can be ~1 MB; larger ones are shown, not decoded


def dead_letter_rows(reader: SqlReader, stage: str | None, limit: int = 50) -> Rows:
    """The latest dead letters (of a stage), their raw key and the first MAX_DECODED_BYTES of the value as hex."""
    where = "WHERE stage = {stage:String}" if stage else ""
    return reader.rows(
        "SELECT dead_letter_id, stage, reason, topic, partition, offset, ifNull(session_id, '') AS session_id, "
        "ifNull(schema_name, '') AS schema_name, toUnixTimestamp64Micro(failed_at) AS failed_us, "
        "hex(substring(ifNull(key, ''), 1, 200)) AS key_hex, isNull(value) AS value_null, "
        "length(ifNull(value, '')) AS value_size, "
        "hex(substring(ifNull(value, ''), 1, {max_bytes:UInt32})) AS value_hex "
        f"FROM dead_letters_latest {where} ORDER BY failed_at DESC, dead_letter_id LIMIT {{limit:UInt32}}",
        **({"stage": stage} if stage else {}),
        limit=limit,
        max_bytes=MAX_DECODED_BYTES,
    )
