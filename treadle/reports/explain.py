"""`treadle explain <logical_event_id>`: how a step's reward was made, from what ClickHouse stored.

Everything comes from one read-only query (woven_rewards + the step's transitions_latest row) through the same
`run_sql` as `treadle sql`, so it works whether the worker's sink owns embedded chDB or a server is used, and
costs one round trip. Rows written before the explanation columns existed (migration 0010) read as defaults;
their contributions are recomputed as weight x value, which is what fusion did then.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table

from sinks.sql_params import quote as sql_literal
from treadle.reports.query import Query, as_dicts

_TRANSITION_FIELDS = ("step", "revision", "agent_id", "tool", "tool_status", "reward", "reward_status")
_TRANSITION_FIELDS += ("reward_revision", "policy_version", "updated_at")


class ExplainError(Exception):
    """Nothing to explain for that id (or revision); the message is the one line the CLI prints."""


@dataclass(frozen=True)
class ComponentLine:
    event_id: str
    source: str
    name: str
    annotator: str
    value: float
    adjusted_value: float
    weight: float
    confidence: float
    contribution: float
    lateness_ms: int
    evidence: str | None
    imputed: bool
    event_time: str


@dataclass(frozen=True)
class ConflictLine:
    a_event_id: str
    b_event_id: str
    a_value: float
    b_value: float
    difference: float


@dataclass(frozen=True)
class Explanation:
    logical_event_id: str
    session_id: str
    episode_id: str
    step: int
    revision: int
    revisions: list[int]
    value: float
    status: str
    fusion: str
    policy_version: str
    reward_policy_version: str
    woven_at: str
    components: list[ComponentLine]
    rules_fired: list[str]
    rule_adjustment: float  # value minus the components' contributions: what cap/veto rules changed
    conflicts: list[ConflictLine]
    imputed: list[str]
    transition: dict[str, Any] | None = field(default=None)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def explain_query(logical_event_id: str, revision: int | None = None) -> str:
    lid = sql_literal(logical_event_id)
    pick = "" if revision is None else f" AND revision = {int(revision)}"
    transition = ", ".join(f"t.{name} AS t_{name}" for name in _TRANSITION_FIELDS)
    return (
        f"SELECT w.*, t.found AS t_found, {transition}, "
        f"(SELECT groupArray(r) FROM (SELECT DISTINCT revision AS r FROM woven_rewards "
        f"WHERE logical_event_id = {lid} AND variant = 'live' ORDER BY r)) AS revisions "
        f"FROM (SELECT * FROM woven_rewards FINAL WHERE logical_event_id = {lid} AND variant = 'live'{pick} "
        f"ORDER BY revision DESC, session_id LIMIT 1) AS w "
        f"LEFT JOIN (SELECT 1 AS found, session_id, {', '.join(_TRANSITION_FIELDS)} FROM transitions_latest "
        f"WHERE logical_event_id = {lid}) AS t ON t.session_id = w.session_id"
    )


def fetch_explanation(query: Query, logical_event_id: str, revision: int | None = None) -> Explanation:
    """The explanation of the latest (or the given) revision of the step's woven reward."""
    columns, rows = query(explain_query(logical_event_id, revision))
    if not rows:
        if revision is not None:
            raise ExplainError(f"no woven reward for logical_event_id {logical_event_id} at revision {revision}")
        raise ExplainError(f"no woven reward for logical_event_id {logical_event_id}")
    return explanation_from_row(as_dicts(columns, rows)[0])


def explanation_from_row(row: Mapping[str, Any]) -> Explanation:
    """An Explanation from one row of `explain_query` (column names as ClickHouse returns them)."""
    row = {name.removeprefix("w."): value for name, value in row.items()}

    def column(name: str, default: Any = None) -> Any:
        value = row.get(name)
        return default if value is None else value

    ids: Sequence[str] = column("components.event_id", [])
    n = len(ids)

    def sub(name: str, default: Any) -> list[Any]:
        values = list(column(f"components.{name}", []))
        return values if len(values) == n else [default] * n

    components = []
    for i, event_id in enumerate(ids):
        value, weight = float(sub("value", 0.0)[i]), float(sub("weight", 0.0)[i])
        adjusted = sub("adjusted_value", None)[i]
        # adjusted_value NULL: written before fusion rules, when a contribution was simply weight x value.
        contribution = float(sub("contribution", 0.0)[i]) if adjusted is not None else weight * value
        components.append(
            ComponentLine(
                event_id=str(event_id),
                source=sub("source", "")[i],
                name=sub("name", "")[i],
                annotator=sub("annotator", "")[i],
                value=value,
                adjusted_value=value if adjusted is None else float(adjusted),
                weight=weight,
                confidence=float(sub("confidence", 0.0)[i]),
                contribution=contribution,
                lateness_ms=int(sub("lateness_ms", 0)[i]),
                evidence=sub("evidence", None)[i],
                imputed=bool(sub("imputed", False)[i]),
                event_time=_time(sub("event_time", "")[i]),
            )
        )
    conflicts = [
        ConflictLine(str(a), str(b), float(av), float(bv), float(d))
        for a, b, av, bv, d in zip(
            column("conflicts.a_event_id", []),
            column("conflicts.b_event_id", []),
            column("conflicts.a_value", []),
            column("conflicts.b_value", []),
            column("conflicts.difference", []),
            strict=True,
        )
    ]
    value = float(row["value"])
    adjustment = value - sum(c.contribution for c in components)
    transition = None
    if column("t_found", 0):
        transition = {name: _plain(row.get(f"t_{name}")) for name in _TRANSITION_FIELDS}
    return Explanation(
        logical_event_id=row["logical_event_id"],
        session_id=row["session_id"],
        episode_id=row["episode_id"],
        step=int(row["step"]),
        revision=int(row["revision"]),
        revisions=[int(r) for r in column("revisions", [])],
        value=value,
        status=row["status"],
        fusion=row["fusion"],
        policy_version=column("policy_version", ""),
        reward_policy_version=column("reward_policy_version", ""),
        woven_at=_time(row["woven_at"]),
        components=components,
        rules_fired=list(column("rules_fired", [])),
        rule_adjustment=adjustment if abs(adjustment) > 1e-12 else 0.0,
        conflicts=conflicts,
        imputed=list(column("imputed", [])),
        transition=transition,
    )


def _time(value: Any) -> str:
    # ISO text either way: straight from chDB a datetime, through the sink's endpoint orjson's RFC 3339 string.
    return value.isoformat() if isinstance(value, datetime) else str(value)


def _plain(value: Any) -> Any:
    return _time(value) if isinstance(value, datetime) else value


def _num(value: float) -> str:
    return f"{value:.4g}"


def render(explanation: Explanation, console: Console) -> None:
    """The explanation as a person reads it: header, one row per component, rules, conflicts, imputed parts."""
    e = explanation
    older = f" of {', '.join(map(str, e.revisions))}" if e.revisions and e.revisions[-1] != e.revision else ""
    console.print(
        f"[bold]{e.logical_event_id}[/bold]  session {e.session_id}  episode {e.episode_id}  step {e.step}",
        highlight=False,
    )
    console.print(
        f"reward [bold]{_num(e.value)}[/bold]  status {e.status}  revision {e.revision}{older}  fusion {e.fusion}",
        highlight=False,
    )
    console.print(
        f"reward policy {e.reward_policy_version or '-'}  agent policy {e.policy_version or '-'}  "
        f"woven at {e.woven_at}",
        highlight=False,
    )
    if e.transition is not None:
        t = e.transition
        reward = "-" if t["reward"] is None else _num(float(t["reward"]))
        console.print(
            f"transition revision {t['revision']}: {t['tool']} ({t['tool_status'] or 'no result yet'}), "
            f"reward {reward} ({t['reward_status']}, woven revision {t['reward_revision']})",
            highlight=False,
        )
    by_id = {c.event_id: c for c in e.components}
    table = Table(show_header=True, header_style="bold", title="components")
    for name in ("source", "name", "annotator", "value", "after rules", "weight", "confidence", "contribution"):
        table.add_column(name, justify="right" if name not in ("source", "name", "annotator") else "left")
    for name in ("lateness", "evidence", "imputed"):
        table.add_column(name)
    for c in e.components:
        table.add_row(
            c.source, c.name, c.annotator, _num(c.value), _num(c.adjusted_value), _num(c.weight),
            _num(c.confidence), _num(c.contribution), f"{c.lateness_ms} ms" if c.lateness_ms else "",
            _short(c.evidence or ""), "yes" if c.imputed else "",
        )  # fmt: skip
    if e.rule_adjustment:
        table.add_row("(rules)", "", "", "", "", "", "", _num(e.rule_adjustment), "", "cap/veto", "")
    table.add_row("[bold]total[/bold]", "", "", "", "", "", "", f"[bold]{_num(e.value)}[/bold]", "", "", "")
    console.print(table)
    fired = "  ".join(f"{i}. {name}" for i, name in enumerate(e.rules_fired, start=1))
    console.print(f"rules fired: {fired or 'none'}", highlight=False)
    if e.conflicts:
        conflicts = Table(show_header=True, header_style="bold", title="conflicts")
        for name in ("a", "a value", "b", "b value", "difference"):
            conflicts.add_column(name)
        for k in e.conflicts:
            conflicts.add_row(
                _label(by_id, k.a_event_id), _num(k.a_value), _label(by_id, k.b_event_id), _num(k.b_value),
                _num(k.difference),
            )  # fmt: skip
        console.print(conflicts)
    else:
        console.print("conflicts: none", highlight=False)
    console.print(f"imputed: {', '.join(e.imputed) or 'none'}", highlight=False)


def _label(by_id: Mapping[str, ComponentLine], event_id: str) -> str:
    c = by_id.get(event_id)
    return f"{c.source}/{c.name} ({event_id})" if c else event_id


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
