"""Plans scheduler benchmark: `python -m bench.plans_bench [--plans 1000] [--nodes 20] [--repeats 3] [--codec]`.

On one core, in process (re-run under `taskset -c 1` when taskset exists), no broker: `--plans` plans of `--nodes`
subgoals each (random DAGs: each subgoal depends on up to 3 earlier ones; 70% CPU work of 1-2 slots, 30% GPU work
of 8-40 GB), submitted at once to executors of two classes (8 CPU executors of 16 slots, 4 GPU executors of 80 GB, 2
GPUs, 8 slots) that answer every release at once with SUCCEEDED and heartbeat their capacity every second of event
time (1 ms of event time per status). Every plan runs to PlanFinished.

- fold: `processors.plans.dag.PlanScheduler`, the plans processor's per-event work without Kafka;
- baseline: `NaiveScheduler` below, the same release rule written the obvious way: at every input it recomputes
  each executor's room from its holds and walks every ready subgoal of every class in plan then subgoal order (best
  fit, backfill), where the fold keeps the room and the ready queues incrementally, passes only over a class where a
  subgoal became ready or room grew, and stops a pass once no room covers the smallest profile. The two must
  release the same attempts to the same executors in the same order (checked);
- `--codec`: the fold again with each input decoded from Avro bytes and each decision encoded (the processor's
  per-event cost without Kafka; the executors' encoding of the inputs is not timed).

Only the scheduler's work is timed (CPU time of the process around `apply`, and the codec calls), runs alternated
and the median shown; the driver that plays the executors is not. Prints releases/s and input events/s, the ratio to
the baseline, the load average and the machine.

Not measured here: release latency p50/p99 (the last dependency's success to the executor receiving the work) on
the real stack: `python -m bench.plans_latency_bench`.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.common import loadavg, machine_facts, taskset_available
from processors.plans.dag import MICROS, Decision, PlanScheduler, Resources
from topics.codec import AvroCodec
from topics.names import EXECUTOR_HEARTBEAT, PLAN_FINISHED, PLAN_SUBMITTED, SUBGOAL_RELEASED, SUBGOAL_STATUS

T0 = 1_800_000_000 * MICROS
STATUS_STEP_US = 1_000  # event time between two statuses
HEARTBEAT_EVERY_US = MICROS
EXECUTORS = {
    **{f"cpu-{i}": ("cpu", Resources(0, 0, 16)) for i in range(8)},
    **{f"gpu-{i}": ("gpu", Resources(80_000, 2, 8)) for i in range(4)},
}


def envelope(session: str, logical: str, t: int) -> dict[str, Any]:
    return {"event_id": f"0190b6c2-0000-7000-8000-{abs(hash((logical, t))) % 10**12:012d}", "session_id": session,
            "agent_id": "bench", "episode_id": "ep", "logical_event_id": logical, "seq": 1, "event_time": t,
            "policy_version": "", "trace_id": "", "attributes": {}}  # fmt: skip


def plans(count: int, nodes: int, seed: int) -> list[dict[str, Any]]:
    """`count` PlanSubmitted records of `nodes` subgoals each (random DAGs, seeded)."""
    rng, out = random.Random(seed), []
    for p in range(count):
        subgoals = []
        for i in range(nodes):
            gpu = rng.random() < 0.3
            profile = (
                {"gpu_memory_mb": rng.choice([8_000, 16_000, 24_000, 40_000]), "gpus": rng.randint(0, 1), "cpu": 1}
                if gpu
                else {"gpu_memory_mb": 0, "gpus": 0, "cpu": rng.randint(1, 2)}
            )
            deps = sorted(rng.sample(range(i), min(i, rng.randint(0, 3))))
            subgoals.append({
                "subgoal_id": f"n{i}", "tool": "train" if gpu else "search", "agent": None,
                "params_json": f'{{"k": {i}}}', "resource_class": "gpu" if gpu else "cpu", "profile": profile,
                "deadline_s": 600.0, "retry": {"max_attempts": 2, "backoff_s": 1.0, "backoff_multiplier": 2.0},
                "fallback": None, "depends_on": [f"n{d}" for d in deps],
            })  # fmt: skip
        session = f"bench-{p % 50}"
        out.append({"envelope": envelope(session, f"plan{p}", T0 + p), "plan_id": f"plan{p}", "goal": "bench",
                    "subgoals": subgoals})  # fmt: skip
    return out


def heartbeat(executor_id: str, t: int) -> dict[str, Any]:
    cls, cap = EXECUTORS[executor_id]
    return {"executor_id": executor_id, "resource_class": cls, "free_gpu_memory_mb": cap.gpu_memory_mb,
            "free_gpus": cap.gpus, "free_cpu": cap.cpu, "running": [], "valid_for_s": 1e6, "host": "bench",
            "sent_at": t}  # fmt: skip


def succeeded(released: dict[str, Any], t: int) -> dict[str, Any]:
    return {"envelope": envelope(released["session_id"], released["decision_id"], t),
            "plan_id": released["plan_id"], "subgoal_id": released["subgoal_id"], "attempt": released["attempt"],
            "state": "SUCCEEDED", "executor_id": released["executor_id"], "output_ref": "ref", "error_class": None,
            "error": None}  # fmt: skip


@dataclass
class Run:
    """What one run did: CPU seconds inside the scheduler, inputs, the releases in order, plans finished."""

    cpu_s: float = 0.0
    inputs: int = 0
    releases: list[tuple[str, str, str, int, str]] = field(default_factory=list)
    finished: int = 0


Apply = Callable[[str, dict[str, Any]], list[Decision]]


def drive(submissions: list[dict[str, Any]], apply: Apply) -> Run:
    """Play the executors: heartbeats, every plan submitted, then each release answered with SUCCEEDED in turn."""
    run, pending, clock = Run(), deque(), T0
    clock_cpu = time.process_time

    def feed(schema: str, record: dict[str, Any]) -> None:
        started = clock_cpu()
        out = apply(schema, record)
        run.cpu_s += clock_cpu() - started
        run.inputs += 1
        for d in out:
            if d.schema == SUBGOAL_RELEASED:
                r = d.record
                run.releases.append((r["session_id"], r["plan_id"], r["subgoal_id"], r["attempt"], r["executor_id"]))
                pending.append(r)
            elif d.schema == PLAN_FINISHED:
                run.finished += 1

    for executor_id in EXECUTORS:
        feed(EXECUTOR_HEARTBEAT, heartbeat(executor_id, clock))
    for record in submissions:
        feed(PLAN_SUBMITTED, record)
    clock = max(clock, T0 + len(submissions))
    next_heartbeat = clock + HEARTBEAT_EVERY_US
    while pending:
        clock += STATUS_STEP_US
        feed(SUBGOAL_STATUS, succeeded(pending.popleft(), clock))
        if clock >= next_heartbeat:
            next_heartbeat += HEARTBEAT_EVERY_US
            for executor_id in EXECUTORS:
                feed(EXECUTOR_HEARTBEAT, heartbeat(executor_id, clock))
    return run


def fold_apply() -> Apply:
    return PlanScheduler(work_topic_prefix="bench.work").apply


def codec_apply() -> Apply:
    """The fold behind Avro: each input decoded from bytes, each decision encoded (encoding the input is the
    executors' work: done here too, but its time taken out)."""
    codec, scheduler = AvroCodec(), PlanScheduler(work_topic_prefix="bench.work")
    clock_cpu = time.process_time

    def apply(schema: str, record: dict[str, Any]) -> list[Decision]:
        started = clock_cpu()
        value = codec.encode(schema, record)
        untimed = clock_cpu() - started
        _, decoded = codec.decode(value, schema)
        out = scheduler.apply(schema, decoded)
        for d in out:
            codec.encode(d.schema, d.record)
        apply.untimed += untimed  # type: ignore[attr-defined]
        return out

    apply.untimed = 0.0  # type: ignore[attr-defined]
    return apply


class NaiveScheduler:
    """The baseline: the fold's release rule for this workload (no failures, timeouts or expiring executors), the
    obvious way: at every input, each executor's room from its holds, and every ready subgoal of every class sorted
    and tried in plan then subgoal order."""

    def __init__(self) -> None:
        self.plans: dict[tuple[str, str], tuple[int, dict[str, Any]]] = {}  # (seq, subgoals by id)
        self.state: dict[tuple[str, str, str], str] = {}  # WAITING, READY, RELEASED, SUCCEEDED
        self.ready: dict[tuple[int, int], tuple[tuple[str, str], dict[str, Any]]] = {}
        self.holds: dict[tuple[str, str, str], tuple[str, Resources]] = {}
        self.advertised: dict[str, tuple[str, Resources, int]] = {}

    def apply(self, schema: str, record: dict[str, Any]) -> list[Decision]:
        out = []
        if schema == EXECUTOR_HEARTBEAT:
            free = Resources(record["free_gpu_memory_mb"], record["free_gpus"], record["free_cpu"])
            known = self.advertised.get(record["executor_id"])
            if known is None or record["sent_at"] > known[2]:
                self.advertised[record["executor_id"]] = (record["resource_class"], free, record["sent_at"])
        elif schema == PLAN_SUBMITTED:
            key = (record["envelope"]["session_id"], record["plan_id"])
            self.plans[key] = (len(self.plans), {s["subgoal_id"]: s for s in record["subgoals"]})
            for index, s in enumerate(record["subgoals"]):
                self.state[(*key, s["subgoal_id"])] = "WAITING"
                if not s["depends_on"]:
                    self.make_ready(key, index, s)
        elif schema == SUBGOAL_STATUS and record["state"] == "SUCCEEDED":
            key = (record["envelope"]["session_id"], record["plan_id"])
            node = (*key, record["subgoal_id"])
            if self.state.get(node) == "RELEASED":
                self.state[node] = "SUCCEEDED"
                del self.holds[node]
                subgoals = self.plans[key][1]
                for index, (sid, spec) in enumerate(subgoals.items()):
                    if self.state[(*key, sid)] == "WAITING" and all(
                        self.state[(*key, d)] == "SUCCEEDED" for d in spec["depends_on"]
                    ):
                        self.make_ready(key, index, spec)
                if all(self.state[(*key, sid)] == "SUCCEEDED" for sid in subgoals):
                    out.append(Decision(PLAN_FINISHED, key[0], {"plan_id": key[1]}))
        return self.release() + out

    def make_ready(self, key: tuple[str, str], index: int, spec: dict[str, Any]) -> None:
        self.state[(*key, spec["subgoal_id"])] = "READY"
        self.ready[(self.plans[key][0], index)] = (key, spec)

    def release(self) -> list[Decision]:
        out = []
        for cls in sorted({c for c, _, _ in self.advertised.values()}):
            room = {e: free for e, (c, free, _) in sorted(self.advertised.items()) if c == cls}
            for executor_id, need in self.holds.values():
                if executor_id in room:
                    room[executor_id] = room[executor_id] - need
            for order in sorted(self.ready):
                key, spec = self.ready[order]
                if spec["resource_class"] != cls:
                    continue
                need = Resources.of(spec["profile"])
                fits = [(left - need, e) for e, left in room.items() if left.covers(need)]
                if fits:
                    left, executor_id = min(fits)
                    room[executor_id] = left
                    sid = spec["subgoal_id"]
                    del self.ready[order]
                    self.state[(*key, sid)] = "RELEASED"
                    self.holds[(*key, sid)] = (executor_id, need)
                    out.append(Decision(SUBGOAL_RELEASED, key[0], {
                        "session_id": key[0], "plan_id": key[1], "subgoal_id": sid, "attempt": 1,
                        "executor_id": executor_id, "decision_id": f"{key[0]}/{key[1]}/{sid}/1/released",
                    }))  # fmt: skip
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=20, help="subgoals per plan")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline-repeats", type=int, default=1, help="runs of the (slow) naive baseline")
    parser.add_argument("--codec", action="store_true", help="also time the fold behind Avro decode/encode")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-pin", action="store_true", help="Do not re-run under taskset -c 1.")
    args = parser.parse_args(argv)
    if not args.no_pin and taskset_available() and os.environ.get("TREADLE_BENCH_PINNED") != "1":
        env = {**os.environ, "TREADLE_BENCH_PINNED": "1"}
        command = ["taskset", "-c", "1", sys.executable, "-m", "bench.plans_bench", *(argv or sys.argv[1:])]
        return subprocess.call(command, env=env)
    print(machine_facts())
    submissions = plans(args.plans, args.nodes, args.seed)
    drive(plans(20, args.nodes, args.seed + 1), codec_apply())  # warm up (imports, codec caches) before timing
    folds, naives, codecs = [], [], []
    for k in range(args.repeats):  # alternated, so a change in the machine's load falls on all
        folds.append(drive(submissions, fold_apply()))
        if k < args.baseline_repeats:
            naives.append(drive(submissions, NaiveScheduler().apply))
        if args.codec:
            apply = codec_apply()
            run = drive(submissions, apply)
            run.cpu_s -= apply.untimed  # type: ignore[attr-defined]
            codecs.append(run)
    fold, naive = folds[0], naives[0]
    total = args.plans * args.nodes
    problems = []
    if len(fold.releases) != total or fold.finished != args.plans:
        problems.append(f"the fold released {len(fold.releases)} of {total}, finished {fold.finished} plans")
    if naive.releases != fold.releases:
        same = next((i for i, (a, b) in enumerate(zip(naive.releases, fold.releases, strict=False)) if a != b), None)
        problems.append(f"the baseline released differently (first difference at release {same})")
    if any(r.releases != fold.releases for r in folds + codecs):
        problems.append("a repeat released differently")

    def rate(runs: list[Run]) -> tuple[float, float, float]:
        cpu = statistics.median(r.cpu_s for r in runs)
        return len(runs[0].releases) / cpu, runs[0].inputs / cpu, cpu

    print(f"{args.plans} plans x {args.nodes} subgoals ({total} releases), {len(EXECUTORS)} executors answering at "
          f"once; CPU time in the scheduler, median of {args.repeats} alternated runs (baseline: "
          f"{args.baseline_repeats}); load avg {loadavg()}")  # fmt: skip
    fold_rate, fold_inputs, fold_cpu = rate(folds)
    naive_rate, naive_inputs, naive_cpu = rate(naives)
    print(f"  baseline  naive rescan scheduler     {naive_rate:10,.0f} releases/s {naive_inputs:10,.0f} inputs/s "
          f"({naive_cpu:.2f} s)")  # fmt: skip
    print(f"  fold      PlanScheduler              {fold_rate:10,.0f} releases/s {fold_inputs:10,.0f} inputs/s "
          f"({fold_cpu:.2f} s)   {fold_rate / naive_rate:.1f}x the baseline")  # fmt: skip
    if codecs:
        codec_rate, codec_inputs, codec_cpu = rate(codecs)
        print(f"  codec     Avro decode + fold + encode {codec_rate:9,.0f} releases/s {codec_inputs:10,.0f} "
              f"inputs/s ({codec_cpu:.2f} s)   {codec_rate / fold_rate:.2f}x the fold alone")  # fmt: skip
    print("  release latency p50/p99 on the real stack: python -m bench.plans_latency_bench")
    for problem in problems:
        print(f"  CHECK FAILED: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
