"""Rewards back to the agent: `outcome()` waits for the step's required sources, or gives a partial at its timeout."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from topics.settings import Settings
from treadle import AgentStream, AgentStreamSync

POLICY = {
    "version": "outcome-test-1",
    "default_window_s": 1000,
    "specs": [
        {"source": "judge", "window_s": 600, "required": True},
        {"source": "human", "window_s": 600, "required": True},
    ],
}


def policy_settings(deployment: Settings, tmp: Path) -> Settings:
    policy = tmp / "policy.json"
    policy.write_text(json.dumps(POLICY))
    return deployment.model_copy(update={"reward_policy": policy, "catch_up_backlog": 0})


async def agent_loop(settings: Settings) -> None:
    async with AgentStream(settings, agent_id="online") as stream:
        seen = stream.outcomes()
        a = await stream.dispatch("search", {"q": "a"})
        b = await stream.dispatch("search", {"q": "b"})
        waiting = asyncio.create_task(stream.outcome(a, timeout=90))
        await stream.reward(a, 1.0, source="judge", confidence=1.0)
        await stream.reward(b, 0.5, source="judge")
        await stream.flush()
        await asyncio.sleep(4)  # the judge reward is woven by now, but the human one is still required
        assert not waiting.done(), "outcome() must wait for every required source"
        sent = time.monotonic()
        await stream.reward(a, 0.0, source="human", confidence=1.0)
        await stream.flush()
        outcome = await waiting
        assert not outcome.partial and outcome.status == "complete" and outcome.value == 0.5
        assert outcome.step == a.step and outcome.revision == 2
        assert {c["source"] for c in outcome.woven["components"]} == {"judge", "human"}
        assert time.monotonic() - sent < 30

        partial = await stream.outcome(b, timeout=3)
        assert partial.partial and partial.value is None and partial.status == "pending"
        assert [(s["source"], s["value"]) for s in partial.signals] == [("judge", 0.5)]

        first = await asyncio.wait_for(anext(seen), 30)
        assert (first.logical_event_id, first.value, first.partial) == (a.logical_event_id, 0.5, False)
        await seen.aclose()

        again = await stream.outcome(a, timeout=5)  # asked after the fact: read back from the log
        assert again == outcome


def test_outcome_after_the_last_required_reward_and_partial_at_the_timeout(
    deployment: Settings, worker_factory, tmp_path: Path
) -> None:
    settings = policy_settings(deployment, tmp_path)
    worker = worker_factory(settings).start()
    worker.wait_ready()
    asyncio.run(agent_loop(settings))


def test_the_sync_stream_gets_outcomes_too(deployment: Settings, worker_factory, tmp_path: Path) -> None:
    settings = policy_settings(deployment, tmp_path)
    worker = worker_factory(settings).start()
    worker.wait_ready()
    with AgentStreamSync(settings, agent_id="sync-online") as stream:
        step = stream.dispatch("search", {"q": "c"})
        stream.reward(step, 1.0, source="judge")
        stream.reward(step, 1.0, source="human")
        stream.flush()
        outcome = stream.outcome(step, timeout=60)
        assert (outcome.partial, outcome.status, outcome.value) == (False, "complete", 1.0)
        outcomes = stream.outcomes()
        assert next(outcomes).logical_event_id == step.logical_event_id
        outcomes.close()
