"""Bound query parameters: values become typed literals the guard reads as data, never as SQL."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from sinks.sql_guard import check_read_only
from sinks.sql_lexer import TokenKind, tokenize
from sinks.sql_params import QueryParameterError, bind_parameters, string_literal

NASTY = [
    "x' OR '1'='1",
    "x\\' OR 1=1 --",
    "'; DROP TABLE transitions; --",
    "a\\",
    "{q:String}",
    "line\nbreak\ttab\x00nul\x7fdel",
    "ünïcødé ✓ \u2019quote\u2019",
    "$$heredoc$$",
    "/* comment */ -- x",
    "file('/etc/passwd')",
]


@pytest.mark.parametrize("value", NASTY)
def test_a_string_value_is_one_string_literal_whatever_it_holds(value: str) -> None:
    sql = bind_parameters("SELECT count() FROM transitions WHERE session_id = {s:String}", {"s": value})
    tokens = [t for t in tokenize(sql) if t.significant]
    assert [t.kind for t in tokens[-3:]] == [TokenKind.WORD, TokenKind.PUNCTUATION, TokenKind.STRING]
    assert check_read_only(sql) == sql  # one read-only statement: nothing the value holds escaped the literal


def test_string_literal_escapes_quotes_backslashes_and_controls() -> None:
    assert string_literal("a'b\\c\n") == "'a\\'b\\\\c\\x0A'"


def test_types_are_checked_and_written_as_their_literals() -> None:
    sql = bind_parameters(
        "SELECT {n:UInt32}, {f:Float64}, {b:Bool}, {t:DateTime64}, {ids:Array(String)}",
        {"n": 5, "f": 0.5, "b": True, "t": datetime(2026, 1, 1, tzinfo=UTC), "ids": ["a", "b'"]},
    )
    assert sql == ("SELECT 5, 0.5, true, fromUnixTimestamp64Micro(toInt64(1767225600000000), 'UTC'), ['a', 'b\\'']")
    for params in ({"n": "5 OR 1=1"}, {"n": -1}, {"n": True}, {"n": 1.5}):
        with pytest.raises(QueryParameterError):
            bind_parameters("SELECT {n:UInt32}", params)
    with pytest.raises(QueryParameterError):
        bind_parameters("SELECT {f:Float64}", {"f": float("nan")})
    with pytest.raises(QueryParameterError):
        bind_parameters("SELECT {s:String}", {"s": 1})


def test_missing_extra_and_unknown_parameters_are_refused() -> None:
    with pytest.raises(QueryParameterError, match="no value"):
        bind_parameters("SELECT {a:String}", {})
    with pytest.raises(QueryParameterError, match="not used"):
        bind_parameters("SELECT 1", {"a": "x"})
    with pytest.raises(QueryParameterError, match="unsupported"):
        bind_parameters("SELECT {a:Map}", {"a": "x"})


def test_placeholders_inside_literals_and_comments_are_text() -> None:
    sql = "SELECT '{a:String}' -- {a:String}\n, {a:String}"
    assert bind_parameters(sql, {"a": "v"}) == "SELECT '{a:String}' -- {a:String}\n, 'v'"
