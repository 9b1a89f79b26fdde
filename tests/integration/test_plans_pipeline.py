"""The plans scheduler on the real stack: a worker running the `plans` processor, two `treadle.Executor`s of one
resource class with different capacities (tests.plan_executor, each its own process), real Kafka.

A 50-node random DAG runs with injected failures (a retry that succeeds, a reroute to the fallback, an escalation that
cancels what depends on it), the big executor is killed with -9 while it runs work (its attempts time out by their
deadline and are retried on the small one), and the worker that schedules is killed with -9 mid-plan: replaced by a
new one (`restart`), or taken over by a second worker of the group while a third joins (`failover`). The plan
finishes; the decisions on plan_decisions are exactly those of the scheduler folding the plan_events log in one go
(what a worker that was never killed decides), each sent once; each attempt is on its work topic once; no executor
ever runs more than its capacity. Plans with a cycle, an unknown dependency or a resource class that cannot name a
topic are dead letters (stage VALIDATE) with the reason.

An outage longer than the deadline: the worker is killed while an executor runs work and comes back after more than
`deadline_s` while the executor heartbeats on; what it releases while catching up on that backlog is not timed out
by it (the deadline runs from the release's ReleaseDelivered marker, appended when the work goes out).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from processors.plans.dag import PlanRefused, PlanScheduler, attempt_key
from processors.plans.processor import fold_input
from tests.factories import wait_for
from tests.paths import REPO_ROOT
from topics.admin import ensure_topics
from topics.catalog import TopicCatalog, work_topic_spec
from topics.codec import AvroCodec
from topics.compacted import read_to_end
from topics.names import (
    DEAD_LETTER,
    EXECUTOR_HEARTBEAT,
    PLAN_EVENTS_KEY,
    PLAN_FINISHED,
    PLAN_SUBMITTED,
    RELEASE_DELIVERED,
    SUBGOAL_ESCALATED,
    SUBGOAL_RELEASED,
    SUBGOAL_REROUTED,
    SUBGOAL_RETRIED,
    SUBGOAL_STATUS,
    SUBGOAL_TIMED_OUT,
)
from topics.settings import Settings
from treadle.devstack.worker_process import WorkerProcess

pytestmark = pytest.mark.integration

CODEC = AvroCodec()
SESSION = "plan-session-1"
BIG = ("exec-big", (40_000, 4, 6))  # executor id, (GPU MiB, GPUs, CPU slots)
SMALL = ("exec-small", (16_000, 1, 2))
CAPACITY = dict([BIG, SMALL])
RETRIED, REROUTED, ESCALATED = "n05", "n09", "n44"  # the subgoals whose handler fails on purpose
# Longer than the worker is away (kill -9, the group's session timeout, a new worker's start): what a worker releases
# while it catches up on the log is stamped with the log's (older) event time, and its deadline runs from there.
DEADLINE_S = 90.0


@pytest.fixture
def deployment(deployment: Settings) -> Settings:
    return deployment.model_copy(update={"processors": ("plans",)})


def envelope(logical: str, session: str = SESSION) -> dict[str, Any]:
    return {
        "event_id": str(uuid.uuid4()), "session_id": session, "agent_id": "planner", "episode_id": "ep1",
        "logical_event_id": logical, "seq": 0, "event_time": int(time.time() * 1_000_000), "policy_version": "",
        "trace_id": "", "attributes": {},
    }  # fmt: skip


def subgoal(sid: str, deps: list[str], params: dict[str, Any], profile: tuple[int, int, int], *,
            fallback: dict[str, Any] | None = None, cls: str = "gpu", deadline_s: float = DEADLINE_S,
            ) -> dict[str, Any]:  # fmt: skip
    return {
        "subgoal_id": sid, "tool": f"tool_{sid}", "agent": None, "params_json": json.dumps(params),
        "resource_class": cls, "profile": {"gpu_memory_mb": profile[0], "gpus": profile[1], "cpu": profile[2]},
        "deadline_s": deadline_s, "retry": {"max_attempts": 2, "backoff_s": 0.2, "backoff_multiplier": 2.0},
        "fallback": fallback, "depends_on": deps,
    }  # fmt: skip


def random_plan(seed: int, n: int = 50) -> dict[str, Any]:
    """A random DAG: each subgoal depends on up to three of the ten before it; every profile fits the small executor."""
    rng = random.Random(seed)
    subgoals = []
    for i in range(n):
        sid = f"n{i:02d}"
        earlier = [f"n{j:02d}" for j in range(max(0, i - 10), i)]
        deps = sorted(rng.sample(earlier, min(len(earlier), rng.randint(0, 3))))
        params: dict[str, Any] = {"seconds": round(rng.uniform(0.5, 1.5), 2)}
        profile = (rng.choice([0, 4_000, 8_000, 12_000]), rng.randint(0, 1), 1)
        fallback = None
        if sid == RETRIED:
            params["fail_attempts"] = 1
        if sid in (REROUTED, ESCALATED):
            params["fail_attempts"] = 2
            fallback_params = {"seconds": 0.3, "always_fail": sid == ESCALATED}
            fallback = {"tool": "backup", "agent": None, "params_json": json.dumps(fallback_params),
                        "resource_class": "gpu", "profile": {"gpu_memory_mb": 2_000, "gpus": 0, "cpu": 1}}  # fmt: skip
        subgoals.append(subgoal(sid, deps, params, profile, fallback=fallback))
    return {"envelope": envelope("plan-big"), "plan_id": "plan-big", "goal": "fifty nodes", "subgoals": subgoals}


def bad_plans() -> list[dict[str, Any]]:
    a, b = subgoal("a", ["b"], {}, (0, 0, 1)), subgoal("b", ["a"], {}, (0, 0, 1))
    unknown = subgoal("c", ["ghost"], {}, (0, 0, 1))
    spaced = subgoal("d", [], {}, (0, 0, 1), cls="gpu a100")
    return [
        {"envelope": envelope(pid, "bad-session"), "plan_id": pid, "goal": "", "subgoals": subgoals}
        for pid, subgoals in (("cyclic", [a, b]), ("unknown-dep", [unknown]), ("bad-class", [spaced]))
    ]


async def submit(settings: Settings, plans: list[dict[str, Any]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap_servers, acks="all")
    await producer.start()
    try:
        for plan in plans:
            await producer.send_and_wait(
                TopicCatalog(settings)["plan_events"].name, CODEC.encode(PLAN_SUBMITTED, plan),
                key=PLAN_EVENTS_KEY.encode(),
            )  # fmt: skip
    finally:
        await producer.stop()


def records(settings: Settings, topic: str) -> list[tuple[str, dict[str, Any]]]:
    """(schema, record) of every record on `topic` (in log order for a topic with one used partition)."""
    return [CODEC.decode(value) for _, value in asyncio.run(read_to_end(settings.kafka_bootstrap_servers, topic))]


class Executor:
    """One tests.plan_executor process in its own process group (killed with -9 like a crash)."""

    def __init__(self, settings: Settings, executor: tuple[str, tuple[int, int, int]], log_path: Path) -> None:
        executor_id, (gpu_mb, gpus, cpu) = executor
        self.log_path = log_path
        argv = [sys.executable, "-m", "tests.plan_executor", executor_id, "gpu", str(gpu_mb), str(gpus), str(cpu),
                str(log_path)]  # fmt: skip
        env = {**os.environ, **settings.to_env(), "PYTHONPATH": str(REPO_ROOT)}
        with (log_path.parent / f"{executor_id}.out").open("ab") as out:
            self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # fmt: skip

    def ready(self) -> bool:
        return any(line["event"] == "ready" for line in self.lines())

    def explain(self) -> str:
        out = (self.log_path.parent / f"{self.log_path.stem}.out").read_text(errors="replace")[-3000:]
        return f"{self.log_path.stem}: exit code {self.proc.poll()}, {len(self.lines())} log lines; output:\n{out}"

    def lines(self) -> list[dict[str, Any]]:
        if not self.log_path.exists():
            return []
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]

    def busy(self) -> list[str]:
        """First attempts of subgoals that do not fail on purpose, started and with at least 0.4 s still to run."""
        started, ended = {}, set()
        for line in self.lines():
            if line["event"] == "start":
                started[line["key"]] = line["t"] + line["seconds"]
            elif line["event"] == "end":
                ended.add(line["key"])
        return [
            key for key, until in started.items()
            if key not in ended and until - time.time() > 0.4 and key.endswith("/1")
            and key.split("/")[2] not in (RETRIED, REROUTED, ESCALATED)
        ]  # fmt: skip

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def fold_log(
    events: list[tuple[str, dict[str, Any]]], prefix: str, markers: bool = True
) -> tuple[list[dict[str, Any]], list[str]]:
    """What one scheduler folding the whole log decides (a worker never killed), and the plans it refuses; without
    `markers`, as a scheduler would that started each deadline at the release (the log's markers left out)."""
    scheduler, decided, refused = PlanScheduler(work_topic_prefix=f"{prefix}.work", delivery_markers=markers), [], []
    events = events if markers else [(schema, record) for schema, record in events if schema != RELEASE_DELIVERED]
    for schema, record in events:
        try:
            decided += [(d.schema, d.record) for d in fold_input(scheduler, schema, record)]
        except PlanRefused as exc:
            refused.append(f"{exc.plan_id}: {exc.reason}")
    return decided, refused


def descendants(plan: dict[str, Any], root: str) -> set[str]:
    children: dict[str, list[str]] = {}
    for spec in plan["subgoals"]:
        for dep in spec["depends_on"]:
            children.setdefault(dep, []).append(spec["subgoal_id"])
    found, stack = set(), [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def last_took_the_log(worker: WorkerProcess) -> str:
    """When the worker last took the plan_events partition over (its log line's timestamp; "" if never)."""
    text = worker.log_tail(100_000)
    lines = [line for line in text.splitlines() if "plans scheduler of" in line and " folded " in line]
    return lines[-1][:25] if lines else ""


def other_worker(deployment: Settings, tmp_path: Path, name: str, n: int) -> Settings:
    """Another worker of the same group: its own home and web port, no sink (one is enough)."""
    return deployment.model_copy(update={"home": tmp_path / name, "web_port": deployment.web_port + 200 + 2 * n,
                                         "sink": "off"})  # fmt: skip


@pytest.mark.parametrize("failover", [False, True], ids=["restart", "failover"])
def test_a_fifty_node_plan_survives_failures_a_dead_executor_and_a_worker_kill_9(
    deployment, worker_factory, tmp_path, failover
):
    """`restart`: the only worker is killed and a new one started. `failover`: of two workers, the one scheduling is
    killed, the other takes the log over, and a third joins (another rebalance) while the plan runs."""
    deployment = deployment.model_copy(update={"session_timeout_s": 6.0})  # partitions move 6 s after a death
    catalog = TopicCatalog(deployment)
    plan = random_plan(27)
    workers = [worker_factory(deployment).start()]
    if failover:
        workers.append(worker_factory(other_worker(deployment, tmp_path, "b", 0)).start())
    executors = {name: Executor(deployment, (name, cap), tmp_path / f"{name}.jsonl") for name, cap in (BIG, SMALL)}
    try:
        for worker in workers:
            worker.wait_ready()
        for executor in executors.values():  # an executor new to its group reads its work topic from the end
            wait_for(executor.ready, 60, f"{executor.log_path.stem} to start", explain=executor.explain)
        asyncio.run(submit(deployment, [*bad_plans(), plan]))

        # The big executor dies (-9) while it runs an attempt: that attempt is timed out and retried on the small one.
        big, small = executors[BIG[0]], executors[SMALL[0]]
        states = lambda: f"{big.explain()}\n{small.explain()}\n{workers[0].log_tail(30)}"  # noqa: E731
        killed_busy = wait_for(big.busy, 120, "the big executor running an attempt", interval=0.05, explain=states)
        big.kill()

        # The worker that schedules dies (-9) mid-plan; another takes its place.
        def succeeded() -> int:
            return sum(1 for line in small.lines() if line["event"] == "end" and not line["failed"])

        wait_for(lambda: succeeded() >= 15, 180, "15 subgoals done on the small executor", explain=small.explain)
        scheduling = max(workers, key=last_took_the_log)  # with two, a join may have moved the log already
        scheduling.kill()
        done_at_kill = succeeded()
        if failover:
            wait_for(lambda: succeeded() >= done_at_kill + 5, 180, "5 more subgoals done after the failover")
            worker_factory(other_worker(deployment, tmp_path, "c", 1)).start().wait_ready()
        else:
            worker_factory(deployment).start().wait_ready()

        def finished() -> list[dict[str, Any]]:
            return [r for s, r in records(deployment, catalog["plan_decisions"].name) if s == PLAN_FINISHED]

        wait_for(finished, 400, "the plan to finish", interval=2.0)
    finally:
        for executor in executors.values():
            executor.kill()

    log = records(deployment, catalog["plan_events"].name)
    expected, refused = fold_log(log, deployment.topic_prefix)
    sent = records(deployment, catalog["plan_decisions"].name)
    print(f"{len(log)} plan events, {len(expected)} decisions; the worker was killed after {done_at_kill} subgoals "
          f"succeeded, the big executor while it ran {killed_busy}")  # fmt: skip

    # Exactly the decisions of a worker never killed, each sent once.
    ids = Counter(r["decision_id"] for _, r in sent)
    assert [i for i, n in ids.items() if n > 1] == []
    assert sorted(sent, key=lambda d: d[1]["decision_id"]) == sorted(expected, key=lambda d: d[1]["decision_id"])

    # Each attempt on its work topic once, as released.
    released = {r["decision_id"]: r for s, r in expected if s == SUBGOAL_RELEASED}
    work = [r for _, r in records(deployment, f"{deployment.topic_prefix}.work.gpu")]
    assert Counter(r["decision_id"] for r in work) == Counter(list(released))
    assert {r["decision_id"]: r for r in work} == released
    keys = [attempt_key(r["session_id"], r["plan_id"], r["subgoal_id"], r["attempt"]) for r in released.values()]
    assert len(keys) == len(set(keys))

    # The plan finished: the escalated subgoal's downstream cancelled, everything else succeeded.
    (done,) = [r for s, r in expected if s == PLAN_FINISHED]
    cancelled = descendants(plan, ESCALATED)
    assert done["outcome"] == "FAILED" and done["escalated"] == [ESCALATED]
    assert set(done["cancelled"]) == cancelled
    assert set(done["succeeded"]) == {s["subgoal_id"] for s in plan["subgoals"]} - cancelled - {ESCALATED}
    by_kind = {kind: [r for s, r in expected if s == kind] for kind in (SUBGOAL_RETRIED, SUBGOAL_REROUTED,
               SUBGOAL_ESCALATED, SUBGOAL_TIMED_OUT)}  # fmt: skip
    assert {RETRIED, REROUTED, ESCALATED} <= {r["subgoal_id"] for r in by_kind[SUBGOAL_RETRIED]}
    assert {r["subgoal_id"] for r in by_kind[SUBGOAL_REROUTED]} == {REROUTED, ESCALATED}
    assert [r["subgoal_id"] for r in by_kind[SUBGOAL_ESCALATED]] == [ESCALATED]

    # What the big executor ran when it died timed out, and its next attempt went to the small one.
    for key in killed_busy:
        _, _, sid, attempt = key.split("/")
        assert any(r["subgoal_id"] == sid and r["attempt"] == int(attempt) for r in by_kind[SUBGOAL_TIMED_OUT]), key
        retry = [r for r in released.values() if r["subgoal_id"] == sid and r["attempt"] == int(attempt) + 1]
        assert [r["executor_id"] for r in retry] == [SMALL[0]], key

    # Never over capacity: what each heartbeat lists as running fits the executor.
    profiles = {attempt_key(r["session_id"], r["plan_id"], r["subgoal_id"], r["attempt"]): r["profile"]
                for r in released.values()}  # fmt: skip
    for schema, beat in log:
        if schema == EXECUTOR_HEARTBEAT:
            held = [profiles[key] for key in beat["running"]]
            cap = CAPACITY[beat["executor_id"]]
            assert sum(p["gpu_memory_mb"] for p in held) <= cap[0]
            assert sum(p["gpus"] for p in held) <= cap[1] and sum(p["cpu"] for p in held) <= cap[2]
    assert any(s == SUBGOAL_STATUS for s, _ in log)

    # The bad plans: dead letters at stage VALIDATE with the reason, the same the fold gives.
    letters = [r for s, r in records(deployment, catalog.for_schema(DEAD_LETTER).name) if s == DEAD_LETTER]
    reasons = sorted(r["reason"] for r in letters if r["stage"] == "VALIDATE")
    assert len(reasons) == 3 and len(refused) == 3
    assert any("dependency cycle: a -> b -> a" in r or "dependency cycle: b -> a -> b" in r for r in reasons)
    assert any("depends on unknown subgoal 'ghost'" in r for r in reasons)
    assert any("'gpu a100' cannot name a work topic" in r for r in reasons)


OUTAGE_DEADLINE_S = 4.0


async def write_junk_work(settings: Settings) -> None:
    """A record that is no scheduler decision on a work topic (another writer's), which recovery reads back."""
    spec = work_topic_spec(settings, "junk")
    await ensure_topics([spec], settings.kafka_bootstrap_servers)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap_servers)
    await producer.start()
    try:
        await producer.send_and_wait(spec.name, b"not a SubgoalReleased", key=b"x")
    finally:
        await producer.stop()


def test_a_worker_back_after_an_outage_longer_than_the_deadline_times_nothing_out(deployment, worker_factory, tmp_path):
    """A chain of subgoals with 4 s deadlines. The scheduling worker is killed with -9 while a subgoal runs; that one
    succeeds during the outage and the executor heartbeats on. A new worker starts more than the deadline later and
    catches up on that backlog, releasing the next subgoal at the backlog's event time: nothing is timed out, each
    subgoal is released once and the plan succeeds, as without the outage. The same log folded with deadlines from
    the releases (the markers left out) does time an attempt out: the outage reproduced the gap."""
    catalog = TopicCatalog(deployment)
    chain = [f"c{i}" for i in range(6)]
    subgoals = [subgoal(sid, chain[i - 1 : i], {"seconds": 1.5}, (4_000, 0, 1), deadline_s=OUTAGE_DEADLINE_S)
                for i, sid in enumerate(chain)]  # fmt: skip
    plan = {"envelope": envelope("plan-outage"), "plan_id": "plan-outage", "goal": "a chain", "subgoals": subgoals}
    worker = worker_factory(deployment).start()
    executor = Executor(deployment, SMALL, tmp_path / "exec-small.jsonl")
    try:
        worker.wait_ready()
        wait_for(executor.ready, 60, "the executor to start", explain=executor.explain)
        asyncio.run(submit(deployment, [plan]))

        def running(sid: str) -> bool:
            lines = executor.lines()
            started = any(line["event"] == "start" and line["key"].split("/")[2] == sid for line in lines)
            return started and not any(line["event"] == "end" and line["key"].split("/")[2] == sid for line in lines)

        wait_for(lambda: running("c2"), 120, "c2 running", interval=0.05, explain=executor.explain)
        worker.kill()  # c2 ends during the outage; its SUCCEEDED and the heartbeats after it wait in the log
        asyncio.run(write_junk_work(deployment))  # the recovery reads the work topics back: it must skip this
        time.sleep(3 * OUTAGE_DEADLINE_S)
        restarted = worker_factory(deployment).start()
        restarted.wait_ready()

        def finished() -> list[dict[str, Any]]:
            return [r for s, r in records(deployment, catalog["plan_decisions"].name) if s == PLAN_FINISHED]

        wait_for(finished, 240, "the plan to finish", interval=1.0, explain=executor.explain)
        assert "is not a scheduler decision" in restarted.log_tail(2000)  # skipped, and said so
    finally:
        executor.kill()

    log = records(deployment, catalog["plan_events"].name)
    expected, _ = fold_log(log, deployment.topic_prefix)
    sent = records(deployment, catalog["plan_decisions"].name)
    ids = Counter(r["decision_id"] for _, r in sent)
    assert [i for i, n in ids.items() if n > 1] == []
    assert sorted(sent, key=lambda d: d[1]["decision_id"]) == sorted(expected, key=lambda d: d[1]["decision_id"])

    # As without the outage: each subgoal released once (attempt 1), nothing timed out or retried, the plan succeeded.
    kinds = Counter(schema for schema, _ in expected)
    assert (kinds[SUBGOAL_TIMED_OUT], kinds[SUBGOAL_RETRIED]) == (0, 0), kinds
    released = [r for s, r in expected if s == SUBGOAL_RELEASED]
    assert sorted((r["subgoal_id"], r["attempt"]) for r in released) == [(sid, 1) for sid in chain]
    (done,) = [r for s, r in expected if s == PLAN_FINISHED]
    assert (done["outcome"], done["succeeded"], done["attempts"]) == ("SUCCEEDED", chain, len(chain))
    # every release's marker is on the log once (a release re-made after the kill gets its marker once too)
    marks = Counter(r["decision_id"] for s, r in log if s == RELEASE_DELIVERED)
    assert marks == Counter(r["decision_id"] for r in released)

    # The gap the markers close: from the releases' event time, the backlog's heartbeats time an attempt out.
    without, _ = fold_log(log, deployment.topic_prefix, markers=False)
    timed_out = [r["subgoal_id"] for s, r in without if s == SUBGOAL_TIMED_OUT]
    print(f"{len(log)} plan events; folded with deadlines from the releases, {timed_out} would have timed out")
    assert timed_out, "the outage did not leave a release behind the backlog's clock: the test reproduced nothing"
