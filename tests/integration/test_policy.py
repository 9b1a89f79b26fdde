"""Reward policies at runtime: `treadle policy push/list`, and a running worker applying a pushed version.

A pushed version applies to steps dispatched (event time) at or after its effective_from; older steps keep the
policy they started with, and every woven reward records the version it used.
"""

from __future__ import annotations

import asyncio
import json
import time

from sinks.sql_client import run_sql
from tests.factories import RawProducer, dispatch, reward, treadle, wait_for
from topics.ids import uuid7
from topics.settings import Settings

S = 1_000_000


def test_push_list_and_immutable_versions(deployment: Settings, tmp_path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("version: strict-1\nspecs:\n  - {source: judge, required: true, window_s: 30}\n")
    pushed = treadle(deployment, "policy", "push", str(path), "--effective-from", "2025-01-01T00:00Z")
    assert pushed.returncode == 0, pushed.stderr
    assert "pushed reward policy strict-1, effective from 2025-01-01T00:00:00" in pushed.stdout
    again = treadle(deployment, "policy", "push", str(path), "--effective-from", "2025-01-01T00:00Z")
    assert again.returncode == 0 and "already pushed" in again.stdout
    listed = treadle(deployment, "policy", "list", "--json")
    [policy] = json.loads(listed.stdout)
    assert policy["version"] == "strict-1" and policy["specs"][0]["required"] is True

    path.write_text("version: strict-1\nspecs:\n  - {source: judge, required: false}\n")
    changed = treadle(deployment, "policy", "push", str(path))
    assert changed.returncode == 1
    assert changed.stderr.strip() == "error: reward policy version strict-1 already exists with other content"
    path.write_text("version: bad\nspecs:\n  - {source: judge, window_s: -3}\n")
    invalid = treadle(deployment, "policy", "push", str(path))
    assert invalid.returncode == 1 and invalid.stderr.startswith(f"error: {path}: specs.0.window_s")
    assert "Traceback" not in invalid.stderr


def test_a_running_worker_applies_a_pushed_policy_to_steps_dispatched_after_it(
    deployment: Settings, worker_factory, tmp_path
) -> None:
    settings = deployment.model_copy(update={"idle_timeout_s": 2.0, "window_tick_s": 0.5})
    worker = worker_factory(settings).start()
    worker.wait_ready()
    effective = int(time.time() * S) - 3600 * S
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"version": "needs-human", "effective_from_us": effective,
                                "specs": [{"source": "human", "required": True, "window_s": 60}]}))  # fmt: skip
    assert treadle(settings, "policy", "push", str(path)).returncode == 0
    time.sleep(6)  # workers refresh policies every 5 s

    session = f"pol-{uuid7()[-10:]}"
    events = []
    for step, at in enumerate((effective - 600 * S, effective + 600 * S)):  # before and after the new policy
        lid = uuid7()
        d = dispatch(session, lid, step, 2 * step + 1)
        d["envelope"]["event_time"] = at
        r = reward(session, lid, 2 * step + 2, 0.8, "judge", 1.0)
        r["envelope"]["event_time"] = at + S
        events += [("treadle.events.ActionDispatched", d), ("treadle.events.RewardSignal", r)]

    async def produce() -> None:
        async with RawProducer(settings) as producer:
            for name, record in events:
                await producer.send(name, record)
            await producer.flush()

    asyncio.run(produce())

    def woven() -> dict | None:
        _, rows = run_sql(
            settings,
            f"SELECT step, status, reward_policy_version, value FROM woven_rewards_latest "
            f"WHERE session_id = '{session}' ORDER BY step",
        )
        return {r[0]: tuple(r[1:]) for r in rows} if len(rows) == 2 and rows[1][1] != "complete" else None

    rows = wait_for(woven, 90, "both steps woven, the second under the pushed policy")
    assert rows == {0: ("complete", "default", 0.8), 1: ("partial", "needs-human", 0.8)}
