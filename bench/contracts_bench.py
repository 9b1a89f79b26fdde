"""Contract-check benchmark: `python -m bench.contracts_bench [--steps 600] [--contracts 5] [--repeats 3]`.

On one core, in process (pinned with taskset when it exists), the same file-editing steps (a delta that writes a
file node, a dispatch of one of 4 tools, its tool result), two ways:

- baseline: the `steps` processor's per-event work: decode the input's Avro bytes, fold it into its step
  (processors.steps.assembler), weave, and encode the step's rows, for each dispatch and tool result;
- contracts: the `contracts` processor's work for the same steps: hash and encode a StepEvidence per dispatch and
  result, and fold the state processor's StateVersions (decoded from Avro bytes; made beforehand, as the state
  processor makes them) through processors.contracts.fold with --contracts contracts per tool (each a precondition,
  a parameter constraint and a postcondition, in CEL), the session's fold record read and written per batch of 100,
  and every ContractCheck and `contract` RewardSignal encoded.

Prints input events/s of both (per second of the process's CPU time, runs of the two alternated, so the shared
machine's load skews the ratio less), the ratio (target >= 0.5x), and contract checks/s.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import orjson

from bench.common import loadavg, machine_facts, taskset_available
from processors.contracts.fold import ContractBook, SessionContracts, check_records, contract_signal, fold
from processors.state.graph import MemoryStore, SessionState, StateFold
from processors.steps.assembler import StepAssembler, StepState
from processors.steps.policy import PolicyBook, RewardPolicy
from topics.codec import AvroCodec
from topics.contracts import Contract, WorldCache
from topics.names import CONTRACT_CHECK, DISPATCH, REWARD, STATE_DELTA, STATE_VERSION, STEP_EVIDENCE, TOOL_RESULT

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
    for start in range(0, len(versions), 100):  # the agent's side, per batch
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--contracts", type=int, default=5, help="Contracts per tool.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-pin", action="store_true", help="Do not re-run under taskset -c 1.")
    args = parser.parse_args(argv)
    if not args.no_pin and taskset_available() and os.environ.get("TREADLE_BENCH_PINNED") != "1":
        env = {**os.environ, "TREADLE_BENCH_PINNED": "1"}
        command = ["taskset", "-c", "1", sys.executable, "-m", "bench.contracts_bench", *(argv or sys.argv[1:])]
        return subprocess.call(command, env=env)
    print(machine_facts())
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
    print(f"steps {args.steps} ({len(inputs)} dispatches + results), {args.contracts} contracts per tool "
          f"x {len(TOOLS)} tools, 3 clauses each; CPU time, median of {args.repeats} alternated runs; "
          f"load avg {loadavg()}")  # fmt: skip
    print(f"  baseline  steps processor core      {steps_rate:10,.0f} input events/s")
    print(f"  contracts evidence + checks         {contracts_rate:10,.0f} input events/s   "
          f"{checks / contracts_s:8,.0f} contract checks/s ({checks} checks)")  # fmt: skip
    print(f"  ratio {ratio:.3f}x of the steps processor alone (target >= 0.5x): {'met' if ratio >= 0.5 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
