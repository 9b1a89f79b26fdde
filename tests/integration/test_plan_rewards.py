"""Rewards rolled up per subgoal and per plan (migration 0021) on the real stack: a worker with the `steps` and `plans`
processors (and its sink child, chDB), a plan submitted from the SDK, a treadle.Executor whose handler dispatches tool
calls and results through ctx.stream and rewards its own steps, and a second reward source judging the same steps
from outside. plan_subgoal_rewards and plan_rewards must hold exactly the rewards sent, per subgoal, attempt and plan.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path
from typing import Any

from sinks import migrations
from sinks.clickhouse import ClickHouseStore
from sinks.sql_client import run_sql
from tests.factories import RawProducer, reward, treadle, wait_for
from topics.ids import now_micros
from topics.names import REWARD
from topics.settings import Settings
from treadle import AgentStream, AttemptContext, Executor, RetryPolicy, StepRef, Subgoal, SubgoalWork

PLAN = "plan-rw"


class ParseError(RuntimeError):
    """The first attempt of subgoal "a" fails after its steps: their rewards still count, under attempt 1."""


def code_value(subgoal: str, attempt: int, i: int) -> float:
    return round(0.25 * (i + 1) + (0.5 if subgoal == "b" else 0.0) - 0.125 * attempt, 6)


def judge_value(subgoal: str, attempt: int, i: int) -> float:
    return round(1.0 - 0.5 * i - (0.25 if subgoal == "a" else 0.0) + 0.0625 * attempt, 6)


def rows(settings: Settings, sql: str) -> list[dict[str, Any]]:
    columns, found = run_sql(settings, sql)
    return [dict(zip(columns, row, strict=True)) for row in found]


def test_rewards_roll_up_per_subgoal_attempt_and_plan(deployment: Settings, worker_factory) -> None:
    settings = deployment.model_copy(update={"processors": ("steps", "plans")})
    worker = worker_factory(settings).start()
    worker.wait_ready()
    steps: dict[tuple[str, int], list[StepRef]] = {}
    n_steps = {"a": 2, "b": 3, "c": 1}

    async def handle(work: SubgoalWork, ctx: AttemptContext) -> str:
        refs = []
        for i in range(n_steps[work.subgoal_id]):
            step = await ctx.stream.dispatch(work.tool or "noop", {"i": i})
            await ctx.stream.tool_result(step, "OK", output=f"{work.subgoal_id}-{i}")
            if work.subgoal_id != "c" or i > 0:  # c's only step gets the judge's reward only
                await ctx.stream.reward(
                    step, code_value(work.subgoal_id, work.attempt, i), source="code", name="passed"
                )
            refs.append(step)
        steps[(work.subgoal_id, work.attempt)] = refs
        if work.subgoal_id == "a" and work.attempt == 1:
            raise ParseError("first try fails")
        return f"ref://{work.subgoal_id}/{work.attempt}"

    subgoals = [
        Subgoal(id="a", tool="parse", deadline_s=60, retry=RetryPolicy(max_attempts=2)),
        Subgoal(id="b", tool="search", depends_on=["a"], deadline_s=60),
        Subgoal(id="c", tool="write", depends_on=["a"], deadline_s=60),
    ]

    async def run_plan() -> str:
        executor = Executor(
            resource_class="cpu", handler=handle, settings=settings, executor_id="ex-rw", cpu=2,
            heartbeat_interval_s=0.5, valid_for_s=30.0,
        )  # fmt: skip
        async with executor:
            async with AgentStream(settings, agent_id="planner") as planner:
                await planner.submit_plan(PLAN, subgoals, goal="rewards per subgoal")
            session = planner.session_id
            finished = f"SELECT count() AS n FROM plan_decisions_latest WHERE session_id = '{session}' " \
                       f"AND plan_id = '{PLAN}' AND kind = 'finished'"  # fmt: skip
            for _ in range(360):  # an upper bound for the slow shared machine, not a timing assertion
                if (await asyncio.to_thread(rows, settings, finished))[0]["n"]:
                    break
                await asyncio.sleep(0.5)
            else:
                raise AssertionError(f"plan {PLAN} did not finish; worker log: {worker.log_tail()}")
        return session

    session = asyncio.run(run_plan())
    assert sorted(steps) == [("a", 1), ("a", 2), ("b", 1), ("c", 1)]

    async def judge() -> None:  # a reward source of its own, judging every step from outside the executor
        async with RawProducer(settings) as producer:
            for (sid, attempt), refs in steps.items():
                for i, ref in enumerate(refs):
                    record = reward(ref.session_id, ref.logical_event_id, 100 + i, judge_value(sid, attempt, i))
                    record["envelope"].update(event_time=now_micros(), episode_id=ref.episode_id)
                    await producer.send(REWARD, record)
            await producer.flush()

    asyncio.run(judge())

    # what was sent, per (subgoal, attempt, source, name)
    expected: dict[tuple[str, int, str, str], list[float]] = defaultdict(list)
    for (sid, attempt), refs in steps.items():
        for i in range(len(refs)):
            expected[(sid, attempt, "judge", "quality")].append(judge_value(sid, attempt, i))
            if sid != "c" or i > 0:
                expected[(sid, attempt, "code", "passed")].append(code_value(sid, attempt, i))
    total_components = sum(len(v) for v in expected.values())
    key = f"plan_session_id = '{session}' AND plan_id = '{PLAN}'"
    woven = f"SELECT sum(length(`components.value`)) AS n FROM plan_step_rewards WHERE {key}"
    wait_for(lambda: rows(settings, woven)[0]["n"] == total_components, 120,
             "every reward woven into the plan's steps", explain=worker.log_tail)  # fmt: skip

    found = rows(settings, "SELECT subgoal_id, attempt, source, name, steps, rewarded_steps, rewards, reward_sum, "
                           f"reward_mean FROM plan_subgoal_rewards WHERE {key} AND source != ''")  # fmt: skip
    got = {(r["subgoal_id"], r["attempt"], r["source"], r["name"]): r for r in found}
    assert sorted(got) == sorted(expected)
    for k, values in expected.items():
        r = got[k]
        assert r["steps"] == len(steps[(k[0], k[1])])
        assert r["rewards"] == r["rewarded_steps"] == len(values)
        assert abs(r["reward_sum"] - sum(values)) < 1e-9
        assert abs(r["reward_mean"] - sum(values) / len(values)) < 1e-9

    # the fused row of each attempt: the sum of its steps' current fused rewards (the step's own reward row)
    fused_by_step = {
        (r["session_id"], r["logical_event_id"]): r["reward"]
        for r in rows(settings, "SELECT session_id, logical_event_id, reward FROM transitions_latest WHERE "
                                f"session_id IN ({', '.join(repr(s[0].session_id) for s in steps.values())})")
    }  # fmt: skip
    fused = {
        (r["subgoal_id"], r["attempt"]): r
        for r in rows(settings, "SELECT subgoal_id, attempt, steps, rewarded_steps, reward_sum FROM "
                                f"plan_subgoal_rewards WHERE {key} AND source = '' AND name = ''")
    }  # fmt: skip
    assert sorted(fused) == sorted(steps)
    for (sid, attempt), refs in steps.items():
        want = sum(fused_by_step[(ref.session_id, ref.logical_event_id)] for ref in refs)
        assert fused[(sid, attempt)]["steps"] == fused[(sid, attempt)]["rewarded_steps"] == len(refs)
        assert abs(fused[(sid, attempt)]["reward_sum"] - want) < 1e-9

    # per plan: every subgoal and attempt together
    plan = {
        (r["source"], r["name"]): r
        for r in rows(
            settings,
            f"SELECT source, name, subgoals, attempts, steps, rewards, reward_sum FROM plan_rewards WHERE {key}",
        )
    }
    for source, name in (("judge", "quality"), ("code", "passed")):
        values = [v for k, vs in expected.items() if k[2:] == (source, name) for v in vs]
        assert plan[(source, name)]["rewards"] == len(values)
        assert abs(plan[(source, name)]["reward_sum"] - sum(values)) < 1e-9
        assert plan[(source, name)]["steps"] == sum(len(refs) for refs in steps.values())
    assert (plan[("", "")]["subgoals"], plan[("", "")]["attempts"]) == (3, 4)
    assert abs(plan[("", "")]["reward_sum"] - sum(fused_by_step.values())) < 1e-9

    # `treadle plan show`: each subgoal's fused reward sum over its attempts' steps on its line
    shown = treadle(settings, "plan", "show", PLAN, "--session", session)
    assert shown.returncode == 0, shown.stderr
    for sid in ("a", "b", "c"):
        refs = [ref for (s, _), rs in steps.items() if s == sid for ref in rs]
        total = sum(fused_by_step[(ref.session_id, ref.logical_event_id)] for ref in refs)
        line = next(x for x in shown.stdout.splitlines() if x[4:].startswith(f"{sid}  SUCCEEDED"))
        assert f"  reward {total:.2f} ({len(refs)}/{len(refs)} steps)" in line, shown.stdout


def dispatch_row(event_id: str, session: str, step: str, subgoal: str, attempt: int) -> str:
    attributes = f"{{'plan_id': 'p1', 'subgoal_id': '{subgoal}', 'attempt': '{attempt}', 'plan_session_id': 'ps'}}"
    return f"('actions', 'treadle.events.ActionDispatched', '{event_id}', '{session}', 'a', 'ep', '{step}', 1, " \
           f"'2026-12-01 00:00:00', 'v1', 't', {attributes}, '{{\"tool\": \"search\"}}', 1)"  # fmt: skip


def test_migration_0021_backfills_plan_steps_catches_new_dispatches_once_and_rolls_back(tmp_path: Path) -> None:
    """Dispatches sunk before the migration are backfilled, later ones reach plan_steps through the materialized view,
    a replayed dispatch counts once, steps without plan attributes stay out, and the down script removes it all."""
    insert = "INSERT INTO raw_events (kind, schema_name, event_id, session_id, agent_id, episode_id, " \
             "logical_event_id, seq, event_time, policy_version, trace_id, attributes, payload_json, " \
             "ingested_revision) VALUES "  # fmt: skip
    outside = "('actions', 'x', 'e0', 'other', 'a', 'ep', 'st0', 1, '2026-12-01 00:00:00', 'v1', 't', {}, '{}', 1)"
    with ClickHouseStore.open(Settings(home=tmp_path), database="rw") as store:
        db = store.database
        assert store.call_sync(lambda c: migrations.apply_pending(c, db, target=20))[-1] == 20
        store.command_sync(insert + dispatch_row("e1", "s-a1", "st1", "a", 1) + ", " + outside)
        assert store.call_sync(lambda c: migrations.apply_pending(c, db, target=21)) == [21]
        store.command_sync(insert + dispatch_row("e2", "s-a2", "st2", "a", 2))
        store.command_sync(insert + dispatch_row("e1", "s-a1", "st1", "a", 1))  # a replay
        found = store.query_sync(
            "SELECT subgoal_id, attempt, session_id, logical_event_id, tool FROM plan_steps FINAL "
            "WHERE plan_session_id = 'ps' AND plan_id = 'p1' ORDER BY attempt"
        ).result_rows
        assert [tuple(r) for r in found] == [("a", 1, "s-a1", "st1", "search"), ("a", 2, "s-a2", "st2", "search")]
        steps = store.query_sync("SELECT steps, rewarded_steps, reward_sum FROM plan_subgoal_rewards "
                                 "WHERE plan_id = 'p1' AND source = '' ORDER BY attempt").result_rows  # fmt: skip
        assert [tuple(r) for r in steps] == [(1, 0, 0.0), (1, 0, 0.0)]  # no reward woven yet
        assert store.call_sync(lambda c: migrations.rollback(c, 20, db)) == [21]
        left = store.query_sync(f"SELECT name FROM system.tables WHERE database = '{db}' AND name LIKE 'plan_%'")
        assert not {n for (n,) in left.result_rows} & {"plan_steps", "plan_steps_mv", "plan_step_rewards",
                                                        "plan_subgoal_rewards", "plan_rewards"}  # fmt: skip
