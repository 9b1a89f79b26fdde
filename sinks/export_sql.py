"""What a replay export selects: its shapes and filters as ClickHouse SQL, with every user value escaped.

A shape's query reads whole sessions: `shape_sql` takes an optional session range (lo, hi], so an export can
read a large table a range at a time (sinks' export module pages by it) and a trajectory is never cut in two.
Without a range it is the whole query, the one the manifest records and a test compares the output with.

Filters select *steps*, on the step's row in transitions_latest (its final revision):
- `since`/`until`: the step's dispatch time (trajectories: the episode's first dispatch), `until` exclusive;
- `policy_versions`, `agents`, `sessions`, `episodes`: any of the given values;
- `settled`: only steps whose required reward windows have all closed (reward_status is no longer `pending`:
  every required source arrived, or its window passed and it was marked partial or imputed);
- `statuses`: only these reward statuses (e.g. `complete`: every required source arrived);
- `min_confidence`: only steps whose every reward component has at least this confidence;
- `variant`: whose rows: `live` (the worker's, transitions_latest) or the name a re-weave or backfill wrote its rows
  under (transitions_variants, that variant's rows).
A trajectory is exported only if every one of its steps passes the step filters, so none is silently truncated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sinks.sql_params import quote

LIVE = "live"  # the variant of the worker's own rows
REWARD_STATUSES = ("pending", "complete", "partial", "imputed")
CREDIT_SOURCE = "credit"  # the source of the per-step shares of episode rewards (the credit processor)


class Shape(StrEnum):
    """What one exported row is."""

    TRANSITIONS = "transitions"  # one step (its final revision) with its reward components and credited reward
    TRAJECTORIES = "trajectories"  # one episode, its steps as lists, its return and success
    TRIPLETS = "triplets"  # one LLM call: prompt, completion, logprobs and the reward of its step


class ExportFilters(BaseModel):
    """Which steps an export reads (see the module docs for each filter's meaning)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    since: datetime | None = Field(default=None, description="Steps dispatched at or after this time (UTC).")
    until: datetime | None = Field(default=None, description="Steps dispatched before this time (UTC).")
    policy_versions: tuple[str, ...] = Field(default=(), description="Only these policy versions.")
    agents: tuple[str, ...] = Field(default=(), description="Only these agent ids.")
    sessions: tuple[str, ...] = Field(default=(), description="Only these session ids.")
    episodes: tuple[str, ...] = Field(default=(), description="Only these episode ids.")
    settled: bool = Field(default=False, description="Only steps whose required reward windows all closed.")
    statuses: tuple[str, ...] = Field(default=(), description="Only steps with these reward statuses.")
    min_confidence: float | None = Field(default=None, description="Every reward component at least this confident.")
    variant: str = Field(default=LIVE, description="Whose rows: live (the worker's) or a re-woven variant's name.")

    @field_validator("since", "until")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        return utc(value)

    @field_validator("statuses")
    @classmethod
    def _known_statuses(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [s for s in value if s not in REWARD_STATUSES]
        if unknown:
            raise ValueError(f"unknown reward status {unknown[0]!r}: use one of {', '.join(REWARD_STATUSES)}")
        return value

    @field_validator("min_confidence")
    @classmethod
    def _confidence(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ValueError(f"min_confidence must be in [0, 1], got {value}")
        return value


def utc(moment: datetime | None) -> datetime | None:
    """`moment` in UTC (a naive time is taken as UTC)."""
    if moment is None:
        return None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def timestamp(moment: datetime) -> str:
    """A DateTime64(6, 'UTC') literal."""
    utc = moment.astimezone(UTC) if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    return f"toDateTime64('{utc:%Y-%m-%d %H:%M:%S.%f}', 6, 'UTC')"


def _any_of(column: str, values: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(quote(v) for v in values)})"


def step_conditions(filters: ExportFilters, alias: str, time_filter: bool = True) -> list[str]:
    """The per-step predicates of `filters` on transitions_latest AS `alias`."""
    t = alias
    conditions = []
    if time_filter and filters.since is not None:
        conditions.append(f"{t}.dispatched_at >= {timestamp(filters.since)}")
    if time_filter and filters.until is not None:
        conditions.append(f"{t}.dispatched_at < {timestamp(filters.until)}")
    for column, values in (
        ("policy_version", filters.policy_versions),
        ("agent_id", filters.agents),
        ("session_id", filters.sessions),
        ("episode_id", filters.episodes),
    ):
        if values:
            conditions.append(_any_of(f"{t}.{column}", values))
    if filters.variant != LIVE:
        conditions.append(f"{t}.variant = {quote(filters.variant)}")
    conditions += quality_conditions(filters, t)
    return conditions


def steps_view(filters: ExportFilters) -> str:
    """Where the filtered steps' rows are: the live ones in transitions_latest, a variant's in transitions_variants."""
    return "transitions_latest" if filters.variant == LIVE else "transitions_variants"


def quality_conditions(filters: ExportFilters, alias: str) -> list[str]:
    """The predicates on a step's reward: settled, statuses, min_confidence."""
    conditions = []
    if filters.settled:
        conditions.append(f"{alias}.reward_status != 'pending'")
    if filters.statuses:
        conditions.append(_any_of(f"{alias}.reward_status", filters.statuses))
    if filters.min_confidence is not None:
        conditions.append(f"arrayAll(c -> c >= {filters.min_confidence!r}, {alias}.reward_components.confidence)")
    return conditions


SessionRange = tuple[str | None, str | None]  # (lo, hi]: after lo (None: from the start), up to hi (None: the end)


def session_range(column: str, sessions: SessionRange | None) -> list[str]:
    if sessions is None:
        return []
    lo, hi = sessions
    conditions = []
    if lo is not None:
        conditions.append(f"{column} > {quote(lo)}")
    if hi is not None:
        conditions.append(f"{column} <= {quote(hi)}")
    return conditions


def _where(conditions: list[str]) -> str:
    return "WHERE " + " AND ".join(conditions) if conditions else ""


def _credit(alias: str) -> str:
    """The step's credit-assigned reward: its `credit` components (shares of episode rewards), NULL if none."""
    c = f"{alias}.reward_components"
    return (
        f"if(has({c}.source, '{CREDIT_SOURCE}'), "
        f"arraySum(arrayFilter((v, s) -> s = '{CREDIT_SOURCE}', {c}.value, {c}.source)), NULL)"
    )


def transitions_sql(filters: ExportFilters, sessions: SessionRange | None = None) -> str:
    conditions = step_conditions(filters, "t") + session_range("t.session_id", sessions)
    return f"""SELECT
    t.session_id AS session_id, t.episode_id AS episode_id, t.step AS step, t.logical_event_id AS logical_event_id,
    t.revision AS revision, t.agent_id AS agent_id, t.policy_version AS policy_version, t.trace_id AS trace_id,
    t.tool AS tool, t.params_json AS params_json, t.dispatched_at AS dispatched_at, t.tool_status AS tool_status,
    t.output AS output, t.error AS error, t.latency_ms AS latency_ms, t.cost_usd AS cost_usd,
    t.tokens_in AS tokens_in, t.tokens_out AS tokens_out, t.result_at AS result_at,
    t.reward AS reward, t.reward_status AS reward_status, t.reward_revision AS reward_revision,
    {_credit("t")} AS credit_reward,
    t.reward_components.event_id AS component_event_ids, t.reward_components.source AS component_sources,
    t.reward_components.name AS component_names, t.reward_components.value AS component_values,
    t.reward_components.confidence AS component_confidences, t.reward_components.weight AS component_weights,
    t.reward_components.annotator AS component_annotators, t.reward_components.event_time AS component_event_times,
    t.updated_at AS updated_at
FROM {steps_view(filters)} AS t
{_where(conditions)}
ORDER BY session_id, step, logical_event_id"""


def trajectories_sql(filters: ExportFilters, sessions: SessionRange | None = None) -> str:
    """One row per episode: its steps in step order as lists; the return is the sum of the steps' rewards."""
    within = step_conditions(filters, "t", time_filter=False)
    quality = quality_conditions(filters, "t")
    selection = [c for c in within if c not in quality] + session_range("t.session_id", sessions)
    passes = " AND ".join(quality) if quality else "1"
    having = [f"countIf(NOT ({passes})) = 0"]
    if filters.since is not None:
        having.append(f"min(t.dispatched_at) >= {timestamp(filters.since)}")
    if filters.until is not None:
        having.append(f"min(t.dispatched_at) < {timestamp(filters.until)}")
    ended = session_range("l.session_id", sessions)
    return f"""SELECT
    e.session_id AS session_id, e.episode_id AS episode_id, e.agent_id AS agent_id,
    e.policy_version AS policy_version, e.started_at AS started_at, e.steps AS steps,
    arrayMap(x -> x.1, e.s) AS step, arrayMap(x -> x.2, e.s) AS logical_event_id, arrayMap(x -> x.3, e.s) AS tool,
    arrayMap(x -> x.4, e.s) AS params_json, arrayMap(x -> x.5, e.s) AS tool_status, arrayMap(x -> x.6, e.s) AS output,
    arrayMap(x -> x.7, e.s) AS reward, arrayMap(x -> x.8, e.s) AS reward_status,
    arrayMap(x -> x.9, e.s) AS credit_reward,
    e.episode_return AS episode_return, e.credited_return AS credited_return, e.rewarded_steps AS rewarded_steps,
    ifNull(o.ended, false) AS ended, ifNull(o.done, false) AS done, ifNull(o.truncated, false) AS truncated,
    ifNull(o.done, false) AND NOT ifNull(o.truncated, false) AS success
FROM
(
    SELECT
        t.session_id AS session_id, t.episode_id AS episode_id,
        argMin(t.agent_id, t.step) AS agent_id, argMin(t.policy_version, t.step) AS policy_version,
        min(t.dispatched_at) AS started_at, count() AS steps,
        arraySort(x -> (x.1, x.2), groupArray(tuple(
            t.step, t.logical_event_id, toString(t.tool), t.params_json, CAST(t.tool_status AS Nullable(String)),
            t.output, t.reward, toString(t.reward_status), {_credit("t")}))) AS s,
        sum(ifNull(t.reward, 0)) AS episode_return,
        sum(ifNull({_credit("t")}, 0)) AS credited_return,
        countIf(t.reward IS NOT NULL) AS rewarded_steps
    FROM {steps_view(filters)} AS t
    {_where(selection)}
    GROUP BY t.session_id, t.episode_id
    HAVING {" AND ".join(having)}
) AS e
LEFT JOIN
(
    SELECT
        l.session_id AS session_id, l.episode_id AS episode_id, true AS ended,
        argMax(JSONExtract(l.payload_json, 'done', 'Bool'), (l.event_time, l.event_id)) AS done,
        argMax(JSONExtract(l.payload_json, 'truncated', 'Bool'), (l.event_time, l.event_id)) AS truncated
    FROM raw_events_latest AS l
    {_where(["l.kind = 'lifecycle'", "JSONExtractString(l.payload_json, 'kind') = 'EPISODE_ENDED'", *ended])}
    GROUP BY l.session_id, l.episode_id
) AS o ON o.session_id = e.session_id AND o.episode_id = e.episode_id
ORDER BY session_id, started_at, episode_id"""


def triplets_sql(filters: ExportFilters, sessions: SessionRange | None = None) -> str:
    """One row per LLM call whose step has a transition row, with that step's reward."""
    steps = step_conditions(filters, "t") + session_range("t.session_id", sessions)
    calls = session_range("c.session_id", sessions)
    if filters.sessions:
        calls.append(_any_of("c.session_id", filters.sessions))
    return f"""SELECT
    c.session_id AS session_id, c.episode_id AS episode_id, s.step AS step, c.logical_event_id AS logical_event_id,
    c.event_id AS llm_call_id, c.seq AS seq, c.event_time AS event_time, c.agent_id AS agent_id,
    c.policy_version AS policy_version, c.provider AS provider, c.model AS model, c.response_id AS response_id,
    c.choice_index AS choice_index, c.messages_json AS messages_json, c.prompt_text AS prompt_text,
    c.prompt_token_ids AS prompt_token_ids, c.completion_text AS completion_text,
    c.completion_token_ids AS completion_token_ids, c.completion_logprobs AS completion_logprobs,
    c.tool_calls_json AS tool_calls_json, c.finish_reason AS finish_reason, c.temperature AS temperature,
    c.top_p AS top_p, c.seed AS seed, s.tool AS tool, s.tool_status AS tool_status, s.reward AS reward,
    s.reward_status AS reward_status, s.reward_revision AS reward_revision, s.credit_reward AS credit_reward,
    s.calls_in_step AS calls_in_step
FROM llm_calls_latest AS c
INNER JOIN
(
    SELECT
        t.session_id AS session_id, t.logical_event_id AS logical_event_id, t.step AS step, t.tool AS tool,
        t.tool_status AS tool_status, t.reward AS reward, t.reward_status AS reward_status,
        t.reward_revision AS reward_revision, {_credit("t")} AS credit_reward, n.calls AS calls_in_step
    FROM {steps_view(filters)} AS t
    INNER JOIN
    (
        SELECT c.session_id AS session_id, c.logical_event_id AS logical_event_id, count() AS calls
        FROM llm_calls_latest AS c
        {_where(calls)}
        GROUP BY c.session_id, c.logical_event_id
    ) AS n ON n.session_id = t.session_id AND n.logical_event_id = t.logical_event_id
    {_where(steps)}
) AS s ON s.session_id = c.session_id AND s.logical_event_id = c.logical_event_id
{_where(calls)}
ORDER BY session_id, logical_event_id, llm_call_id"""


_BUILDERS = {Shape.TRANSITIONS: transitions_sql, Shape.TRAJECTORIES: trajectories_sql, Shape.TRIPLETS: triplets_sql}
# The table whose rows a page counts to find its session range (raw revisions: only a size estimate).
PAGE_TABLE = {Shape.TRANSITIONS: "transitions", Shape.TRAJECTORIES: "transitions", Shape.TRIPLETS: "llm_calls"}


def shape_sql(shape: Shape, filters: ExportFilters, sessions: SessionRange | None = None) -> str:
    """The shape's query under `filters`, for the session range `sessions` (None: every session)."""
    return _BUILDERS[Shape(shape)](filters, sessions)


def page_end_sql(shape: Shape, after: str | None, rows: int) -> str:
    """The session that ends a page of about `rows` rows after session `after`: the session of the row `rows` on.

    Reads only the sort key's first column in order, so a page boundary costs little next to the page.
    """
    start = _where(session_range("session_id", (after, None)))
    return f"SELECT session_id FROM {PAGE_TABLE[Shape(shape)]} {start} ORDER BY session_id LIMIT 1 OFFSET {int(rows)}"
