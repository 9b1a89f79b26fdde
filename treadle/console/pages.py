"""What each console page shows: the queries' rows turned into what its template draws.

Each function here is synchronous (run_sql blocks on the SQL service) and is run off the event loop by the routes.
They reuse the CLI's readers: `treadle explain`'s fetch_explanation, `treadle state`'s state_at and state_diff.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any

from markupsafe import Markup

from processors.steps.policy import RewardPolicy, load_policy_file
from sinks.sql_client import run_sql
from topics.settings import Settings
from treadle.console import queries, svg
from treadle.console.events import DecodedBytes, EventChecker
from treadle.console.params import DeadLetterParams, RewardFlowParams, SessionFilter, StateParams
from treadle.console.queries import SqlReader
from treadle.reports.explain import ExplainError, Explanation, fetch_explanation
from treadle.state.history import StateNotFoundError, state_at, state_diff


def iso(micros: int | None) -> str:
    if micros is None:
        return ""
    return datetime.fromtimestamp(micros / 1_000_000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def reward_policy(settings: Settings) -> RewardPolicy:
    """The deployment's reward policy file (TREADLE_REWARD_POLICY), or the built-in default; windows come from it."""
    if settings.reward_policy is None:
        return RewardPolicy()
    try:
        return load_policy_file(settings.reward_policy)
    except ValueError:
        return RewardPolicy()


# ---- sessions -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionsView:
    page: queries.SessionPage
    agents: list[str]
    policies: list[str]


def sessions_page(reader: SqlReader, f: SessionFilter, with_choices: bool = True) -> SessionsView:
    page = queries.sessions(reader, f)
    if not with_choices:
        return SessionsView(page, [], [])
    return SessionsView(page, queries.agents(reader), queries.policy_versions(reader))


# ---- trace timeline -------------------------------------------------------------------------------------------


@dataclass
class RewardLine:
    event_id: str
    logical_event_id: str
    source: str
    name: str
    value: float
    delay_s: float | None
    window_s: float
    grace_s: float
    verdict: str  # on_time, late, orphan, orphan_resolved
    lateness_ms: int
    detail: str
    copies: int
    at: str


@dataclass
class StepLane:
    row: dict[str, Any]
    rewards: list[RewardLine] = field(default_factory=list)
    revisions: list[dict[str, Any]] = field(default_factory=list)
    lane: Markup = field(default_factory=Markup)


@dataclass(frozen=True)
class TimelineView:
    session: str
    steps: list[StepLane]
    orphans: list[RewardLine]
    reward_chart: Markup
    llm_calls: list[dict[str, Any]]
    scale_s: float
    policy_version: str
    counts: dict[str, int]
    steps_shown: int = queries.STEPS_SHOWN


def _verdict(reason: str) -> str:
    return {"AFTER_GRACE": "late", "ORPHAN": "orphan", "ORPHAN_RESOLVED": "orphan_resolved"}.get(reason, "on_time")


def timeline_page(reader: SqlReader, session: str, policy: RewardPolicy) -> TimelineView:
    steps = queries.session_steps(reader, session)
    rewards = queries.session_rewards(reader, session)
    revisions = queries.session_revisions(reader, session)
    llm_calls = queries.session_llm_calls(reader, session)
    lanes = {row["logical_event_id"]: StepLane(row) for row in steps}
    for rev in revisions:
        if rev["logical_event_id"] in lanes:
            lanes[rev["logical_event_id"]].revisions.append({**rev, "at": iso(rev["woven_us"])})
    orphans: list[RewardLine] = []
    for r in rewards:
        spec = policy.spec_for(str(r["source"]), str(r["name"]))
        lane = lanes.get(r["logical_event_id"])
        delay = (r["event_us"] - lane.row["dispatched_us"]) / 1e6 if lane is not None else None
        line = RewardLine(
            event_id=r["event_id"], logical_event_id=r["logical_event_id"], source=str(r["source"]),
            name=str(r["name"]), value=float(r["value"]),
            delay_s=delay, window_s=spec.window_s, grace_s=spec.grace_s, verdict=_verdict(r["late_reason"]),
            lateness_ms=int(r["lateness_ms"]), detail=r["late_detail"], copies=int(r["copies"]),
            at=iso(r["event_us"]),
        )  # fmt: skip
        if lane is None:
            line.verdict = "orphan" if line.verdict != "late" else line.verdict
            orphans.append(line)
        else:
            lane.rewards.append(line)
    ends = [0.001]
    for lane in lanes.values():
        if lane.row["result_us"] is not None:
            ends.append((lane.row["result_us"] - lane.row["dispatched_us"]) / 1e6)
        ends += [r.delay_s for r in lane.rewards if r.delay_s is not None]
    scale = max(ends) * 1.1
    for lane in lanes.values():
        result_s = None if lane.row["result_us"] is None else (lane.row["result_us"] - lane.row["dispatched_us"]) / 1e6
        marks = []
        for r in lane.rewards:
            verdict = "on_time" if r.verdict == "orphan_resolved" else r.verdict
            marks.append(svg.Mark(r.event_id, r.source, r.delay_s or 0.0, r.window_s, r.grace_s, verdict, r.value))
            if r.copies > 1:
                marks.append(
                    svg.Mark(r.event_id, r.source, r.delay_s or 0.0, r.window_s, r.grace_s, "duplicate", r.value)
                )
        lane.lane = svg.step_lane(0.0, result_s, lane.row["tool_status"], marks, scale)
    chart = svg.reward_line([(int(row["step"]), row["reward"]) for row in steps])
    all_rewards = [r for lane in lanes.values() for r in lane.rewards] + orphans
    counts = {
        "steps": len(steps),
        "rewards": len(all_rewards),
        "late": sum(r.verdict == "late" for r in all_rewards),
        "orphans": sum(r.verdict == "orphan" for r in all_rewards),
        "duplicates": sum(r.copies > 1 for r in all_rewards),
    }
    return TimelineView(session, list(lanes.values()), orphans, chart, llm_calls, scale, policy.version, counts)


def explanation_page(settings: Settings, lid: str, revision: int | None) -> tuple[Explanation | None, str | None]:
    """The same Explanation `treadle explain --json` prints, or why there is none."""
    try:
        return fetch_explanation(partial(run_sql, settings), lid, revision), None
    except ExplainError as exc:
        return None, str(exc)


# ---- state explorer -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StateView:
    session: str
    versions: list[dict[str, Any]]
    graph: Any | None
    diff: Any | None
    error: str | None
    picture: Markup
    nodes: list[dict[str, Any]]
    edges: list[dict[str, Any]]


def state_page(settings: Settings, reader: SqlReader, session: str, p: StateParams) -> StateView:
    versions = [{**v, "at": iso(v["event_us"])} for v in queries.state_versions(reader, session)]
    at = p.at or (str(versions[-1]["ordinal"]) if versions else "now")
    graph, change, error = None, None, None
    try:
        graph = state_at(settings, session, at)
        if p.diff_from:
            change = state_diff(settings, session, p.diff_from, at)
    except (ValueError, StateNotFoundError) as exc:
        error = str(exc)
    nodes, edges, picture = [], [], Markup("")
    if graph is not None:
        nodes = [{"id": n.id, "type": n.type, "data": n.data} for _, n in sorted(graph.nodes.items())]
        edges = [{"src": e.src, "dst": e.dst, "type": e.type, "data": e.data}
                 for e in sorted(graph.edges, key=lambda e: (e.src, e.dst, e.type))]  # fmt: skip
        picture = svg.state_graph(
            [(n["id"], n["type"]) for n in nodes], [(e["src"], e["dst"], e["type"]) for e in edges]
        )
    return StateView(session, versions, graph, change, error, picture, nodes, edges)


# ---- reward flow ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceFlow:
    source: str
    counts: dict[str, Any]
    window_s: float
    grace_s: float
    chart: Markup
    received: int
    median_delay: str


def reward_flow_page(
    reader: SqlReader, p: RewardFlowParams, policy: RewardPolicy
) -> tuple[list[SourceFlow], list[str]]:
    delays: dict[str, list[float]] = defaultdict(list)
    names: dict[str, str] = {}
    for row in queries.reward_delays(reader, p.policy):
        delays[str(row["source"])].append(float(row["delay_s"]))
        names.setdefault(str(row["source"]), str(row["name"]))
    for row in queries.late_delays(reader, p.policy):  # past the deadline: window + grace + how late
        spec = policy.spec_for(str(row["source"]), str(row["name"]))
        delays[str(row["source"])].append(spec.window_s + spec.grace_s + float(row["late_s"]))
    flows = []
    for counts in queries.reward_source_counts(reader, p.policy):
        source = counts["source"]
        spec = policy.spec_for(source, names.get(source, "*"))
        values = sorted(delays.get(source, []))
        woven = int(counts.get("woven") or 0)
        counts["imputation_rate"] = (int(counts["imputed"]) / woven) if woven else 0.0
        title = f"{source}: arrival delay after dispatch (window {svg.seconds(spec.window_s)})"
        flows.append(
            SourceFlow(
                source,
                counts,
                spec.window_s,
                spec.grace_s,
                svg.delay_histogram(values, spec.window_s, spec.grace_s, title),
                len(values),
                svg.seconds(values[len(values) // 2]) if values else "-",
            )
        )
    return flows, queries.policy_versions(reader)


# ---- dead letters ---------------------------------------------------------------------------------------------


def dead_letters_page(
    reader: SqlReader, p: DeadLetterParams, checker: EventChecker
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Dead letters by stage and reason, and the latest ones (of a stage) with their value decoded if possible."""
    groups = [{**g, "last": iso(g["last_us"])} for g in queries.dead_letter_groups(reader)]
    rows = []
    for row in queries.dead_letter_rows(reader, p.stage):
        value = None if row["value_null"] else bytes.fromhex(row["value_hex"])
        key = bytes.fromhex(row["key_hex"]).decode("utf-8", "replace")
        decoded = checker.decode(value)
        if int(row["value_size"]) > queries.MAX_DECODED_BYTES:
            decoded = DecodedBytes(None, None, f"{row['value_size']} bytes: too large to decode here",
                                   decoded.text_preview, int(row["value_size"]))  # fmt: skip
        rows.append({**row, "at": iso(row["failed_us"]), "key": key, "decoded": decoded,
                     "value_hex_short": row["value_hex"][:160]})  # fmt: skip
    return groups, rows
