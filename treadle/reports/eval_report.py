"""`treadle eval`: the evaluation tables (migrations 0007-0008) as one report, for people and for machines.

Every number comes from SQL against the eval_* views through `run_sql`, so the report works while a worker owns
embedded chDB, and it is the same number a user gets from `treadle sql`. The report reads the per-event and
per-episode views (eval_tool_calls, eval_episodes, eval_safety_*, eval_preferences), never the hourly rollups:
those are exact only for whole hours, and --since 24h rarely starts on one.

Each section filters on its own time column: tool calls, alerts and preferences on the event's event_time,
episodes on started_at, PII rates on the episode's first judged event. Bounds are half-open: since <= t < until.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sinks.sql_params import quote
from treadle.reports.query import Query, query_dicts

# Quantiles are ClickHouse's quantileExact: the value at 0-based index floor(q * n) of the sorted latencies.
LATENCY_QUANTILES = (0.5, 0.95, 0.99)
_BUCKETS = (60, 300, 900, 3600, 6 * 3600, 86_400, 7 * 86_400)
_MAX_BUCKETS = 48
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d|w)\s*$", re.IGNORECASE)
_UNITS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86_400, "w": 604_800}


class ReportError(Exception):
    """A mistake the user can fix (a bad time, nothing to report yet); the message is one line."""


@dataclass(frozen=True)
class ReportFilters:
    """Which rows the report covers: a half-open time range and, optionally, some policy versions."""

    since: datetime | None = None
    until: datetime | None = None
    policy_versions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ReportError(f"--since ({_iso(self.since)}) must be before --until ({_iso(self.until)})")

    def where(self, time_column: str, *extra: str) -> str:
        """A WHERE clause for a view whose time column is `time_column` (no user text reaches SQL unquoted)."""
        conditions = list(extra)
        if self.since is not None:
            conditions.append(f"{time_column} >= {_timestamp(self.since)}")
        if self.until is not None:
            conditions.append(f"{time_column} < {_timestamp(self.until)}")
        if self.policy_versions:
            conditions.append(f"policy_version IN ({', '.join(map(quote, self.policy_versions))})")
        return f"WHERE {' AND '.join(conditions)}" if conditions else ""

    def as_json(self) -> dict[str, Any]:
        return {
            "since": None if self.since is None else _iso(self.since),
            "until": None if self.until is None else _iso(self.until),
            "policy_versions": list(self.policy_versions),
        }


@dataclass
class Report:
    """The report's sections as lists of row dicts (column -> value), ready for JSON, tables and charts."""

    filters: ReportFilters
    tools: list[dict[str, Any]]
    episodes: list[dict[str, Any]]
    alerts_by_rule: list[dict[str, Any]]
    pii: list[dict[str, Any]]
    win_rates: list[dict[str, Any]]
    invalid_preferences: int
    bucket_seconds: int
    episode_series: list[dict[str, Any]]
    latency_series: list[dict[str, Any]]
    charts: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        sections = (self.tools, self.episodes, self.alerts_by_rule, self.pii, self.win_rates)
        return not any(sections) and not self.invalid_preferences

    def as_json(self) -> dict[str, Any]:
        return {
            "filters": self.filters.as_json(),
            "tools": self.tools,
            "episodes": self.episodes,
            "safety": {"alerts_by_rule": self.alerts_by_rule, "pii": self.pii},
            "preferences": {"win_rates": self.win_rates, "invalid_judgments": self.invalid_preferences},
            "series": {
                "bucket_seconds": self.bucket_seconds,
                "episodes": self.episode_series,
                "tool_latency": self.latency_series,
            },
            "charts": self.charts,
        }


# --- parsing ----------------------------------------------------------------------------------------------------


def parse_time(text: str, option: str, now: datetime) -> datetime:
    """An ISO time (naive means UTC) or a duration before `now` such as 30m, 24h, 7d; ReportError otherwise."""
    match = _DURATION.match(text)
    if match:
        return now - timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2).lower()])
    if text.strip().lower() == "now":
        return now
    try:
        parsed = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ReportError(
            f"cannot read {option} {text!r}: use an ISO time such as 2025-10-09T08:00Z or a duration ago "
            "such as 90m, 24h or 7d"
        ) from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def filters_from_options(
    since: str | None, until: str | None, policy_versions: Sequence[str], now: datetime | None = None
) -> ReportFilters:
    now = now or datetime.now(UTC)
    return ReportFilters(
        since=None if since is None else parse_time(since, "--since", now),
        until=None if until is None else parse_time(until, "--until", now),
        policy_versions=tuple(dict.fromkeys(v for v in policy_versions if v)),
    )


def bucket_seconds(span_seconds: float) -> int:
    """The smallest of 1 min, 5 min, 15 min, 1 h, 6 h, 1 d, 1 w that cuts the span into at most 48 buckets."""
    for size in _BUCKETS:
        if span_seconds / size <= _MAX_BUCKETS:
            return size
    return _BUCKETS[-1]


# --- SQL --------------------------------------------------------------------------------------------------------


def _timestamp(moment: datetime) -> str:
    utc = moment.astimezone(UTC)
    return f"toDateTime64('{utc:%Y-%m-%d %H:%M:%S.%f}', 6, 'UTC')"


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _quantiles(column: str, quantiles: Sequence[float] = LATENCY_QUANTILES) -> str:
    return ", ".join(f"quantileExact({q})({column}) AS latency_p{round(q * 100)}_ms" for q in quantiles)


def tool_sql(f: ReportFilters) -> str:
    return (
        "SELECT tool, agent_id, policy_version, count() AS calls, countIf(status = 'OK') AS ok, "
        "countIf(status = 'ERROR') AS errors, countIf(status = 'TIMEOUT') AS timeouts, "
        f"countIf(status = 'REJECTED') AS rejected, ok / calls AS success_rate, {_quantiles('latency_ms')} "
        f"FROM eval_tool_calls {f.where('event_time')} "
        "GROUP BY tool, agent_id, policy_version ORDER BY policy_version, tool, agent_id"
    )


def episode_sql(f: ReportFilters) -> str:
    """Per policy_version, over the episodes that started in range and ended (an open one is not final yet)."""
    return (
        "SELECT policy_version, countIf(ended) AS episodes, countIf(NOT ended) AS open_episodes, "
        "countIf(success) AS successes, if(episodes = 0, NULL, successes / episodes) AS success_rate, "
        "if(episodes = 0, NULL, avgIf(episode_return, ended)) AS mean_return, "
        "if(episodes = 0, NULL, avgIf(steps, ended)) AS mean_steps, "
        "sumIf(cost_usd, ended) AS total_cost_usd, if(episodes = 0, NULL, avgIf(cost_usd, ended)) AS mean_cost_usd, "
        "sumIf(tokens_in, ended) AS total_tokens_in, sumIf(tokens_out, ended) AS total_tokens_out, "
        "if(episodes = 0, NULL, avgIf(tokens_in, ended)) AS mean_tokens_in, "
        "if(episodes = 0, NULL, avgIf(tokens_out, ended)) AS mean_tokens_out "
        f"FROM eval_episodes {f.where('started_at')} GROUP BY policy_version ORDER BY policy_version"
    )


def alerts_sql(f: ReportFilters) -> str:
    return (
        "SELECT rule, severity, policy_version, count() AS alerts, uniqExact(session_id, episode_id) AS episodes "
        f"FROM eval_safety_alerts {f.where('event_time')} "
        "GROUP BY rule, severity, policy_version ORDER BY alerts DESC, rule, policy_version"
    )


def pii_sql(f: ReportFilters) -> str:
    return (
        "SELECT policy_version, count() AS episodes, sum(pii_checks) AS checks, sum(pii_leaks) AS leaks, "
        "leaks / checks AS leak_rate, avg(pii_leak_rate) AS mean_episode_leak_rate, "
        "countIf(pii_leaks > 0) AS episodes_with_leaks "
        f"FROM eval_safety_episodes {f.where('first_event_at', 'pii_checks > 0')} "
        "GROUP BY policy_version ORDER BY policy_version"
    )


def win_rate_sql(f: ReportFilters) -> str:
    return (
        "SELECT policy_version, opponent_policy_version, count() AS judgments, countIf(outcome = 'win') AS wins, "
        "countIf(outcome = 'loss') AS losses, countIf(outcome = 'tie') AS ties, "
        "(wins + 0.5 * ties) / judgments AS win_rate "
        f"FROM eval_preferences {f.where('event_time', 'valid')} "
        "GROUP BY policy_version, opponent_policy_version ORDER BY policy_version, opponent_policy_version"
    )


def invalid_preferences_sql(f: ReportFilters) -> str:
    return f"SELECT count() AS n FROM eval_preferences {f.where('event_time', 'NOT valid')}"


def span_sql(f: ReportFilters) -> str:
    """First and last time the charts cover: started_at of ended episodes and event_time of tool calls."""
    return (
        "SELECT count() AS n, toUnixTimestamp(min(t)) AS first, toUnixTimestamp(max(t)) AS last FROM ("
        f"SELECT started_at AS t FROM eval_episodes {f.where('started_at', 'ended')} "
        f"UNION ALL SELECT event_time AS t FROM eval_tool_calls {f.where('event_time')})"
    )


def _bucket(column: str, size: int) -> str:
    return f"intDiv(toUnixTimestamp({column}), {size}) * {size} AS bucket"


def episode_series_sql(f: ReportFilters, size: int) -> str:
    return (
        f"SELECT {_bucket('started_at', size)}, policy_version, count() AS episodes, "
        "countIf(success) AS successes, successes / episodes AS success_rate, avg(episode_return) AS mean_return, "
        "avg(cost_usd) AS mean_cost_usd "
        f"FROM eval_episodes {f.where('started_at', 'ended')} "
        "GROUP BY bucket, policy_version ORDER BY bucket, policy_version"
    )


def latency_series_sql(f: ReportFilters, size: int) -> str:
    return (
        f"SELECT {_bucket('event_time', size)}, policy_version, count() AS calls, "
        f"{_quantiles('latency_ms', (0.5, 0.95))} "
        f"FROM eval_tool_calls {f.where('event_time')} "
        "GROUP BY bucket, policy_version ORDER BY bucket, policy_version"
    )


# --- building ---------------------------------------------------------------------------------------------------


def _with_iso_buckets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**row, "bucket": _iso(datetime.fromtimestamp(int(row["bucket"]), UTC))} for row in rows]


def build_report(query: Query, filters: ReportFilters) -> Report:
    """Run the report's queries; ReportError when the tables are missing or hold nothing in range."""
    try:
        return _build(query, filters)
    except ReportError:
        raise
    except Exception as exc:
        text = str(exc)
        if "eval_" in text and ("Unknown table" in text or "UNKNOWN_TABLE" in text or "doesn't exist" in text):
            raise ReportError(
                "the evaluation tables do not exist yet: start `treadle worker` once (it applies the migrations)"
            ) from None
        raise


def _build(query: Query, filters: ReportFilters) -> Report:
    [span] = query_dicts(query, span_sql(filters))
    size = bucket_seconds(int(span["last"]) - int(span["first"])) if span["n"] else _BUCKETS[0]
    [invalid] = query_dicts(query, invalid_preferences_sql(filters))
    report = Report(
        filters=filters,
        tools=query_dicts(query, tool_sql(filters)),
        episodes=query_dicts(query, episode_sql(filters)),
        alerts_by_rule=query_dicts(query, alerts_sql(filters)),
        pii=query_dicts(query, pii_sql(filters)),
        win_rates=query_dicts(query, win_rate_sql(filters)),
        invalid_preferences=int(invalid["n"]),
        bucket_seconds=size,
        episode_series=_with_iso_buckets(query_dicts(query, episode_series_sql(filters, size))),
        latency_series=_with_iso_buckets(query_dicts(query, latency_series_sql(filters, size))),
    )
    if report.empty:
        raise ReportError(_nothing_in(filters))
    return report


def _nothing_in(filters: ReportFilters) -> str:
    parts = []
    if filters.since is not None:
        parts.append(f"since {_iso(filters.since)}")
    if filters.until is not None:
        parts.append(f"until {_iso(filters.until)}")
    if filters.policy_versions:
        parts.append(f"for policy version(s) {', '.join(filters.policy_versions)}")
    if not parts:
        return "no evaluation data yet: run agents (or `treadle demo`) with a worker, then try again"
    return f"no evaluation data {' '.join(parts)}: widen the time range or check --policy-version"


# --- terminal ---------------------------------------------------------------------------------------------------

# (title, rows attribute, [(column, header, format)]) per section; format is one of the _FORMATS keys.
_SECTIONS: tuple[tuple[str, str, tuple[tuple[str, str, str], ...]], ...] = (
    (
        "tool calls (per tool, agent, policy version)",
        "tools",
        (
            ("tool", "tool", "text"), ("agent_id", "agent", "text"), ("policy_version", "policy", "text"),
            ("calls", "calls", "int"), ("success_rate", "success", "rate"), ("errors", "errors", "int"),
            ("timeouts", "timeouts", "int"), ("latency_p50_ms", "p50 ms", "ms"), ("latency_p95_ms", "p95 ms", "ms"),
            ("latency_p99_ms", "p99 ms", "ms"),
        ),
    ),
    (
        "episodes (ended, by start time)",
        "episodes",
        (
            ("policy_version", "policy", "text"), ("episodes", "ended", "int"), ("open_episodes", "open", "int"),
            ("success_rate", "success", "rate"), ("mean_return", "mean return", "num"),
            ("mean_steps", "mean steps", "num"), ("mean_cost_usd", "cost/episode", "usd"),
            ("mean_tokens_in", "tokens in/ep", "num"), ("mean_tokens_out", "tokens out/ep", "num"),
            ("total_cost_usd", "total cost", "usd"),
        ),
    ),
    (
        "safety alerts by rule",
        "alerts_by_rule",
        (
            ("rule", "rule", "text"), ("severity", "severity", "text"), ("policy_version", "policy", "text"),
            ("alerts", "alerts", "int"), ("episodes", "episodes", "int"),
        ),
    ),
    (
        "PII leaks (per episode)",
        "pii",
        (
            ("policy_version", "policy", "text"), ("episodes", "episodes", "int"), ("checks", "tool results", "int"),
            ("leaks", "leaks", "int"), ("leak_rate", "leak rate", "rate"),
            ("mean_episode_leak_rate", "mean per episode", "rate"), ("episodes_with_leaks", "episodes leaking", "int"),
        ),
    ),
    (
        "preference win rate (policy vs opponent)",
        "win_rates",
        (
            ("policy_version", "policy", "text"), ("opponent_policy_version", "opponent", "text"),
            ("judgments", "judgments", "int"), ("wins", "wins", "int"), ("losses", "losses", "int"),
            ("ties", "ties", "int"), ("win_rate", "win rate", "rate"),
        ),
    ),
)  # fmt: skip

_FORMATS: dict[str, Callable[[Any], str]] = {
    "text": str,
    "int": lambda v: f"{int(v):,}",
    "rate": lambda v: f"{float(v):.1%}",
    "ms": lambda v: f"{float(v):,.1f}",
    "num": lambda v: f"{float(v):,.3g}" if abs(float(v)) >= 1000 else f"{float(v):.3f}",
    "usd": lambda v: f"${float(v):,.4f}",
}


def render(report: Report, console: Any) -> None:
    """One rich table per section (an empty section says so), then where the charts went."""
    from rich.table import Table

    console.print(f"[bold]evaluation[/bold] {_scope(report.filters)}", highlight=False)
    for title, attribute, columns in _SECTIONS:
        rows = getattr(report, attribute)
        if not rows:
            console.print(f"[dim]{title}: no data in range[/dim]")
            continue
        table = Table(title=title, show_header=True, header_style="bold", title_justify="left")
        for _, header, kind in columns:
            table.add_column(header, justify="left" if kind == "text" else "right")
        for row in rows:
            table.add_row(*[_cell(row[column], kind) for column, _, kind in columns])
        console.print(table)
    if report.invalid_preferences:
        console.print(
            f"[yellow]{report.invalid_preferences} preference signal(s) left out of the win rate[/yellow] "
            "(value not 0, 0.5 or 1, or no opponent_policy_version attribute): see eval_preferences WHERE NOT valid"
        )
    for path in report.charts:
        console.print(f"chart: {path}", highlight=False)


def _cell(value: Any, kind: str) -> str:
    return "—" if value is None else _FORMATS[kind](value)


def _scope(filters: ReportFilters) -> str:
    since = "the beginning" if filters.since is None else _iso(filters.since)
    until = "now" if filters.until is None else _iso(filters.until)
    versions = ", ".join(filters.policy_versions) if filters.policy_versions else "all policy versions"
    return f"from {since} to {until}, {versions}"
