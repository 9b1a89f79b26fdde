"""The CLI as a user runs it: one readable line for a mistake, never a traceback."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from tests.factories import RawProducer, dispatch, treadle, wait_for
from tests.paths import REPO_ROOT
from topics.ids import uuid7
from topics.settings import Settings

REFUSED = [
    ("DROP TABLE transitions", "DROP"),
    ("INSERT INTO transitions SELECT * FROM transitions", "INSERT"),
    ("SELECT 1; SELECT 2", "one statement"),
    ("SELECT * FROM file('/etc/passwd', 'LineAsString')", "file"),
    ("SELECT * FROM url('http://127.0.0.1:1/x', 'CSV')", "url"),
    ("ALTER TABLE transitions DELETE WHERE 1", "ALTER"),
]


@pytest.mark.parametrize(("query", "mentions"), REFUSED)
def test_sql_refuses_anything_but_one_read(tmp_path, query: str, mentions: str) -> None:
    settings = Settings(home=tmp_path)
    done = treadle(settings, "sql", query)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error:")
    assert mentions.lower() in lines[0].lower()
    assert "Traceback" not in done.stderr + done.stdout


def test_sql_takes_a_query_that_starts_with_a_comment(tmp_path) -> None:
    """`-- note` first is a query, not an unknown option; `--` and `-` (stdin) work as well."""
    settings = Settings(home=tmp_path)
    query = "-- note\nSELECT table FROM system.tables WHERE table IN ('one')"
    for args in (("sql", query, "--json"), ("sql", "--json", "--", query)):
        done = treadle(settings, *args)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"table": "one"}
    piped = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "sql", "-", "--json"],
        input="-- from stdin\nSELECT 2 AS two",
        cwd=REPO_ROOT,
        env={**os.environ, **settings.to_env()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout) == {"two": 2}


def test_sql_routes_through_the_worker_that_owns_chdb(deployment: Settings, worker_factory) -> None:
    worker = worker_factory().start()
    worker.wait_ready()
    session = f"s-cli-{uuid7()[:8]}"

    async def send() -> None:
        async with RawProducer(deployment) as producer:
            await producer.send("treadle.events.ActionDispatched", dispatch(session, uuid7(), 0, 1))
            await producer.flush()

    asyncio.run(send())
    query = f"SELECT session_id, step, tool FROM transitions_latest WHERE session_id = '{session}'"
    done = wait_for(
        lambda: (d := treadle(deployment, "sql", query, "--json")).stdout.strip() and d, 60, "the row via the CLI"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"session_id": session, "step": 0, "tool": "search"}

    unknown = treadle(deployment, "sql", "SELECT * FROM no_such_table")
    assert unknown.returncode == 1
    assert unknown.stderr.startswith("error:") and "no_such_table" in unknown.stderr
    assert "Traceback" not in unknown.stderr


def test_topics_lists_the_catalog_with_broker_state(deployment: Settings) -> None:
    done = treadle(deployment, "topics")
    assert done.returncode == 0, done.stderr
    for kind in ("actions", "tool_results", "rewards", "transitions", "dead_letters"):
        assert f"{deployment.topic_prefix}.{kind}" in done.stdout
    assert "missing" not in done.stdout


def _tool_result_with(tmp_path, field: dict):
    """A copy of the contract with one field added to ToolResult."""
    avro = REPO_ROOT / "avro"
    (tmp_path / "treadle.events.Envelope.avsc").write_text((avro / "treadle.events.Envelope.avsc").read_text())
    doc = json.loads((avro / "treadle.events.ToolResult.avsc").read_text())
    doc["fields"].append(field)
    path = tmp_path / "treadle.events.ToolResult.avsc"
    path.write_text(json.dumps(doc))
    return path


def test_schemas_register_refuses_a_breaking_change_and_accepts_a_compatible_one(deployment, tmp_path) -> None:
    breaking = _tool_result_with(tmp_path, {"name": "region", "type": "string"})
    refused = treadle(deployment, "schemas", "register", str(breaking))
    assert refused.returncode == 1
    assert refused.stderr.startswith("error:") and "region: field added without a default" in refused.stderr

    compatible = _tool_result_with(tmp_path, {"name": "region", "type": "string", "default": "eu"})
    done = treadle(deployment, "schemas", "register", str(compatible))
    assert done.returncode == 0, done.stderr
    assert "treadle.events.ToolResult version 2" in done.stdout
    listed = treadle(deployment, "schemas", "list")
    rows = [line for line in listed.stdout.splitlines() if "treadle.events.ToolResult" in line]
    assert len(rows) == 2


def test_node_types_register_refuses_a_breaking_change_with_a_readable_diff(deployment, tmp_path) -> None:
    def schema_file(name: str, schema: dict) -> str:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(schema))
        return str(path)

    v1 = {"type": "object", "properties": {"text": {"type": "string"}}, "additionalProperties": False}
    first = treadle(deployment, "node-types", "register", "memory", schema_file("v1", v1))
    assert first.returncode == 0, first.stderr
    assert "registered node type memory version 1" in first.stdout
    again = treadle(deployment, "node-types", "register", "memory", schema_file("v1", v1))
    assert again.returncode == 0 and "unchanged" in again.stdout

    breaking = {**v1, "required": ["text"]}
    refused = treadle(deployment, "node-types", "register", "memory", schema_file("v2", breaking))
    assert refused.returncode == 1
    assert refused.stderr.startswith("error:") and "property 'text' became required" in refused.stderr
    assert '+  "required": [' in refused.stderr and "Traceback" not in refused.stderr  # the unified diff

    compatible = {**v1, "properties": {"text": {"type": "string"}, "score": {"type": "number"}}}  # a new field
    done = treadle(deployment, "node-types", "register", "memory", schema_file("v3", compatible))
    assert done.returncode == 0 and "version 2" in done.stdout, done.stderr
    listed = treadle(deployment, "node-types", "list", "--json")
    assert [json.loads(line)["version"] for line in listed.stdout.splitlines()] == [2]

    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    unreadable = treadle(deployment, "node-types", "register", "memory", str(broken))
    assert unreadable.returncode == 1 and unreadable.stderr.startswith("error: cannot read a JSON Schema")
    assert len(unreadable.stderr.strip().splitlines()) == 1
