"""Contract-check benchmark: `python -m bench.contracts_bench [--only core|worker] [--steps 600] [--contracts 5]`.

Two sections over the same file-editing steps (a delta that writes a file node, a dispatch of one of 4 tools, its
tool result), 5 contracts per tool by default.

Core (`--only core`), on one core, in process (pinned with taskset when it exists), two ways:

- baseline: the `steps` processor's per-event work: decode the input's Avro bytes, fold it into its step
  (processors.steps.assembler), weave, and encode the step's rows, for each dispatch and tool result;
- contracts: the `contracts` processor's work for the same steps: hash and encode a StepEvidence per dispatch and
  result, and fold the state processor's StateVersions (decoded from Avro bytes; made beforehand, as the state
  processor makes them) through processors.contracts.fold with --contracts contracts per tool (each a precondition,
  a parameter constraint and a postcondition, in CEL), the session's fold record read and written per batch of 100,
  and every ContractCheck and `contract` RewardSignal encoded.

Prints input events/s of both (per second of the process's CPU time, runs of the two alternated, so the shared
machine's load skews the ratio less), their ratio, and contract checks/s.

Worker (`--only worker`), the ratio issue #24's target (>= 0.5x) names: a real `treadle worker` pinned to one core
(taskset, when it exists) on a private local stack, sink off, catching up a backlog of the steps' dispatches and
results, two ways, each run on a fresh topic prefix and app id, the runs alternated (--repeats):

- A: TREADLE_PROCESSORS=steps; the clock stops when every step's final Transition is on its topic;
- B: TREADLE_PROCESSORS=steps,contracts, its contracts registered on the contracts topic as `treadle contracts
  register` does (effective from event time 0), and the steps' StateVersions on the state_versions topic as a
  separate `state` worker publishes them (made beforehand by the state fold, 3 per step: its delta, dispatch and
  result; produced once B reads its first input record; the state processor's own cost is issue #28's, not part of
  this ratio). B reads those versions too,
  publishes a StepEvidence per input event and the ContractChecks and `contract` RewardSignals, and weaves those
  signals into its steps (so its final Transitions are later revisions); its clock stops when every final
  Transition, ContractCheck and StepEvidence is on its topic.

Each worker is started once on its prefix before its backlog is produced (its changelogs exist, as after downtime).
Both clocks (and CPU counts) start at the worker's first input record (FirstInput). The expected outputs come from
an in-process fold of the same events; a run that misses one, or shows one not expected or twice, fails the bench.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.common import loadavg, machine_facts, taskset_available
from processors.contracts.fold import ContractBook, SessionContracts, check_records, contract_signal, fold
from processors.state.graph import MemoryStore, SessionState, StateFold
from processors.steps.assembler import StepAssembler, StepState
from processors.steps.policy import PolicyBook, RewardPolicy
from topics.codec import AvroCodec
from topics.contracts import Contract, WorldCache
from topics.names import (
    CONTRACT_CHECK,
    DISPATCH,
    REWARD,
    STATE_DELTA,
    STATE_VERSION,
    STEP_EVIDENCE,
    TOOL_RESULT,
    TRANSITION,
)

CPU_RESOLUTION_S = 0.05  # below it, CPU per event from /proc ticks is noise (a --quick run)
TOOLS = ("write_file", "read_file", "append_file", "touch_file")
SESSIONS = 8
T0 = 1_760_000_000_000_000


def contracts(per_tool: int) -> list[Contract]:
    """`per_tool` contracts per tool, each with one clause per phase (like the docs' file-editing example)."""
    out = []
    for tool in TOOLS:
        for k in range(per_tool):
            out.append(
                Contract(
                    name=f"{tool}-{k}",
                    tool=tool,
                    version=1,
                    node_types=["file"],
                    preconditions=[{"files": f"size(state.nodes) >= {k % 2}"}],
                    params=[{"exists": 'params.path in state.nodes && state.nodes[params.path].type == "file"'}],
                    postconditions=[{"ok": f'result.status == "OK" || result.latency_ms > {k}.0'}],
                )
            )
    return out


def envelope(session: str, seq: int, lid: str | None = None) -> dict[str, Any]:
    eid = f"{session}-e{seq}"
    return {"event_id": eid, "session_id": session, "agent_id": "bench", "episode_id": "ep",
            "logical_event_id": lid or eid, "seq": seq, "event_time": T0 + seq, "policy_version": "v1",
            "trace_id": "", "attributes": {"host": "bench-1", "tool_version": "1.0"}}  # fmt: skip


def workload(steps: int) -> list[tuple[str, dict[str, Any]]]:
    """Each session's events in seq order; sessions interleaved."""
    per_session: list[list[tuple[str, dict]]] = [[] for _ in range(SESSIONS)]
    for i in range(steps):
        s = i % SESSIONS
        session, seq = f"bench-{s}", len(per_session[s]) * 2
        lid, path = f"bench-{s}-step{i}", f"f{i % 5}.txt"
        upsert = {"id": path, "type": "file", "data_json": orjson.dumps({"hash": f"h{i}"}).decode(),
                  "ttl_seconds": None}  # fmt: skip
        per_session[s] += [
            (STATE_DELTA, {"envelope": envelope(session, seq), "node_upserts": [upsert], "node_deletes": [],
                           "edge_upserts": [], "edge_deletes": [], "rollback_to": None}),
            (DISPATCH, {"envelope": envelope(session, seq + 1, lid), "step": i, "tool": TOOLS[i % len(TOOLS)],
                        "params_json": orjson.dumps({"path": path if i % 7 else "missing.txt"}).decode(),
                        "deadline": None}),
            (TOOL_RESULT, {"envelope": envelope(session, seq + 2, lid), "tool": TOOLS[i % len(TOOLS)],
                           "status": "OK" if i % 11 else "ERROR", "output": "written", "error": None,
                           "latency_ms": 3.0, "cost_usd": 0.0, "tokens_in": 0, "tokens_out": 0, "retries": 0}),
        ]  # fmt: skip
    out = []
    for k in range(max(len(p) for p in per_session)):
        out += [p[k] for p in per_session if k < len(p)]
    return out


def state_versions(events: list[tuple[str, dict]]) -> list[bytes]:
    codec, fold_ = AvroCodec(), StateFold()
    states = {s: (SessionState(s), MemoryStore()) for s in {r["envelope"]["session_id"] for _, r in events}}
    out = []
    for schema, record in events:
        state, store = states[record["envelope"]["session_id"]]
        out.append(codec.encode(STATE_VERSION, fold_.apply(state, store, schema, record)))
    return out


def run_steps(inputs: list[tuple[str, bytes]]) -> float:
    codec, assembler, states = AvroCodec(), StepAssembler(PolicyBook([RewardPolicy()])), {}
    started = time.process_time()
    for schema, value in inputs:
        _, record = codec.decode(value, schema)
        lid = record["envelope"]["logical_event_id"]
        state = states.get(lid) or states.setdefault(lid, StepState(lid))
        if assembler.fold(state, schema, record, value):
            for out_schema, row in assembler.outputs(state):
                codec.encode(out_schema, row)
    return time.process_time() - started


def run_contracts(inputs: list[tuple[str, bytes]], versions: list[bytes], book: ContractBook) -> tuple[float, int]:
    codec, table, checks, worlds = AvroCodec(), {}, 0, WorldCache()
    started = time.process_time()
    for schema, value in inputs:  # provenance: the processor's input side
        _, record = codec.decode(value, schema)
        env = record["envelope"]
        evidence = {"event_id": env["event_id"], "session_id": env["session_id"], "episode_id": env["episode_id"],
                    "logical_event_id": env["logical_event_id"], "schema_name": schema, "tool": record["tool"],
                    "sha256": hashlib.sha256(value).hexdigest(), "size_bytes": len(value),
                    "attributes": env["attributes"], "event_time": env["event_time"]}  # fmt: skip
        codec.encode(STEP_EVIDENCE, evidence)
    for start in range(0, len(versions), 100):  # the versions' side, per batch
        sessions: dict[str, SessionContracts] = {}
        for value in versions[start : start + 100]:
            _, version = codec.decode(value, STATE_VERSION)
            key = version["session_id"]
            session = sessions.get(key) or sessions.setdefault(key, SessionContracts.from_bytes(table.get(key)))
            checked = fold(session, version, book, worlds)
            if checked is None:
                continue
            for record in check_records(checked):
                codec.encode(CONTRACT_CHECK, record)
                checks += 1
            signal = contract_signal(checked)
            if signal is not None:
                codec.encode(REWARD, signal)
        for key, session in sessions.items():
            table[key] = session.to_bytes()
    return time.process_time() - started, checks


def core_section(args: argparse.Namespace) -> int:
    """The in-process cores, each run's CPU time (this process pinned to one core by main)."""
    codec = AvroCodec()
    events = workload(args.steps)
    inputs = [(s, codec.encode(s, r)) for s, r in events if s in (DISPATCH, TOOL_RESULT)]
    versions = state_versions(events)
    book = ContractBook(contracts(args.contracts))
    steps_s, runs = [], []
    for _ in range(args.repeats):  # alternated, so a change in the machine's load falls on both
        steps_s.append(run_steps(inputs))
        runs.append(run_contracts(inputs, versions, book))
    contracts_s, checks = statistics.median(r[0] for r in runs), runs[0][1]
    steps_rate, contracts_rate = len(inputs) / statistics.median(steps_s), len(inputs) / contracts_s
    ratio = contracts_rate / steps_rate
    print(f"core, in process, one core: steps {args.steps} ({len(inputs)} dispatches + results), {args.contracts} "
          f"contracts per tool x {len(TOOLS)} tools, 3 clauses each; CPU time, median of {args.repeats} alternated "
          f"runs; load avg {loadavg()}")  # fmt: skip
    print(f"  baseline  steps processor core      {steps_rate:10,.0f} input events/s")
    print(f"  contracts evidence + checks         {contracts_rate:10,.0f} input events/s   "
          f"{checks / contracts_s:8,.0f} contract checks/s ({checks} checks)")  # fmt: skip
    print(f"  ratio {ratio:.3f}x of the steps processor's core alone (the cores only: the issue's target is the "
          "worker's, below)")  # fmt: skip
    if checks != len(expected_outputs(events, versions, book)[1].checks):
        print("  [wrong] the core's check count differs from the expected outputs'")
        return 1
    return 0


# --- the worker section ---------------------------------------------------------------------------------------


@dataclass
class Expected:
    """What a worker must publish for the backlog: final Transition revisions by step, check ids, evidence ids."""

    transitions: dict[str, int]
    checks: set[str] = field(default_factory=set)
    evidence: set[str] = field(default_factory=set)


def expected_outputs(
    events: list[tuple[str, dict]], versions: list[bytes], book: ContractBook
) -> tuple[Expected, Expected]:
    """(A's, B's) expected outputs, from the processors' own folds in process: the contract fold over the versions
    (its checks, and its `contract` signals, which B's steps processor weaves into a later revision)."""
    codec, worlds, sessions = AvroCodec(), WorldCache(), {}
    checks, signals = set(), []
    for value in versions:
        _, version = codec.decode(value, STATE_VERSION)
        key = version["session_id"]
        session = sessions.get(key) or sessions.setdefault(key, SessionContracts.from_bytes(None))
        checked = fold(session, version, book, worlds)
        if checked is None:
            continue
        checks.update(record["check_id"] for record in check_records(checked))
        signal = contract_signal(checked)
        if signal is not None:
            signals.append(signal)
    inputs = [(s, r) for s, r in events if s in (DISPATCH, TOOL_RESULT)]

    def finals(rewards: list[dict[str, Any]]) -> dict[str, int]:
        assembler, states, out = StepAssembler(PolicyBook([RewardPolicy()])), {}, {}
        for schema, record in [*inputs, *((REWARD, r) for r in rewards)]:
            lid = record["envelope"]["logical_event_id"]
            state = states.get(lid) or states.setdefault(lid, StepState(lid))
            if assembler.fold(state, schema, record):
                for out_schema, row in assembler.outputs(state):
                    if out_schema == TRANSITION:
                        out[lid] = max(out.get(lid, 0), row["revision"])
        return out

    evidence = {r["envelope"]["event_id"] for _, r in inputs}
    return Expected(finals([])), Expected(finals(signals), checks, evidence)


@dataclass
class ReadBack:
    """What the output topics showed: the Unix time the last expected output arrived, and anything wrong."""

    done_at: float | None = None
    final: int = 0
    checks: int = 0
    evidence: int = 0
    wrong: list[str] = field(default_factory=list)


async def read_back(settings: Any, want: Expected, timeout: float, reading: Any) -> ReadBack:
    """Read transitions, contract_checks and step_evidence from the beginning until every expected output is there;
    count what should not be (a revision above the final one, an unknown check or evidence, one read twice)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from topics.catalog import TopicCatalog

    catalog, codec = TopicCatalog(settings), AvroCodec()
    schemas = {catalog["transitions"].name: TRANSITION, catalog["contract_checks"].name: CONTRACT_CHECK,
               catalog["step_evidence"].name: STEP_EVIDENCE}  # fmt: skip
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, enable_auto_commit=False,
                                auto_offset_reset="earliest", max_poll_records=5000)  # fmt: skip
    await consumer.start()
    out = ReadBack()
    try:
        partitions = [TopicPartition(name, p) for name in schemas for p in range(settings.partitions)]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        reading.set()
        pending, checks, evidence = dict(want.transitions), set(want.checks), set(want.evidence)
        seen: set[tuple[str, Any]] = set()
        over = unknown = twice = 0
        deadline = time.monotonic() + timeout
        while (pending or checks or evidence) and time.monotonic() < deadline:
            for tp, messages in (await consumer.getmany(timeout_ms=100, max_records=5000)).items():
                schema = schemas[tp.topic]
                for message in messages:
                    record = codec.decode(message.value, schema)[1]
                    if schema == TRANSITION:
                        lid, key = record["logical_event_id"], (record["logical_event_id"], record["revision"])
                        expected = want.transitions.get(lid)
                        if expected is None or record["revision"] > expected:
                            over += 1
                        elif record["revision"] == expected:
                            pending.pop(lid, None)
                    else:
                        key = (schema, record["check_id"] if schema == CONTRACT_CHECK else record["event_id"])
                        known = want.checks if schema == CONTRACT_CHECK else want.evidence
                        if key[1] not in known:
                            unknown += 1
                        (checks if schema == CONTRACT_CHECK else evidence).discard(key[1])
                    twice += key in seen
                    seen.add(key)
        if not (pending or checks or evidence):
            out.done_at = time.time()
        else:
            out.wrong.append(f"TIMED OUT: missing {len(pending)} final Transitions, {len(checks)} ContractChecks, "
                             f"{len(evidence)} StepEvidence")  # fmt: skip
        out.final = len(want.transitions) - len(pending)
        out.checks, out.evidence = len(want.checks) - len(checks), len(want.evidence) - len(evidence)
        if over:
            out.wrong.append(f"{over} Transitions above their step's final revision (or of no step)")
        if unknown:
            out.wrong.append(f"{unknown} ContractCheck/StepEvidence records not expected")
        if twice:
            out.wrong.append(f"{twice} outputs read twice (reprocessing)")
        return out
    finally:
        await consumer.stop()


@dataclass
class WorkerRun:
    """One worker's catch-up: input events, seconds and worker CPU seconds from its first input record."""

    name: str
    events: int
    elapsed_s: float
    cpu_s: float
    startup_cpu_s: float  # the worker's CPU before its first input record (not counted)
    got: ReadBack

    @property
    def rate(self) -> float:
        return self.events / self.elapsed_s

    @property
    def cpu_us(self) -> float:
        return 1e6 * self.cpu_s / self.events


async def register_contracts(settings: Any, per_tool: list[Contract]) -> None:
    """The `file` node type and the contracts, through the registries `treadle contracts register` uses."""
    from topics.catalog import TopicCatalog
    from topics.contract_registry import ContractRegistry
    from topics.node_types import NodeTypeRegistry

    catalog = TopicCatalog(settings)
    schema = {"type": "object", "required": ["hash"], "properties": {"hash": {"type": "string"}}}
    await NodeTypeRegistry(settings.kafka_bootstrap_servers, catalog["node_types"].name).register("file", schema)
    registry = ContractRegistry(settings.kafka_bootstrap_servers, catalog["contracts"].name, catalog["node_types"].name)
    for contract in per_tool:
        await registry.register(contract)


def worker_run(
    base: Any, name: str, processors: tuple[str, ...], backlog: list[tuple[str, bytes, bytes]], want: Expected,
    book: list[Contract], *, pin: bool, timeout: float, profile: Path | None = None,
) -> WorkerRun:  # fmt: skip
    """Put `backlog` ((topic kind, key, value)) in Kafka under a fresh prefix, start the worker, time its catch-up.

    StateVersions are produced once the worker has read its first input record (FirstInput, where the clock starts),
    as fast as the broker takes them: the contracts processor reads them apart from its inputs, which would otherwise
    fold some before that record and leave their cost out of the count."""
    import asyncio

    from bench.common import cpu_seconds
    from bench.worker_bench import READY_TIMEOUT_S, BenchWorker, InputRecord, _preload, py_spy, stop_spy
    from streams.runtime.run_info import FirstInput
    from streams.runtime.worker import prepare_cluster
    from topics.catalog import TopicCatalog

    settings = base.model_copy(update={"processors": processors, "sink": "off", "topic_prefix": name, "app_id": name,
                                       "home": base.home / name})  # fmt: skip
    settings.home.mkdir(parents=True, exist_ok=True)
    asyncio.run(prepare_cluster(settings))
    if "contracts" in processors:
        asyncio.run(register_contracts(settings, book))
    # Started once before, as a worker catching up after downtime has been: its table changelogs exist. On a fresh
    # prefix the newest changelog (the contracts table's) can miss the first assignment on a busy broker, and the
    # worker then rebalances mid-backlog (seen here: once ten seconds late, once not done after minutes).
    warm = BenchWorker(settings, pin).start()
    try:
        warm.wait_ready(READY_TIMEOUT_S)
    finally:
        warm.stop()
    catalog = TopicCatalog(settings)
    records = [InputRecord(catalog[kind].name, key, value) for kind, key, value in backlog]
    later = [r for r in records if r.topic == catalog["state_versions"].name]
    asyncio.run(_preload(settings, [r for r in records if r.topic != catalog["state_versions"].name]))
    worker = BenchWorker(settings, pin)
    spy = None

    async def first_input() -> FirstInput:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            first = FirstInput.read(settings)
            if first is not None and first.pid == worker.pid:
                return first
            await asyncio.sleep(0.005)
        raise TimeoutError(f"the worker read no input in {READY_TIMEOUT_S:.0f}s; log {worker.log_path}")

    async def run() -> ReadBack:
        nonlocal spy
        reading = asyncio.Event()
        reader = asyncio.create_task(read_back(settings, want, timeout + READY_TIMEOUT_S, reading))
        await reading.wait()
        worker.start()
        ready = asyncio.create_task(asyncio.to_thread(worker.wait_ready, READY_TIMEOUT_S))
        await first_input()
        spy = py_spy(worker.pid, profile) if profile is not None else None
        if later:
            await _preload(settings, later)
        await ready
        return await reader

    try:
        got = asyncio.run(run())
        cpu_after = cpu_seconds(worker.pid)
        first = FirstInput.read(settings)
        stop_spy(spy)
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
        worker.stop()
    assert first is not None  # run() waited for it
    events = len(backlog) - len(later)
    elapsed = (got.done_at - first.read_at) if got.done_at is not None else float("nan")
    cpu = cpu_after - first.cpu_s if cpu_after is not None else float("nan")
    if cpu < CPU_RESOLUTION_S:  # /proc counts CPU in ticks; the worker's own clock (process_time) does not
        cpu = float("nan")
    return WorkerRun(name, events, elapsed, cpu, first.cpu_s, got)


def worker_section(args: argparse.Namespace) -> int:
    """A (steps) and B (steps,contracts) catching up the same backlog, alternated; 1 when an output was wrong."""
    from bench.common import bench_settings, keep_off_worker_core, local_stack

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # NotLeaderForPartition on new topics: retried
    pin = not args.no_pin and taskset_available()
    keep_off_worker_core(pin)  # Kafka, started below, inherits this: the worker's core is its own
    codec, per_tool = AvroCodec(), contracts(args.contracts)
    events = workload(args.worker_steps)
    versions = state_versions(events)
    want_a, want_b = expected_outputs(events, versions, ContractBook(per_tool))
    kinds = {DISPATCH: "actions", TOOL_RESULT: "tool_results"}
    inputs = [(kinds[s], r["envelope"]["session_id"].encode(), codec.encode(s, r)) for s, r in events if s in kinds]
    sessions = [r["envelope"]["session_id"].encode() for s, r in events]
    backlog_b = inputs + [("state_versions", key, value) for key, value in zip(sessions, versions, strict=True)]
    runs: dict[str, list[WorkerRun]] = {"A": [], "B": []}
    wrong: list[str] = []
    with tempfile.TemporaryDirectory() as home:
        run_id = f"contractsbench{int(time.time())}"
        base = bench_settings(Path(home), run_id, args.partitions)
        with local_stack(base) as took:
            print(f"worker: local stack up in {took:.1f}s; {'taskset -c 1' if pin else 'not pinned'}; sink off; "
                  f"{args.worker_steps} steps over {SESSIONS} sessions = {len(inputs)} input events (dispatch + "
                  f"result) in Kafka before each worker starts; B's {len(versions)} StateVersions produced when it "
                  "reads the first")  # fmt: skip
            for r in range(args.repeats):
                order = ("A", "B") if r % 2 == 0 else ("B", "A")  # alternated: drift in the load falls on both
                for which in order:
                    processors = ("steps",) if which == "A" else ("steps", "contracts")
                    run = worker_run(
                        base, f"{run_id}{which.lower()}{r}", processors, inputs if which == "A" else backlog_b,
                        want_a if which == "A" else want_b, per_tool, pin=pin, timeout=args.timeout,
                        profile=args.profile if which == "B" and r == 0 else None,
                    )  # fmt: skip
                    runs[which].append(run)
                    got = run.got
                    print(f"  run {r + 1} {which}: {run.rate:8,.0f} input events/s, {run.cpu_us:6,.0f} us worker CPU "
                          f"per input event ({run.elapsed_s:.2f}s, {run.cpu_s:.2f}s CPU; {run.startup_cpu_s:.1f}s "
                          f"before the first input); {got.final} final Transitions, {got.checks} ContractChecks, "
                          f"{got.evidence} StepEvidence; load avg "
                          f"{loadavg()}")  # fmt: skip
                    wrong += [f"run {r + 1} {which}: {w}" for w in got.wrong]
    a, b = runs["A"], runs["B"]
    rate_a, rate_b = statistics.median(x.rate for x in a), statistics.median(x.rate for x in b)
    cpu_a, cpu_b = statistics.median(x.cpu_us for x in a), statistics.median(x.cpu_us for x in b)
    print(f"worker, median of {args.repeats} alternated runs each, clock and CPU from the worker's first input record "
          f"to the last expected output read back; load avg {loadavg()}")  # fmt: skip
    print(f"  A baseline: TREADLE_PROCESSORS=steps     {rate_a:8,.0f} input events/s  {cpu_a:6,.0f} us CPU/event "
          f"({len(want_a.transitions)} final Transitions)")  # fmt: skip
    print(f"  B TREADLE_PROCESSORS=steps,contracts    {rate_b:8,.0f} input events/s  {cpu_b:6,.0f} us CPU/event "
          f"({len(want_b.checks)} ContractChecks = {len(want_b.checks) * rate_b / len(inputs):,.0f} checks/s, "
          f"{len(want_b.evidence)} StepEvidence; the final Transitions carry the `contract` signals)")  # fmt: skip
    per_input = len(versions) / len(inputs)
    print(f"    B also reads the {len(versions)} StateVersions a separate state worker published ({per_input:.1f} "
          "per input event: the delta's, the dispatch's and the result's); the state processor's own cost "
          "(issue #28) is not in B")  # fmt: skip
    by_rate, by_cpu = rate_b / rate_a, cpu_a / cpu_b
    verdict = "met" if by_rate >= 0.5 else "NOT met"
    print(f"  ratio B/A {by_rate:.3f}x in input events/s, {by_cpu:.3f}x in input events per worker CPU second "
          f"(issue #24's target >= 0.5x of the worker's throughput without contracts: {verdict})")  # fmt: skip
    for line in wrong:
        print(f"  [wrong] {line}")
    return 1 if wrong else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("core", "worker"), help="One section (default: both).")
    parser.add_argument("--steps", type=int, default=600, help="Steps of the core section.")
    parser.add_argument("--worker-steps", type=int, default=10_000, help="Steps of the worker section's backlog.")
    parser.add_argument("--contracts", type=int, default=5, help="Contracts per tool.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=4, help="Partitions of the worker section's topics.")
    parser.add_argument("--timeout", type=float, default=300.0, help="Seconds a worker run may take to catch up.")
    parser.add_argument("--quick", action="store_true", help="Small N, one run each: checks the outputs, not speed.")
    parser.add_argument("--profile", type=Path, help="py-spy (raw) the first B worker from its first input record.")
    parser.add_argument("--no-pin", action="store_true", help="Do not pin to one core with taskset.")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.worker_steps, args.repeats, args.timeout = 60, 120, 1, 120.0
    pinned_child = os.environ.get("TREADLE_BENCH_PINNED") == "1"
    if not pinned_child:
        print(machine_facts())
    failed = 0
    if args.only in (None, "core"):
        if not args.no_pin and taskset_available() and not pinned_child:  # the core section alone on core 1
            env = {**os.environ, "TREADLE_BENCH_PINNED": "1"}
            given = argv if argv is not None else sys.argv[1:]  # argparse keeps the last --only: core
            command = ["taskset", "-c", "1", sys.executable, "-m", "bench.contracts_bench", *given, "--only", "core"]
            failed |= subprocess.call(command, env=env)
        else:
            failed |= core_section(args)
    if args.only in (None, "worker") and not pinned_child:
        failed |= worker_section(args)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
