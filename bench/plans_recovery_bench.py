"""How fast the plans processor refolds plan_events after a kill -9 or a rebalance (CPU part, no broker).

A recovery reads each record of the log once, decodes and validates it as the worker's intake does, and folds it
(processors.plans.processor.fold_input). The log here is made by the scheduler itself: plans of 20 subgoals, two
executors whose every release is answered at once (RUNNING, SUCCEEDED) and who heartbeat every 20 records. The
baseline, measured in the same run, is the fold alone on the decoded records; the ratio is what decoding and
validating add. Fetching from Kafka is not counted (the integration test's worker refolds 121 records in 0.7 s,
mostly client start-up).

    PYTHONPATH=. python -m bench.plans_recovery_bench --plans 1000
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

from bench.common import loadavg, machine_facts
from processors.plans.dag import PlanScheduler
from processors.plans.processor import fold_input
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.intake import Accepted, Intake, SourceMessage
from topics.names import EXECUTOR_HEARTBEAT, PLAN_SUBMITTED, SUBGOAL_RELEASED, SUBGOAL_STATUS
from topics.settings import Settings
from topics.tool_schemas import ToolSchemas
from topics.validation import InputValidator

T0 = 1_800_000_000_000_000


def envelope(session: str, t: int) -> dict[str, Any]:
    return {"event_id": str(uuid.uuid4()), "session_id": session, "agent_id": "bench", "episode_id": "e",
            "logical_event_id": "l", "seq": 0, "event_time": t, "policy_version": "", "trace_id": "",
            "attributes": {}}  # fmt: skip


def subgoal(j: int) -> dict[str, Any]:
    """Chains of four: s0 <- s1 <- s2 <- s3, s4 <- ..."""
    return {"subgoal_id": f"s{j}", "tool": "t", "agent": None, "params_json": "{}", "resource_class": "cpu",
            "profile": {"gpu_memory_mb": 0, "gpus": 0, "cpu": 1}, "deadline_s": 60.0,
            "retry": {"max_attempts": 2, "backoff_s": 0.0, "backoff_multiplier": 2.0}, "fallback": None,
            "depends_on": [f"s{j - 1}"] if j % 4 else []}  # fmt: skip


def plan(i: int, t: int) -> dict[str, Any]:
    subgoals = [subgoal(j) for j in range(20)]
    return {"envelope": envelope(f"session-{i}", t), "plan_id": f"p{i}", "goal": "", "subgoals": subgoals}


def heartbeat(executor: str, t: int) -> dict[str, Any]:
    return {"executor_id": executor, "resource_class": "cpu", "free_gpu_memory_mb": 0, "free_gpus": 0,
            "free_cpu": 64, "running": [], "valid_for_s": 1e6, "host": "h", "sent_at": t}  # fmt: skip


def make_log(plans: int) -> list[tuple[str, dict[str, Any]]]:
    """A plan_events log as one scheduler would see it, every release answered at once."""
    scheduler, log, t = PlanScheduler("bench.work"), [], T0

    def feed(schema: str, record: dict[str, Any]) -> None:
        nonlocal t
        log.append((schema, record))
        pending = list(scheduler.apply(schema, record))
        while pending:
            decision = pending.pop(0)
            if decision.schema != SUBGOAL_RELEASED:
                continue
            r = decision.record
            for state in ("RUNNING", "SUCCEEDED"):
                t += 1_000
                status = {"envelope": envelope(r["session_id"], t), "plan_id": r["plan_id"],
                          "subgoal_id": r["subgoal_id"], "attempt": r["attempt"], "state": state,
                          "executor_id": r["executor_id"], "output_ref": "ref" if state == "SUCCEEDED" else None,
                          "error_class": None, "error": None}  # fmt: skip
                log.append((SUBGOAL_STATUS, status))
                pending += scheduler.apply(SUBGOAL_STATUS, status)
            if len(log) % 20 == 0:
                t += 1_000
                for executor in ("x1", "x2"):
                    log.append((EXECUTOR_HEARTBEAT, heartbeat(executor, t)))
                    pending += scheduler.apply(EXECUTOR_HEARTBEAT, heartbeat(executor, t))

    for executor in ("x1", "x2"):
        feed(EXECUTOR_HEARTBEAT, heartbeat(executor, t))
    for i in range(plans):
        t += 1_000
        feed(PLAN_SUBMITTED, plan(i, t))
    return log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plans", type=int, default=1000)
    args = parser.parse_args()
    settings = Settings()
    codec = AvroCodec()
    log = make_log(args.plans)
    topic = TopicCatalog(settings)["plan_events"].name
    messages = [SourceMessage(topic, 0, n, b"plans", codec.encode(s, r), 0) for n, (s, r) in enumerate(log)]
    intake = Intake(AvroCodec(), TopicCatalog(settings), InputValidator(ToolSchemas.load(settings.tool_schemas)))

    def fold_alone() -> float:
        started = time.perf_counter()
        scheduler = PlanScheduler("bench.work")
        for schema, record in log:
            fold_input(scheduler, schema, record)
        return time.perf_counter() - started

    def refold() -> float:
        started = time.perf_counter()
        scheduler = PlanScheduler("bench.work")
        for message in messages:
            read = intake.read(message)
            assert isinstance(read, Accepted), read
            fold_input(scheduler, read.schema_name, read.record)
        return time.perf_counter() - started

    runs = [(fold_alone(), refold()) for _ in range(3)]  # alternated, so load hits both alike; the best of each
    fold_s, recovery_s = min(f for f, _ in runs), min(r for _, r in runs)

    n = len(log)
    print(f"plans recovery refold: {n:,} plan_events records ({args.plans:,} plans of 20 subgoals)")
    print(f"  decode + validate + fold: {n / recovery_s:,.0f} records/s ({recovery_s:.2f} s)")
    print(f"  baseline, fold alone:     {n / fold_s:,.0f} records/s ({fold_s:.2f} s); ratio {recovery_s / fold_s:.2f}x")
    print(f"  {machine_facts()}; load average {loadavg()}")


if __name__ == "__main__":
    main()
