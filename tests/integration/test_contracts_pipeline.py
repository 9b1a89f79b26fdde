"""Action contracts end to end: real Kafka, a worker subprocess (steps, state, contracts), chDB and Valkey.

A file-editing session (tests/unit/test_contracts.py's workload) against the contract "write only to files that
exist; after a write the file node's hash changes": violated pre- and postconditions land in contract_checks with
their clause and values; a veto rule on the `contract` source changes the woven reward and `treadle explain` says
why; `treadle provenance --verify` detects a tampered raw event; the action mask follows the state; and a kill -9
mid-stream leaves exactly the check rows an in-process fold of the same versions gives.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from processors.contracts.fold import ContractBook
from sinks.clickhouse import ClickHouseStore
from sinks.sql_client import run_sql
from tests.factories import send_records, wait_for
from tests.paths import REPO_ROOT
from tests.unit.test_contracts import WRITE_FILE, envelope, run_fold, versions_of, workload
from topics.catalog import TopicCatalog
from topics.contract_registry import ContractRegistry
from topics.contracts import load_contract
from topics.names import REWARD
from topics.node_types import NodeTypeRegistry
from topics.settings import Settings
from treadle.cli import app
from treadle.contracts_command import mask
from treadle.devstack.worker_process import WorkerProcess
from treadle.state.history import state_at

pytestmark = pytest.mark.integration

POLICY = {
    "version": "contracts-veto-1",
    "fusion": {
        "rules": [
            {"name": "contract-veto", "kind": "veto", "match": {"source": "contract", "value_below": 0}, "value": -1.0}
        ]
    },
}
FILE_SCHEMA = {"type": "object", "required": ["hash"], "properties": {"hash": {"type": "string"}}}
CHECK_COLUMNS = "check_id, contract_version, phase, outcome, clause, values_json, state_version_id"


def plugin_site(root: Path) -> str:
    """PYTHONPATH for the worker: a dist-info that declares the contracts entry point (this checkout may not be
    installed), then this checkout."""
    info = root / "site" / "treadle_contracts-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: treadle-contracts\nVersion: 0.1\n")
    entry = "contracts = processors.contracts.processor:ContractsProcessor"
    (info / "entry_points.txt").write_text(f"[treadle.processors]\n{entry}\n")
    return f"{root / 'site'}:{REPO_ROOT}"


async def register(settings: Settings) -> None:
    catalog = TopicCatalog(settings)
    await NodeTypeRegistry(settings.kafka_bootstrap_servers, catalog["node_types"].name).register("file", FILE_SCHEMA)
    registry = ContractRegistry(settings.kafka_bootstrap_servers, catalog["contracts"].name, catalog["node_types"].name)
    await registry.register(load_contract(WRITE_FILE))  # effective from event time 0: every step uses it


def judge(session: str, lid: str, seq: int) -> tuple[str, dict]:
    record = {"envelope": envelope(seq, lid, session), "source": "judge", "name": "reward", "value": 1.0,
              "confidence": 1.0, "annotator": "CODE", "evidence": None}  # fmt: skip
    return REWARD, record


@pytest.fixture
def deployment(deployment: Settings, tmp_path: Path) -> Settings:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps(POLICY))
    settings = deployment.model_copy(
        update={"processors": ("steps", "state", "contracts"), "reward_policy": policy, "state_idle_flush_s": 0.5}
    )
    asyncio.run(register(settings))
    return settings


def new_worker(settings: Settings) -> WorkerProcess:
    return WorkerProcess(settings, settings.home / "worker.log", env={"PYTHONPATH": plugin_site(settings.home.parent)})


def checks(settings: Settings, where: str) -> list[dict]:
    columns, rows = run_sql(settings, f"SELECT * FROM contract_checks_latest WHERE {where} ORDER BY check_id")
    return [dict(zip(columns, row, strict=True)) for row in rows]


def test_violations_land_with_clause_and_values_a_veto_and_provenance(deployment: Settings) -> None:
    session = f"{deployment.topic_prefix}-files"
    events = workload(["write_existing", "write_missing", "write_unchanged"], session)
    events += [judge(session, f"{session}-step{i}", 100 + i) for i in range(3)]
    worker = new_worker(deployment).start()
    try:
        worker.wait_ready()
        asyncio.run(send_records(deployment, events))
        where = f"session_id = '{session}'"
        wait_for(lambda: len(checks(deployment, where)) == 6, 120, "six contract checks",
                 explain=lambda: f"{checks(deployment, where)}\n{worker.log_tail(30)}")  # fmt: skip
        by = {(r["logical_event_id"].rsplit("-", 1)[1], r["phase"]): r for r in checks(deployment, where)}
        pre = by[("step1", "pre")]
        assert (pre["outcome"], pre["clause"], pre["contract"], pre["contract_version"]) == (
            "violated", "file_exists", "write_file", 1)  # fmt: skip
        assert json.loads(pre["values_json"])["params"] == {"path": "missing.txt"}
        post = by[("step2", "post")]
        assert (post["outcome"], post["clause"]) == ("violated", "hash_changed")
        seen = json.loads(post["values_json"])
        assert seen["nodes"]["a.txt"]["data"] == seen["before_nodes"]["a.txt"]["data"] == {"hash": "h1"}
        assert by[("step0", "post")]["outcome"] == "passed"
        assert by[("step1", "post")]["outcome"] == "not_evaluable"

        # The veto: judge +1 and contract pre -1 would fuse to 0; the rule makes it -1, and explain says so.
        step1 = f"{session}-step1"
        runner, env = CliRunner(), {**deployment.to_env(), "COLUMNS": "220"}

        def explained() -> dict:
            shown = runner.invoke(app, ["explain", step1, "--json"], env=env)
            return json.loads(shown.stdout) if shown.exit_code == 0 else {}

        wait_for(lambda: len(explained().get("components", [])) == 2, 60, "step1 woven with judge and contract")
        doc = explained()
        assert doc["value"] == -1.0 and doc["rules_fired"] == ["contract-veto"] and doc["rule_adjustment"] == -1.0
        contract = next(c for c in doc["components"] if c["source"] == "contract" and c["name"] == "pre")
        assert contract["value"] == -1.0 and "violated: file_exists" in contract["evidence"]

        # Provenance of step0, then its dispatch tampered with in raw_events.
        step0 = f"{session}-step0"
        # Waits for --verify, not only the evidence: one sink flush may insert the evidence before the raw events.
        wait_for(lambda: runner.invoke(app, ["provenance", step0, "--verify"], env=env).exit_code == 0, 60,
                 "evidence and its raw events")  # fmt: skip
        shown = runner.invoke(app, ["provenance", step0, "--verify", "--json"], env=env)
        assert shown.exit_code == 0, shown.output
        evidence = json.loads(shown.stdout)
        assert [e["schema_name"].rsplit(".", 1)[1] for e in evidence["events"]] == ["ActionDispatched", "ToolResult"]
        assert (
            evidence["state_before"] and evidence["state_after"] and evidence["state_before"] != evidence["state_after"]
        )
        assert {(c["phase"], c["outcome"]) for c in evidence["contracts"]} == {("pre", "passed"), ("post", "passed")}
        assert evidence["reward_policy_version"] == "contracts-veto-1"
        assert all(v["ok"] for v in evidence["verify"])

        # The action mask: nothing at genesis, write_file once a.txt exists.
        assert mask(asyncio.run(_contracts(deployment)), state_at(deployment, session, 0)) == []
        assert mask(asyncio.run(_contracts(deployment)), state_at(deployment, session, 1)) == ["write_file"]
        shown = runner.invoke(app, ["contracts", "available", session, "--at", "1"], env=env)
        assert shown.exit_code == 0, shown.output
        assert json.loads(shown.stdout)["available"] == ["write_file"]
    finally:
        worker.stop()

    dispatch_id = evidence["events"][0]["event_id"]
    with ClickHouseStore.open(deployment) as store:  # the worker is gone: its embedded chDB is free
        store.command_sync(
            "INSERT INTO raw_events SELECT kind, schema_name, event_id, session_id, agent_id, episode_id, "
            "logical_event_id, seq, event_time, policy_version, trace_id, attributes, "
            "replaceOne(payload_json, 'a.txt', 'b.txt'), ingested_revision + 1 FROM raw_events FINAL "
            f"WHERE event_id = '{dispatch_id}'"
        )
    tampered = runner.invoke(app, ["provenance", step0, "--verify"], env=env)
    assert tampered.exit_code == 1, tampered.output
    assert f"verify {dispatch_id}: TAMPERED" in tampered.stdout
    assert "verify" in tampered.stdout and tampered.stdout.count(": ok (matches)") == 1


async def _contracts(settings: Settings):
    catalog = TopicCatalog(settings)
    return await ContractRegistry(
        settings.kafka_bootstrap_servers, catalog["contracts"].name, catalog["node_types"].name
    ).load()


def test_kill_9_mid_stream_gives_the_same_check_rows(deployment: Settings) -> None:
    rng = random.Random(24)
    kinds = ["write_existing", "write_missing", "write_unchanged", "touch", "drop"]
    sessions = {f"{deployment.topic_prefix}-k{s}": workload(rng.choices(kinds, k=30), f"{deployment.topic_prefix}-k{s}")
                for s in range(3)}  # fmt: skip
    book = ContractBook(asyncio.run(_contracts(deployment)))
    expected = set()
    for events in sessions.values():
        for r in run_fold(versions_of(events), book):
            if "check_id" in r:
                expected.add((r["check_id"], r["contract_version"], r["phase"], r["outcome"], r["clause"],
                              r["values_json"], r["state_version_id"]))  # fmt: skip
    halves = [(events[: len(events) // 2], events[len(events) // 2 :]) for events in sessions.values()]
    worker = new_worker(deployment).start()
    worker.wait_ready()
    asyncio.run(send_records(deployment, [e for first, _ in halves for e in first]))
    wait_for(lambda: len(checks(deployment, "1")) > 10, 120, "some checks before the kill")
    worker.kill()
    asyncio.run(send_records(deployment, [e for _, second in halves for e in second]))
    worker = new_worker(deployment).start()
    try:
        worker.wait_ready()

        def rows(table: str) -> set[tuple]:
            _, found = run_sql(deployment, f"SELECT {CHECK_COLUMNS} FROM {table}")
            return {tuple(r) for r in found}

        wait_for(lambda: rows("contract_checks_latest") == expected, 180, f"{len(expected)} check rows",
                 explain=lambda: f"have {len(rows('contract_checks_latest'))}\n{worker.log_tail(30)}")  # fmt: skip
        assert rows("contract_checks") == expected  # no stray row from a replay that decided differently
    finally:
        worker.stop()


def test_the_cli_registers_lists_shows_and_refuses_with_every_reason(deployment: Settings, tmp_path: Path) -> None:
    runner, env = CliRunner(), {**deployment.to_env(), "COLUMNS": "200"}
    bad = tmp_path / "bad.yaml"
    bad.write_text("tool: edit\nnode_types: [folder]\npreconditions: ['state.nodes[', 'params.path == \"a\"']\n")
    refused = runner.invoke(app, ["contracts", "register", str(bad)], env=env)
    assert refused.exit_code == 1
    assert "error: contract 'edit' refused:" in refused.stderr
    assert "does not compile" in refused.stderr and "reads params" in refused.stderr
    assert "unknown node type(s) folder" in refused.stderr

    unchanged = runner.invoke(app, ["contracts", "register", str(tmp_path / "none.yaml")], env=env)
    assert unchanged.exit_code == 1 and unchanged.stderr.startswith("error:")  # a missing file: one line

    same = tmp_path / "write_file.yaml"
    same.write_text(WRITE_FILE)
    again = runner.invoke(app, ["contracts", "register", str(same)], env=env)
    assert again.exit_code == 0 and "unchanged" in again.stdout  # the fixture registered it as version 1

    wider = tmp_path / "wider.yaml"
    kept = [line for line in WRITE_FILE.splitlines(keepends=True) if not line.startswith("params:")]
    wider.write_text("".join(line for line in kept if "file_exists" not in line))  # a constraint dropped: wider
    widened = runner.invoke(app, ["contracts", "register", str(wider)], env=env)
    assert widened.exit_code == 0 and "version 2" in widened.stdout, widened.output

    narrower = tmp_path / "narrower.yaml"
    narrower.write_text(WRITE_FILE.replace("preconditions:\n", "preconditions:\n  - few: 'size(state.nodes) < 9'\n"))
    narrowed = runner.invoke(app, ["contracts", "register", str(narrower)], env=env)
    assert narrowed.exit_code == 1 and "narrows version 2" in narrowed.stderr

    listed = runner.invoke(app, ["contracts", "list", "--json"], env=env)
    assert [json.loads(line)["version"] for line in listed.stdout.splitlines()] == [1, 2]
    shown = runner.invoke(app, ["contracts", "show", "write_file", "--version", "1"], env=env)
    assert json.loads(shown.stdout)["params"][0]["name"] == "file_exists"
