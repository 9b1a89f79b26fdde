"""Action contracts without Kafka: the CEL binding (state, params and result views), registration refusals, the
action mask against a direct evaluation, and the fold over real state versions (deterministic across a restart)."""

from __future__ import annotations

import uuid
from typing import Any

import cel
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processors.contracts.fold import (
    _NAMESPACE,
    SOURCE,
    ContractBook,
    SessionContracts,
    check_id,
    check_records,
    contract_signal,
    fold,
)
from processors.contracts.processor import ContractsProcessor
from processors.rewards import signal_id
from processors.state.graph import MemoryStore, SessionState, StateFold
from sinks.rows import TABLE_COLUMNS, rows_for
from topics.contracts import (
    Clause,
    CompiledContract,
    Contract,
    ContractError,
    Outcome,
    Phase,
    WorldCache,
    available_actions,
    bind,
    check_post,
    check_pre,
    compile_clauses,
    effective,
    engine_source,
    load_contract,
    registration_problems,
    result_view,
    state_view,
    world_views,
)
from topics.names import CONTRACT_CHECK, DISPATCH, REWARD, STATE_DELTA, STEP_EVIDENCE, TOOL_RESULT
from treadle.testing import check_publish, dispatch, run_sync, tool_result

WRITE_FILE = """
tool: write_file
description: write only to files that exist; after a write the file node's hash changes
node_types: [file]
preconditions:
  - some_file: 'state.nodes.exists(n, state.nodes[n].type == "file")'
params:
  - file_exists: 'params.path in state.nodes && state.nodes[params.path].type == "file"'
postconditions:
  - succeeded: 'result.status == "OK"'
  - hash_changed: 'state.nodes[params.path].data.hash != before.nodes[params.path].data.hash'
"""


def write_file(**changes: Any) -> Contract:
    return load_contract(WRITE_FILE).model_copy(update={"version": 1, **changes})


def files(**hashes: str) -> dict[str, tuple[str, Any]]:
    return {name: ("file", {"hash": h}) for name, h in hashes.items()}


# -- the binding -----------------------------------------------------------------------------------------------------


def test_a_precondition_and_a_parameter_constraint_see_the_state_the_agent_acted_on() -> None:
    contract = CompiledContract(write_file())
    (ok,) = check_pre([contract], "s.3.a", files(**{"a.txt": "h1"}), {"path": "a.txt"})
    assert (ok.outcome, ok.clause, ok.phase) == (Outcome.PASSED, None, Phase.PRE)
    (bad,) = check_pre([contract], "s.3.a", files(**{"a.txt": "h1"}), {"path": "b.txt"})
    assert (bad.outcome, bad.clause, bad.failed) == (Outcome.VIOLATED, "file_exists", ("file_exists",))
    assert bad.values == {"params": {"path": "b.txt"}, "state_version": "s.3.a", "nodes": {}}
    (empty,) = check_pre([contract], "s.0.genesis", {}, {"path": "a.txt"})
    assert empty.outcome is Outcome.VIOLATED and empty.failed == ("some_file", "file_exists")


def test_a_postcondition_compares_the_state_before_and_after_and_reads_the_result() -> None:
    contract = CompiledContract(write_file())
    before = ("s.1.a", files(**{"a.txt": "h1"}))
    result = {"status": "OK", "output": '{"bytes": 3}', "latency_ms": 4.0}
    (ok,) = check_post([contract], before, ("s.3.b", files(**{"a.txt": "h2"})), {"path": "a.txt"}, result)
    assert ok.outcome is Outcome.PASSED
    (same,) = check_post([contract], before, ("s.3.b", files(**{"a.txt": "h1"})), {"path": "a.txt"}, result)
    assert (same.outcome, same.clause) == (Outcome.VIOLATED, "hash_changed")
    assert same.values["before_nodes"]["a.txt"]["data"] == {"hash": "h1"} == same.values["nodes"]["a.txt"]["data"]
    assert same.values["result"] == {"status": "OK", "error": None, "output": '{"bytes": 3}'}
    (gone,) = check_post([contract], before, ("s.3.b", {}), {"path": "a.txt"}, result)
    assert gone.outcome is Outcome.NOT_EVALUABLE and gone.clause == "hash_changed" and "no such key" in gone.reason


def test_the_result_view_parses_json_output_and_a_non_bool_clause_is_not_evaluable() -> None:
    contract = CompiledContract(
        Contract(tool="t", postconditions=[{"small": "result.json.bytes < 10"}, {"number": "result.latency_ms"}])
    )
    (check,) = check_post([contract], None, ("v", {}), {}, {"status": "OK", "output": '{"bytes": 3}'})
    assert check.outcome is Outcome.NOT_EVALUABLE and check.failed == ("number",)
    assert "not a bool" in check.reason


def test_the_state_view_leaves_out_the_graphs_own_step_nodes() -> None:
    view = state_view("v", {"a": ("file", {}), "action:1": ("action", {}), "result:1": ("tool_result", {})})
    assert view == {"version": "v", "nodes": {"a": {"id": "a", "type": "file", "data": {}}}}


# -- the engine: the same meaning, deterministic ---------------------------------------------------------------------


def test_the_engine_source_indexes_fields_but_has_tests_and_literals_and_orders_macro_ranges() -> None:
    assert engine_source('params.path in state.nodes && state.nodes[params.path].type == "x.y"') == (
        'params["path"] in treadle_state_nodeopts && treadle_state_nodeopts[params["path"]].value()["type"] == "x.y"'
    )
    assert engine_source("has(state.nodes.a) && r'\\'.size() == 1 // state.nodes") == (
        "has(treadle_state_nodeopts.a) && r'\\'.size() == 1 // state.nodes"
    )
    assert engine_source("size(state.nodes[state.nodes.map(k, k)[0]].data) > size(before.nodes)") == (
        'size(treadle_state_nodeopts[treadle_state_nodeopts.treadle_ordered().map(k, k)[0]].value()["data"]) > '
        "size(treadle_before_nodeopts)"
    )
    for whole in ("state.nodes == before.nodes", "[state.nodes][0].a.type == 'f'", "state.nodes[?'a'].hasValue()"):
        assert "nodeopts" not in engine_source(whole), whole  # the map used whole: the plain map
    assert engine_source("before.nodes.exists(n, n.startsWith('a')) && state != before") == (
        "treadle_before_nodeopts.treadle_ordered().exists(n, n.startsWith('a')) && state != before"
    )
    assert (
        engine_source("[1].exists(state, state.nodes == 1)")
        == '[1].treadle_ordered().exists(state, state["nodes"] == 1)'
    )


WORLD = st.dictionaries(
    st.sampled_from(["a", "b", "c", "d", "e", "f"]),
    st.tuples(st.sampled_from(["file", "dir"]), st.dictionaries(st.sampled_from(["h", "size"]), st.integers(0, 9))),
    max_size=6,
)
PLAIN_CLAUSES = [
    "size(state.nodes) > 2",
    "params.path in state.nodes && state.nodes[params.path].data.h > 4",
    "state.nodes[params.path].type == 'file' || state.version == 'v'",
    "has(state.nodes.a) ? state.nodes.a.data.size < 5 : params.path != 'a'",
    "state.nodes.exists(n, has(state.nodes[n].data.h) && state.nodes[n].data.h > 7)",
    "state.nodes.a.data.h + state.nodes.b.data.h > 9",
    "state.nodes.all(k, state.nodes[k].type == 'file') && size(state.nodes) == state.nodes.size()",
    "has(state.nodes[params.path].data.h) && !(params.path in state.nodes && state.nodes == state.nodes)",
    "state.nodes.filter(k, state.nodes[k].type == 'file').size() <= size(state.nodes)",
]


@settings(max_examples=80, deadline=None)
@given(nodes=WORLD, path=st.sampled_from(["a", "b", "z"]))
def test_a_clause_means_the_same_as_the_engine_runs_it(nodes: dict[str, tuple[str, Any]], path: str) -> None:
    """The rewritten source (fields as indexes) gives what the clause as written gives: the same bool or error."""
    variables = {"state": state_view("v", nodes), "params": {"path": path}}
    for expr in PLAIN_CLAUSES:
        (compiled,), _ = compile_clauses(Contract(tool="t", params=[expr]))
        assert compiled.program.source != expr
        written = outcome_of(lambda e=expr: cel.compile(e).execute(variables))
        run = compiled.evaluate(
            bind([compiled], {**world_views("state", "v", nodes), "params": lambda: {"path": path}})
        )
        assert (run if isinstance(run, bool) else run.split(":")[0]) == written, expr


RESULT_CLAUSES = [
    "result.status == 'OK' || result.latency_ms > 2.0",
    "has(result.json.n) && result.json.n > 1 && result.error == null",
    "result.json.n + result['json']['n'] > 3 && result != null",
    "result.output.startsWith('{') || result.other == 1",
]


@settings(max_examples=80, deadline=None)
@given(
    status=st.sampled_from(["OK", "ERROR"]),
    output=st.sampled_from(["", "done", '{"n": 2}', '{"n": 1.5}', "[1]", " 7", "nul"]),
    latency=st.floats(0, 5),
)
def test_a_postcondition_reading_result_fields_means_the_same_as_written(
    status: str, output: str, latency: float
) -> None:
    """`result.status` runs as the variable `treadle_result_status` (each field bound alone): the same bool or
    error as the clause as written over the whole `result` map."""
    view = result_view({"status": status, "output": output, "latency_ms": latency})
    for expr in RESULT_CLAUSES:
        (compiled,), _ = compile_clauses(Contract(tool="t", postconditions=[expr]))
        assert "treadle_result_" in compiled.program.source
        written = outcome_of(lambda e=expr: cel.compile(e).execute({"result": view}))
        (check,) = check_post([CompiledContract(Contract(tool="t", postconditions=[expr]))], None, ("v", {}), {},
                              {"status": status, "output": output, "latency_ms": latency})  # fmt: skip
        run = compiled.evaluate(bind([compiled], {"result": lambda: view} | {
            f"treadle_result_{k}": lambda k=k: view[k] for k in view}))  # fmt: skip
        assert (run if isinstance(run, bool) else run.split(":")[0]) == written, expr
        assert check.outcome is {True: Outcome.PASSED, False: Outcome.VIOLATED}.get(written, Outcome.NOT_EVALUABLE)


def outcome_of(run: Any) -> bool | str:
    """A clause's value, or the kind of error, as CompiledClause.evaluate names them."""
    try:
        value = run()
    except KeyError:
        return "no such key"
    except Exception as exc:
        return type(exc).__name__
    return value if isinstance(value, bool) else "evaluated to"


@settings(max_examples=80, deadline=None)
@given(nodes=WORLD)
def test_a_macro_iterates_a_maps_keys_in_order_so_every_process_agrees(nodes: dict[str, tuple[str, Any]]) -> None:
    """`exists` stops at the first node, in key order, that decides or fails (a node without `h` fails); the
    engine's own map order changes from process to process, so without the order a replay could disagree."""
    contract = CompiledContract(Contract(tool="t", preconditions=[
        {"big": "state.nodes.exists(n, state.nodes[n].data.h > 6)"},
        {"first": "size(state.nodes) == 0 || state.nodes.map(n, n)[0] == state.nodes.filter(n, true)[0]"},
    ]))  # fmt: skip
    expected: bool | str = False
    for key in sorted(nodes):
        if "h" not in nodes[key][1]:
            expected = "no such key: h"
            break
        if nodes[key][1]["h"] > 6:
            expected = True
            break
    (check,) = check_pre([contract], "v", nodes, {})
    results = dict(zip(["big", "first"], [c.evaluate(bind([c], world_views("state", "v", nodes)))
                                          for c in contract.pre], strict=True))  # fmt: skip
    assert results == {"big": expected, "first": True}
    assert check.outcome is {True: Outcome.PASSED, False: Outcome.VIOLATED}.get(expected, Outcome.NOT_EVALUABLE)


def test_a_value_the_engine_cannot_hold_makes_its_clauses_not_evaluable_even_in_a_cached_world() -> None:
    contract = CompiledContract(Contract(tool="t", params=["params.x == 1", "size(state.nodes) == 0"]))
    worlds = WorldCache()
    (ok,) = check_pre([contract], "v", {}, {"x": 1}, worlds, ("s", 1))
    (odd,) = check_pre([contract], "v", {}, {"x": {1.5: 2}}, worlds, ("s", 1))  # not JSON: a float key
    assert ok.outcome is Outcome.PASSED
    assert (odd.outcome, odd.failed) == (Outcome.NOT_EVALUABLE, ("params.x == 1",))  # not the stale params


@settings(max_examples=60, deadline=None)
@given(worlds=st.lists(st.tuples(WORLD, st.sampled_from(["a", "b", "z"])), min_size=1, max_size=6))
def test_a_cached_world_converted_node_by_node_gives_what_a_fresh_one_gives(
    worlds: list[tuple[dict[str, tuple[str, Any]], str]],
) -> None:
    """A session's worlds in turn through one WorldCache (each node's mark: the first turn it had its content)
    check the same as each world bound afresh, plain map or node handles."""
    contract = CompiledContract(Contract(tool="t", params=PLAIN_CLAUSES))
    cache, marks, last = WorldCache(), {}, {}
    for turn, (nodes, path) in enumerate(worlds, start=1):
        for nid, node in nodes.items():
            if last.get(nid) != node:
                marks[nid] = turn
        last = dict(nodes)
        fresh = check_pre([contract], "v", nodes, {"path": path})
        cached = check_pre([contract], "v", nodes, {"path": path}, cache, ("s", turn), marks)
        assert cached == fresh


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.text(max_size=12), min_size=4, max_size=4))
def test_check_and_signal_ids_are_the_uuid5s_they_stand_for(parts: list[str]) -> None:
    """Made from the SHA-1 directly (they are made per check): the same ids as the uuid module's."""
    session, step, contract, phase = parts
    assert check_id(session, step, contract, phase) == str(
        uuid.uuid5(_NAMESPACE, f"{session}\0{step}\0{contract}\0{phase}")
    )
    name = f"treadle-reward/{session}/{step}/{contract}"
    assert signal_id(session, step, contract) == str(uuid.uuid5(uuid.NAMESPACE_URL, name))


# -- registration refusals -------------------------------------------------------------------------------------------


def test_registration_refuses_a_clause_that_does_not_compile_or_reads_what_its_phase_lacks() -> None:
    contract = Contract(tool="t", preconditions=["state.nodes[", "params.path == 'a'"], postconditions=["x > 1"])
    reasons = registration_problems(contract, [], None)
    assert any("'state.nodes[' does not compile" in r for r in reasons)
    assert any("reads params; preconditions see only state" in r for r in reasons)
    assert any("reads x; postconditions see only before, params, result, state" in r for r in reasons)
    with pytest.raises(ContractError, match="does not compile"):
        CompiledContract(contract)


def test_registration_refuses_unknown_node_types_named_in_clauses_or_declared() -> None:
    contract = write_file(node_types=())
    assert registration_problems(contract, ["file"], None) == []
    (reason,) = registration_problems(contract, ["dir"], None)
    assert reason.startswith("unknown node type(s) file")
    declared = Contract(tool="t", node_types=["memo"], preconditions=["size(state.nodes) >= 0"])
    assert "unknown node type(s) memo" in registration_problems(declared, ["file"], None)[0]


def test_a_macro_variable_is_not_a_free_variable() -> None:
    contract = Contract(tool="t", preconditions=["state.nodes.all(k, state.nodes[k].type != 'lock')"])
    assert registration_problems(contract, ["lock"], None) == []


clause_text = st.sampled_from(
    ["size(state.nodes) < 5", "'a' in state.nodes", "state.version != ''", "!('lock' in state.nodes)"]
)


@settings(max_examples=60, deadline=None)
@given(old=st.lists(clause_text, unique=True, max_size=4), new=st.lists(clause_text, unique=True, max_size=4))
def test_a_new_version_may_drop_preconditions_but_not_add_them(old: list[str], new: list[str]) -> None:
    previous = Contract(tool="t", version=1, preconditions=old, postconditions=["true"])
    proposed = Contract(tool="t", preconditions=new, postconditions=["result.status == 'OK'"])
    reasons = registration_problems(proposed, [], previous)
    added = [c for c in new if c not in old]
    assert len(reasons) == len(added)
    assert all("narrows version 1" in r for r in reasons)


def test_changing_the_tool_is_refused_and_postconditions_may_change() -> None:
    previous = write_file()
    assert registration_problems(write_file(postconditions=()), ["file"], previous) == []
    assert "tool changed" in registration_problems(write_file(tool="edit"), ["file"], previous)[0]


def test_a_contract_file_that_is_not_a_contract_says_why() -> None:
    with pytest.raises(ContractError, match="tool: Field required"):
        load_contract("preconditions: ['true']")
    with pytest.raises(ContractError, match="not a mapping"):
        load_contract("[1, 2]")


# -- the action mask -------------------------------------------------------------------------------------------------

PRECONDITIONS = {
    "has_a": "'a' in state.nodes",
    "no_lock": "!state.nodes.exists(n, state.nodes[n].type == 'lock')",
    "small": "size(state.nodes) <= 3",
    "a_is_file": "'a' in state.nodes && state.nodes['a'].type == 'file'",
    "a_hash_even": "state.nodes['a'].data.h % 2 == 0",  # not evaluable without node a: masks the tool
}


def direct(name: str, nodes: dict[str, tuple[str, Any]]) -> bool:
    world = {k: v for k, v in nodes.items() if v[0] not in ("action", "tool_result")}
    return {
        "has_a": "a" in world,
        "no_lock": all(t != "lock" for t, _ in world.values()),
        "small": len(world) <= 3,
        "a_is_file": "a" in world and world["a"][0] == "file",
        "a_hash_even": "a" in world and world["a"][1]["h"] % 2 == 0,
    }[name]


node_strategy = st.dictionaries(
    st.sampled_from(["a", "b", "c", "d", "action:1"]),
    st.tuples(st.sampled_from(["file", "lock", "action"]), st.fixed_dictionaries({"h": st.integers(0, 9)})),
    max_size=5,
)
tools_strategy = st.dictionaries(
    st.sampled_from(["read", "write", "delete"]),
    st.lists(st.sampled_from(sorted(PRECONDITIONS)), min_size=1, max_size=3, unique=True),
    min_size=1,
)


@settings(max_examples=150, deadline=None)
@given(nodes=node_strategy, tools=tools_strategy)
def test_available_actions_matches_a_direct_evaluation_of_the_preconditions(
    nodes: dict[str, tuple[str, Any]], tools: dict[str, list[str]]
) -> None:
    contracts = [
        CompiledContract(Contract(tool=tool, preconditions=[{n: PRECONDITIONS[n]} for n in names]))
        for tool, names in tools.items()
    ]
    expected = sorted(t for t, names in tools.items() if all(direct(n, nodes) for n in names))
    assert available_actions(contracts, "v", nodes) == expected


def test_effective_picks_the_newest_version_effective_at_the_event_time() -> None:
    v1 = write_file(version=1, effective_from_us=0)
    v2 = write_file(version=2, effective_from_us=100)
    assert effective([v2, v1], 99) == [v1]
    assert effective([v1, v2], 100) == [v2]


# -- the fold over real state versions -------------------------------------------------------------------------------

T0 = 1_760_000_000_000_000


def envelope(seq: int, lid: str | None = None, session: str = "s") -> dict[str, Any]:
    eid = f"{session}-e{seq:04d}"
    return {"event_id": eid, "session_id": session, "agent_id": "a", "episode_id": "ep", "logical_event_id": lid or eid,
            "seq": seq, "event_time": T0 + seq, "policy_version": "", "trace_id": "", "attributes": {}}  # fmt: skip


def delta_record(
    seq: int, upserts: dict[str, str], deletes: tuple[str, ...] = (), lid: str | None = None, session: str = "s"
) -> dict:
    ups = [{"id": k, "type": "file", "data_json": orjson.dumps({"hash": h}).decode(), "ttl_seconds": None}
           for k, h in upserts.items()]  # fmt: skip
    return {"envelope": envelope(seq, lid, session), "node_upserts": ups, "node_deletes": list(deletes),
            "edge_upserts": [], "edge_deletes": [], "rollback_to": None}  # fmt: skip


def dispatch_record(seq: int, lid: str, path: str, session: str = "s") -> dict:
    params = orjson.dumps({"path": path}).decode()
    return {
        "envelope": envelope(seq, lid, session),
        "step": seq,
        "tool": "write_file",
        "params_json": params,
        "deadline": None,
    }


def result_record(seq: int, lid: str, status: str = "OK", session: str = "s") -> dict:
    costs = {"latency_ms": 1.0, "cost_usd": 0.0, "tokens_in": 0, "tokens_out": 0, "retries": 0}
    return {"envelope": envelope(seq, lid, session), "tool": "write_file", "status": status, "output": "",
            "error": None, **costs}  # fmt: skip


def versions_of(events: list[tuple[str, dict]]) -> list[dict]:
    fold_, state, store = StateFold(), SessionState(events[0][1]["envelope"]["session_id"]), MemoryStore()
    return [fold_.apply(state, store, schema, record) for schema, record in events]


STEP_KINDS = st.lists(st.sampled_from(["write_existing", "write_missing", "write_unchanged", "touch", "drop"]),
                      min_size=1, max_size=8)  # fmt: skip


def workload(kinds: list[str], session: str = "s") -> list[tuple[str, dict]]:
    """A file-editing session: a.txt exists, then per kind a write to it (its hash changes, or not), a write to a
    missing file, another file touched, or a.txt deleted. Steps are `<session>-step<i>`."""
    events, seq = [(STATE_DELTA, delta_record(0, {"a.txt": "h0"}, session=session))], 1
    for i, kind in enumerate(kinds):
        lid = f"{session}-step{i}"
        if kind == "touch":
            events.append((STATE_DELTA, delta_record(seq, {f"f{i}": "x"}, session=session)))
        elif kind == "drop":
            events.append((STATE_DELTA, delta_record(seq, {}, ("a.txt",), session=session)))
        else:
            path = "missing.txt" if kind == "write_missing" else "a.txt"
            events.append((DISPATCH, dispatch_record(seq, lid, path, session)))
            if kind == "write_existing":
                events.append((STATE_DELTA, delta_record(seq + 1, {"a.txt": f"h{seq}"}, lid=lid, session=session)))
            events.append((TOOL_RESULT, result_record(seq + 2, lid, session=session)))
        seq += 3
    return events


def run_fold(
    versions: list[dict], book: ContractBook, restart_every: int | None = None, worlds: WorldCache | None = None
) -> list[dict]:
    session, out = SessionContracts(), []
    for i, version in enumerate(versions):
        checked = fold(session, version, book, worlds)
        if checked is not None:
            out += check_records(checked)
            signal = contract_signal(checked)
            out += [signal] if signal else []
        if restart_every and i % restart_every == 0:
            session = SessionContracts.from_bytes(session.to_bytes())
    return out


def test_the_fold_checks_pre_at_the_dispatch_and_post_at_the_result_with_the_steps_deltas() -> None:
    book = ContractBook([write_file()])
    versions = versions_of(workload(["write_existing", "write_missing", "write_unchanged"]))
    records = [r for r in run_fold(versions, book) if "check_id" in r]
    outcomes = [(r["logical_event_id"], r["phase"], r["outcome"], r["clause"]) for r in records]
    assert outcomes == [
        ("s-step0", "pre", "passed", None),
        ("s-step0", "post", "passed", None),
        ("s-step1", "pre", "violated", "file_exists"),
        ("s-step1", "post", "not_evaluable", "hash_changed"),
        ("s-step2", "pre", "passed", None),
        ("s-step2", "post", "violated", "hash_changed"),
    ]
    pre = records[0]
    assert pre["state_version_id"] == versions[1]["parent_id"] and pre["contract_version"] == 1
    assert orjson.loads(records[2]["values_json"])["params"] == {"path": "missing.txt"}


def test_a_duplicate_version_is_skipped_and_a_tool_without_contract_is_not_checked() -> None:
    versions = versions_of(workload(["write_missing"]))
    book = ContractBook([write_file()])
    once = run_fold(versions, book)
    assert run_fold([*versions, *versions], book) == once
    assert run_fold(versions, ContractBook([write_file(tool="other", name="other")])) == []


@settings(max_examples=40, deadline=None)
@given(kinds=STEP_KINDS, restart_every=st.integers(1, 4))
def test_the_fold_is_deterministic_across_restarts_and_replays(kinds: list[str], restart_every: int) -> None:
    """The same records with or without a WorldCache (kept across restarts and replays, as the processor keeps it)."""
    versions = versions_of(workload(kinds))
    book = ContractBook([write_file()])
    first, worlds = run_fold(versions, book), WorldCache()
    assert run_fold(versions, book, restart_every, worlds) == first
    replayed = run_fold(versions[: len(versions) // 2] + versions, book, worlds=worlds)  # a crash: half published twice
    assert replayed == first


def test_a_fold_record_without_change_marks_still_folds_the_same() -> None:
    """A record written before the marks were kept: its nodes are marked with its ordinal (their content then)."""
    versions = versions_of(workload(["write_existing", "write_unchanged", "write_missing", "write_existing"]))
    book, worlds = ContractBook([write_file()]), WorldCache()
    first, session, out = run_fold(versions, book), SessionContracts(), []
    for version in versions:
        checked = fold(session, version, book, worlds)
        out += check_records(checked) + ([s] if (s := contract_signal(checked)) else []) if checked else []
        doc = orjson.loads(session.to_bytes())
        del doc["changed"]
        session = SessionContracts.from_bytes(orjson.dumps(doc))
    assert out == first


def test_the_contract_signal_is_minus_one_on_a_violation_and_plus_one_when_all_passed() -> None:
    book = ContractBook([write_file()])
    versions = versions_of(workload(["write_missing", "write_existing"]))
    signals = [r for r in run_fold(versions, book) if "source" in r]
    assert [(s["source"], s["name"], s["value"]) for s in signals] == [
        (SOURCE, "pre", -1.0),  # step0's post is not evaluable (no file): no signal
        (SOURCE, "pre", 1.0),
        (SOURCE, "post", 1.0),
    ]
    assert "violated: file_exists" in signals[0]["evidence"]
    assert signals[0]["envelope"]["logical_event_id"] == "s-step0"


def test_every_record_is_one_the_worker_accepts_and_the_sink_maps() -> None:
    book = ContractBook([write_file()])
    for record in run_fold(versions_of(workload(["write_missing", "write_existing"])), book):
        schema = CONTRACT_CHECK if "check_id" in record else REWARD
        check_publish(schema, record, b"s", "contracts")
        if schema == CONTRACT_CHECK:
            [(table, row)] = rows_for("contract_checks", record)
            assert table == "contract_checks" and tuple(row) == TABLE_COLUMNS["contract_checks"]


def test_the_processor_hashes_each_dispatch_and_result_as_received() -> None:
    import hashlib

    events = [dispatch("write_file", '{"path": "a"}', attributes={"host": "h1"}), tool_result(tool="write_file")]
    ctx = run_sync(ContractsProcessor(ContractBook()), *events)
    assert [p.schema_name for p in ctx.published] == [STEP_EVIDENCE, STEP_EVIDENCE]
    first = ctx.published[0].record
    assert first["sha256"] == hashlib.sha256(events[0].source.value).hexdigest()
    assert first["attributes"] == {"host": "h1"} and first["tool"] == "write_file"
    [(table, row)] = rows_for("step_evidence", first)
    assert table == "step_evidence" and tuple(row) == TABLE_COLUMNS["step_evidence"]


def test_the_world_at_a_dispatch_is_kept_only_for_postconditions_that_read_before() -> None:
    versions = versions_of(workload(["write_existing"]))
    only_result = write_file(postconditions=(Clause(name="succeeded", expr="result.status == 'OK'"),))
    for contract, kept in ((write_file(), True), (only_result, False)):
        session, book = SessionContracts(), ContractBook([contract])
        for version in versions[:2]:  # the first delta and the dispatch
            fold(session, version, book)
        assert (session.pending["s-step0"]["nodes"] is not None) is kept
        checked = [fold(session, v, book) for v in versions[2:]]
        assert [c.checks[0].outcome for c in checked if c is not None] == [Outcome.PASSED]
