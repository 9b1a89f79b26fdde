"""The SQL endpoint's read path: no open SQL beyond loopback, and with TREADLE_SQL_TOKEN every query carries it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from pydantic import SecretStr

from sinks.sql_auth import is_loopback
from streams.runtime.run_info import SqlEndpoint
from tests.factories import treadle
from topics.settings import Settings

TOKEN = "s3cret-token-for-the-test-7f2c"


@pytest.mark.parametrize("command", ["sink", "worker"])
def test_a_non_loopback_bind_without_a_token_is_refused(tmp_path, command: str) -> None:
    settings = Settings(home=tmp_path, bind_host="0.0.0.0")
    done = treadle(settings, command, timeout=60)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: the SQL endpoint would listen on TREADLE_BIND_HOST=0.0.0.0 without a token")
    assert "TREADLE_SQL_TOKEN" in lines[0] and "Traceback" not in done.stderr + done.stdout


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                                ("0.0.0.0", False), ("10.1.2.3", False), ("::", False)])  # fmt: skip
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def _post(port: int, path: str, body: dict, headers: dict[str, str]) -> tuple[int, bytes]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_with_a_token_every_query_must_carry_it(deployment: Settings, worker_factory) -> None:
    settings = deployment.model_copy(update={"sql_token": SecretStr(TOKEN)})
    worker = worker_factory(settings).start()
    worker.wait_ready()
    port = SqlEndpoint.read(settings).port
    query = {"sql": "SELECT 1 AS one"}

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        for path in ("/sql", "/arrow"):
            status, body = _post(port, path, query, headers)
            assert status == 401, (path, headers, body)
            assert "TREADLE_SQL_TOKEN" in json.loads(body)["error"]
    status, body = _post(port, "/sql", query, {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and json.loads(body)["rows"] == [[1]]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as metrics:
        assert metrics.status == 200  # Prometheus scrapes it without the token: counts, not rows

    done = treadle(settings, "sql", "SELECT 2 AS two", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"two": 2}
    wrong = treadle(settings.model_copy(update={"sql_token": SecretStr("not-it")}), "sql", "SELECT 2")
    assert wrong.returncode == 1
    assert wrong.stderr.startswith("error: the SQL endpoint wants TREADLE_SQL_TOKEN")
    assert len(wrong.stderr.strip().splitlines()) == 1
    missing = treadle(settings.model_copy(update={"sql_token": None}), "sql", "SELECT 2")
    assert missing.returncode == 1 and "TREADLE_SQL_TOKEN" in missing.stderr

    worker.stop()
    log = worker.log_path.read_text(errors="replace")
    assert "SQL needs TREADLE_SQL_TOKEN" in log  # the sink said it serves with a token...
    assert TOKEN not in log  # ...and never which
