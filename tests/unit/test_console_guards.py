"""The console without a database: the token guard, the bind check, query building with hostile filters, charts."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import SecretStr
from typer.testing import CliRunner

from sinks.sql_guard import check_read_only
from sinks.sql_lexer import TokenKind, tokenize
from sinks.sql_params import bind_parameters
from topics.settings import Settings
from treadle.cli import app as cli_app
from treadle.console import queries, svg
from treadle.console.app import console_app
from treadle.console.auth import COOKIE, UnsafeBindError, check_bind, is_loopback
from treadle.console.events import EventChecker
from treadle.console.params import BadRequestError, SessionFilter

TOKEN = "s3cret-token-value"
INJECTIONS = [
    "x' OR '1'='1",
    "'; DROP TABLE transitions; --",
    "x\\' UNION SELECT * FROM system.users --",
    "{q:String}",
    "') OR file('/etc/passwd') --",
    "ü' /* */ --",
]


def settings(tmp_path: Path, token: str | None = None) -> Settings:
    return Settings(home=tmp_path, console_token=SecretStr(token) if token else None)


async def test_a_token_protected_console_refuses_requests_without_the_token(tmp_path: Path) -> None:
    async with TestClient(TestServer(console_app(settings(tmp_path, TOKEN)))) as client:
        for path in ("/validate", "/static/console.css", "/sessions", "/live/sessions"):
            response = await client.get(path, allow_redirects=False)
            assert response.status == 401, path
            assert TOKEN not in await response.text()
        wrong = await client.get("/validate", headers={"Authorization": "Bearer nope"})
        assert wrong.status == 401
        ok = await client.get("/validate", headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status == 200 and "Schema validator" in await ok.text()

        once = await client.get(f"/validate?type=ToolResult&token={TOKEN}", allow_redirects=False)
        assert once.status == 303 and once.headers["Location"] == "/validate?type=ToolResult"
        assert once.cookies[COOKIE].value == TOKEN and once.cookies[COOKIE]["httponly"]
        with_cookie = await client.get("/validate")  # the client keeps the cookie
        assert with_cookie.status == 200


async def test_without_a_token_setting_loopback_needs_none(tmp_path: Path) -> None:
    async with TestClient(TestServer(console_app(settings(tmp_path)))) as client:
        response = await client.get("/static/console.js")
        assert response.status == 200
        assert "script-src 'self'" in response.headers["Content-Security-Policy"]


def test_binding_beyond_loopback_needs_a_token() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.org")
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", TOKEN)
    with pytest.raises(UnsafeBindError, match="TREADLE_CONSOLE_TOKEN"):
        check_bind("0.0.0.0", None)


def test_the_cli_refuses_a_public_bind_without_a_token_in_one_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("TREADLE_CONSOLE_TOKEN", raising=False)
    monkeypatch.setenv("TREADLE_HOME", str(tmp_path))
    result = CliRunner().invoke(cli_app, ["console", "--host", "0.0.0.0", "--port", "1"])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: refusing to serve the console on 0.0.0.0")


@pytest.mark.parametrize("hostile", INJECTIONS)
def test_hostile_filter_values_stay_inside_string_literals(hostile: str) -> None:
    """Every text filter at once: the bound statement has the same code tokens as with harmless values."""

    def code_tokens(f: SessionFilter) -> list[str]:
        texts = []
        for query, params in (queries.sessions_sql(f), queries.page_sql(f), queries.total_sql(f)):
            sql = check_read_only(bind_parameters(query, params))
            texts += [t.text for t in tokenize(sql) if t.significant and t.kind is not TokenKind.STRING]
        return texts

    benign = SessionFilter(agent="a", policy="p", q="s", status="open")
    hostile_filter = SessionFilter(agent=hostile, policy=hostile, q=hostile, status="open")
    assert code_tokens(hostile_filter) == code_tokens(benign)


def test_filters_are_validated_strictly() -> None:
    for query in ({"sort": "steps; DROP"}, {"order": "sideways"}, {"status": "x"}, {"page": "0"}, {"size": "10000"},
                  {"agent": "a\x00b"}, {"q": "x" * 201}, {"since": "yesterday"}):  # fmt: skip
        with pytest.raises(BadRequestError):
            SessionFilter.parse(query)
    f = SessionFilter.parse({"agent": "", "sort": "late", "order": "asc", "since": "2026-01-01T00:00"})
    assert f.agent is None and f.since is not None and f.since.tzinfo is not None


def test_delay_bins_put_the_deadline_on_a_bin_edge() -> None:
    bins = svg.delay_bins([0.5, 1.0, 14.9, 15.0, 40.0], deadline_s=15.0, bins=10)
    assert sum(b.count for b in bins) == 5
    assert any(b.end == 15.0 for b in bins) and any(b.start == 15.0 for b in bins)
    assert sum(b.count for b in bins if b.late) == 2  # 15.0 (at the deadline's bin start) and 40.0
    chart = svg.delay_histogram([1.0, 20.0], 10.0, 5.0, "judge <b>")
    assert 'class="bar late"' in chart and "judge &lt;b&gt;" in chart


def test_the_validator_gives_the_workers_reasons(tmp_path: Path) -> None:
    checker = EventChecker(settings(tmp_path))
    from treadle.console.events import example_event

    good = example_event("RewardSignal")
    assert checker.check("RewardSignal", good).valid
    bad = good.replace('"confidence": 0.9', '"confidence": 2.0')
    verdict = checker.check("RewardSignal", bad)
    assert (verdict.valid, verdict.stage) == (False, "VALIDATE")
    assert verdict.reason == "confidence must be in [0, 1], got 2.0"
    keyed = checker.check("RewardSignal", good, key="other")
    assert keyed.stage == "VALIDATE" and "differs from envelope.session_id" in (keyed.reason or "")
    missing = checker.check("RewardSignal", good.replace('"source": "llm_judge",', ""))
    assert missing.stage == "SCHEMA" and "source" in (missing.reason or "")
    assert checker.check("RewardSignal", "{not json").stage == "DECODE"
    decoded = checker.decode(b"\xc3\x01garbage")
    assert decoded.record_json is None and decoded.error is not None


def test_the_console_reads_only_the_live_rows_of_variant_tables() -> None:
    from treadle.console.queries import live_rows_only

    query = (
        "SELECT count() FROM transitions FINAL WHERE x IN (SELECT y FROM late_rewards) AND z FROM transitions_latest"
    )
    assert live_rows_only(query) == (
        "SELECT count() FROM (SELECT * FROM transitions FINAL WHERE variant = 'live') AS transitions WHERE x IN "
        "(SELECT y FROM (SELECT * FROM late_rewards WHERE variant = 'live') AS late_rewards) AND z FROM "
        "transitions_latest"
    )
