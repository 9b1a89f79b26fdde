"""`treadle plan show PLAN`: a plan read from ClickHouse (migration 0019's tables and views, 0021's rewards), drawn
in the terminal (treadle.reports.plan_graph.render_text) and, with --png, as an image
(matplotlib, the `reports` extra)."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

from treadle.reports.plan_graph import Attempt, Interval, PlanView, SubgoalView
from treadle.reports.query import Query, query_dicts

OPEN = 2299  # year of the validity ranges' open end (subgoal_state_history)
STATE_COLOURS = {
    "WAITING": "#bdbdbd", "READY": "#90caf9", "RELEASED": "#64b5f6", "RUNNING": "#ffb74d", "BACKOFF": "#ffe082",
    "SUCCEEDED": "#81c784", "ESCALATED": "#e57373", "CANCELLED": "#eeeeee",
}  # fmt: skip


class PlanNotFoundError(LookupError):
    """No such plan in the tables (yet), or a plan id found in several sessions without --session."""


def load_plan(query: Query, plan_id: str, session_id: str | None = None) -> PlanView:
    """The plan `plan_id` (of `session_id`, needed only when the id is in several sessions) with its subgoals, their
    state histories, attempts and step rewards (fused, summed over its attempts), and how it finished."""
    where = "plan_id = {plan:String}" + ("" if session_id is None else " AND session_id = {session:String}")
    params = {"plan": plan_id} if session_id is None else {"plan": plan_id, "session": session_id}
    sql = ("SELECT session_id, goal, toUnixTimestamp64Micro(submitted_at) AS submitted_us "
           f"FROM plans_latest WHERE {where} ORDER BY session_id LIMIT 11")  # fmt: skip
    plans = query_dicts(query, sql, params=params)
    if not plans:
        within = "" if session_id is None else f" in session {session_id!r}"
        raise PlanNotFoundError(f"no plan {plan_id!r}{within} in the plans table (not submitted, or not sunk yet)")
    if len(plans) > 1:
        sessions = ", ".join(p["session_id"] for p in plans[:10])
        raise PlanNotFoundError(f"plan {plan_id!r} is in several sessions ({sessions}); pick one with --session")
    session = plans[0]["session_id"]
    params = {"plan": plan_id, "session": session}
    key = "session_id = {session:String} AND plan_id = {plan:String}"
    sql = f"SELECT subgoal_id, depends_on, resource_class, tool, agent FROM plan_subgoals_latest WHERE {key} " \
          "ORDER BY position"  # fmt: skip
    subgoals = {
        row["subgoal_id"]: SubgoalView(
            row["subgoal_id"], tuple(row["depends_on"]), row["resource_class"], row["tool"] or row["agent"] or ""
        )
        for row in query_dicts(query, sql, params=params)
    }
    sql = ("SELECT subgoal_id, state, attempt, toUnixTimestamp64Micro(valid_from) AS from_us, "
           "toUnixTimestamp64Micro(valid_to) AS to_us, toYear(valid_to) AS to_year "
           f"FROM subgoal_state_history WHERE {key} ORDER BY subgoal_id, valid_from, attempt")  # fmt: skip
    for row in query_dicts(query, sql, params=params):
        if row["subgoal_id"] in subgoals:
            to = None if row["to_year"] >= OPEN else row["to_us"]
            subgoals[row["subgoal_id"]].history.append(Interval(row["state"], row["attempt"], row["from_us"], to))
    sql = ("SELECT subgoal_id, attempt, ifNull(executor_id, '') AS executor_id, resource_class, "
           "outcome, ifNull(error_class, '') AS error_class, duration_s, fallback, "
           "outcome = 'TIMED_OUT' AND succeeded_at IS NOT NULL AS late "
           f"FROM plan_attempts WHERE {key} ORDER BY subgoal_id, attempt")  # fmt: skip
    for row in query_dicts(query, sql, params=params):
        if row["subgoal_id"] in subgoals:
            subgoals[row["subgoal_id"]].attempts.append(Attempt(
                row["attempt"], row["executor_id"], row["resource_class"], row["outcome"], row["error_class"],
                None if row["duration_s"] is None else float(row["duration_s"]), bool(row["fallback"]),
                bool(row["late"]),
            ))  # fmt: skip
    sql = ("SELECT subgoal_id, sum(steps) AS steps, sum(rewarded_steps) AS rewarded_steps, "
           "sum(reward_sum) AS reward_sum FROM plan_subgoal_rewards WHERE plan_session_id = "
           "{session:String} AND plan_id = {plan:String} AND source = '' AND name = '' "
           "GROUP BY subgoal_id")  # fmt: skip
    for row in query_dicts(query, sql, params=params):
        if row["subgoal_id"] in subgoals:
            s = subgoals[row["subgoal_id"]]
            s.steps, s.rewarded_steps, s.reward_sum = int(row["steps"]), int(row["rewarded_steps"]), row["reward_sum"]
    view = PlanView(session, plan_id, plans[0]["goal"], int(plans[0]["submitted_us"]), subgoals)
    sql = ("SELECT outcome, toUnixTimestamp64Micro(decided_at) AS at_us FROM plan_decisions_latest "
           f"WHERE {key} AND kind = 'finished'")  # fmt: skip
    finished = query_dicts(query, sql, params=params)
    if finished:
        view.outcome, view.finished_at = finished[0]["outcome"], int(finished[0]["at_us"])
    return view


def draw_png(plan: PlanView, path: Path) -> None:
    """The DAG as a PNG: one column per layer, nodes coloured by state, the critical path in red."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ModuleNotFoundError("--png needs matplotlib: pip install 'treadle[reports]'", name=exc.name) from None
    depends_on = plan.depends_on
    path_ids, total = plan.critical_path()
    on_path = set(pairwise(path_ids))
    where: dict[str, tuple[float, float]] = {}
    columns = plan.layers()
    tallest = max((len(c) for c in columns), default=1)
    for x, ids in enumerate(columns):
        for y, sid in enumerate(ids):
            where[sid] = (x * 3.0, (len(ids) - 1) / 2 - y)  # each layer centred on 0
    fig, ax = plt.subplots(figsize=(max(6.0, 3.0 * len(columns)), max(3.0, 1.2 * tallest + 1)))
    for sid, deps in depends_on.items():
        for dep in deps:
            critical = (dep, sid) in on_path
            (x0, y0), (x1, y1) = where[dep], where[sid]
            ax.annotate("", xy=(x1 - 0.9, y1), xytext=(x0 + 0.9, y0),
                        arrowprops={"arrowstyle": "->", "color": "#c62828" if critical else "#757575",
                                    "lw": 2.5 if critical else 1.0})  # fmt: skip
    for sid, (x, y) in where.items():
        s = plan.subgoals[sid]
        took = "" if s.duration_s is None else f"\n{s.duration_s:.1f} s"
        critical = sid in path_ids
        box = {"boxstyle": "round", "fc": STATE_COLOURS.get(s.state, "#ffffff"),
               "ec": "#c62828" if critical else "#424242", "lw": 2.5 if critical else 1.0}  # fmt: skip
        label = f"{sid}\n{s.state}, {len(s.attempts)} att.{took}"
        ax.text(x, y, label, ha="center", va="center", fontsize=8, bbox=box)
    ax.set_xlim(-1.5, 3.0 * max(len(columns) - 1, 0) + 1.5)
    ax.set_ylim(-tallest / 2 - 0.5, tallest / 2 + 0.5)
    ax.axis("off")
    ax.set_title(f"plan {plan.plan_id} ({plan.outcome or 'RUNNING'}); critical path {total:.1f} s in red", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
