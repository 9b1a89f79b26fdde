"""How long one plan's reward roll-up takes to read (migration 0021) when the database holds many plans and more
steps outside plans.

The data: `--plans` plans of 20 steps (4 subgoals of 5 steps, each subgoal's attempt in a session of its own, as a
treadle.Executor makes them) and 5 times as many other steps, every step with one woven reward; dispatches go into
raw_events, so plan_steps is filled by its materialized view as in the sink. The query is `treadle plan show`'s
(plan_subgoal_rewards of one plan, fused row per subgoal) and plan_rewards of the same plan. The baseline, measured in
the same run, is the floor a plan column on the rewards would give: woven_rewards_latest read by primary key for
that plan's four step sessions, known in advance. Median of `--repeat` runs, each on another plan.

    PYTHONPATH=. python -m bench.plan_rewards_bench --plans 10000
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import loadavg, machine_facts
from sinks import migrations
from sinks.clickhouse import ClickHouseStore
from topics.settings import Settings

RAW = "INSERT INTO raw_events (kind, schema_name, event_id, session_id, agent_id, episode_id, logical_event_id, seq, " \
      "event_time, policy_version, trace_id, attributes, payload_json, ingested_revision) "  # fmt: skip
WOVEN = (
    "INSERT INTO woven_rewards (logical_event_id, session_id, episode_id, step, revision, value, status, fusion, "
    "policy_version, `components.event_id`, `components.source`, `components.name`, `components.value`, "
    "`components.confidence`, `components.weight`, `components.annotator`, `components.event_time`, woven_at) "
)


def load(store: ClickHouseStore, plans: int) -> None:
    steps, others = plans * 20, plans * 100
    attrs = "map('plan_id', concat('p', toString(intDiv(number, 20))), 'subgoal_id', " \
            "concat('g', toString(intDiv(number % 20, 5))), 'attempt', '1', 'plan_session_id', 'ps')"  # fmt: skip
    store.command_sync(RAW + f"SELECT 'actions', 'x', toString(number), concat('as', toString(intDiv(number, 5))), "
                             f"'a', 'ep', concat('st', toString(number)), number, '2026-12-01 00:00:00', 'v', 't', "
                             f"{attrs}, '{{\"tool\": \"t\"}}', 1 FROM numbers({steps})")  # fmt: skip
    store.command_sync(
        RAW + "SELECT 'actions', 'x', concat('o', toString(number)), concat('os', toString(intDiv(number, 20))), "
        "'a', 'ep', concat('ot', toString(number)), number, '2026-12-01 00:00:00', 'v', 't', map(), '{}', 1 "
        f"FROM numbers({others})"
    )
    plan_work = ("concat('as', toString(intDiv(number, 5)))", "concat('st', toString(number))", steps)
    other_work = ("concat('os', toString(intDiv(number, 20)))", "concat('ot', toString(number))", others)
    for session, step, n in (plan_work, other_work):
        store.command_sync(WOVEN + f"SELECT {step}, {session}, 'ep', 0, 1, number % 7 / 7, 'complete', 'mean', 'v', "
                                   "['r'], ['judge'], ['q'], [number % 7 / 7], [1], [1], ['LLM'], "
                                   f"['2026-12-01 00:00:00'], '2026-12-01 00:00:00' FROM numbers({n})")  # fmt: skip
    for table in ("raw_events", "plan_steps", "woven_rewards"):
        store.command_sync(f"OPTIMIZE TABLE {table} FINAL")


def timed(store: ClickHouseStore, sqls: list[str]) -> float:
    """Median seconds of one query per plan."""
    took = []
    for sql in sqls:
        t0 = time.perf_counter()
        store.query_sync(sql).result_rows  # noqa: B018 (read every row)
        took.append(time.perf_counter() - t0)
    return statistics.median(took)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=21)
    args = parser.parse_args()
    print(machine_facts())
    with tempfile.TemporaryDirectory() as home, ClickHouseStore.open(Settings(home=Path(home)), "bench") as store:
        store.call_sync(lambda client: migrations.apply_pending(client, store.database))
        t0 = time.perf_counter()
        load(store, args.plans)
        print(f"loaded {args.plans} plans ({args.plans * 20} plan steps) and {args.plans * 100} other steps, "
              f"each with a woven reward, in {time.perf_counter() - t0:.1f} s")  # fmt: skip
        picks = [(i * 7919) % args.plans for i in range(args.repeat)]
        key = "plan_session_id = 'ps' AND plan_id = 'p{}'"
        shown = [f"SELECT subgoal_id, sum(steps), sum(rewarded_steps), sum(reward_sum) FROM plan_subgoal_rewards "
                 f"WHERE {key.format(p)} AND source = '' AND name = '' GROUP BY subgoal_id" for p in picks]  # fmt: skip
        per_plan = [f"SELECT * FROM plan_rewards WHERE {key.format(p)}" for p in picks]
        sessions = [", ".join(f"'as{p * 4 + j}'" for j in range(4)) for p in picks]
        floor = [f"SELECT session_id, sum(value), count() FROM woven_rewards_latest WHERE session_id IN ({listed}) "
                 "GROUP BY session_id" for listed in sessions]  # fmt: skip
        timed(store, shown[:3] + floor[:3])  # warm up
        base = timed(store, floor)
        for name, sqls in (("plan_subgoal_rewards (treadle plan show)", shown), ("plan_rewards", per_plan)):
            took = timed(store, sqls)
            print(f"{name}: one plan in {took * 1e3:.1f} ms; baseline (woven_rewards_latest of its 4 sessions by "
                  f"primary key) {base * 1e3:.1f} ms; ratio {took / base:.1f}x; load avg {loadavg()}")  # fmt: skip


if __name__ == "__main__":
    main()
