"""Query parameters for the read-only SQL client: `{name:Type}` placeholders replaced by typed literals.

The SQL service takes one statement of text (the sink's HTTP endpoint, chDB, or a server), so values a person
typed into a filter must become literals that ClickHouse can only read as data. `bind_parameters` finds the
placeholders with the guard's lexer (a `{x:String}` inside a string literal or a comment is text, not a
placeholder), checks each value against its declared type and writes it as a literal of that type: strings with
every quote, backslash and control character escaped, numbers only if they are finite numbers. The placeholder
syntax is ClickHouse's own server-side parameter syntax, so a bound query reads like one ClickHouse would bind.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from sinks.sql_lexer import SqlLexError, Token, TokenKind, tokenize


class QueryParameterError(ValueError):
    """A placeholder without a value, a value without a placeholder, or a value that is not of its type."""


_INTEGER_TYPES = frozenset({"Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64"})
_FLOAT_TYPES = frozenset({"Float32", "Float64"})
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TYPE = re.compile(r"^[A-Za-z0-9_]+(\([A-Za-z0-9_]+\))?$")


def bind_parameters(query: str, params: Mapping[str, Any]) -> str:
    """`query` with each `{name:Type}` placeholder outside literals and comments replaced by its value's literal.

    Types: String, the Int/UInt types, Float32/Float64, Bool, DateTime64 (a datetime or UTC micros), and
    Array(T) of those (for `IN {ids:Array(String)}`). Raises QueryParameterError for anything else.
    """
    try:
        tokens = tokenize(query)
    except SqlLexError as exc:
        raise QueryParameterError(f"cannot read the query to bind parameters: {exc}") from None
    out: list[str] = []
    used: set[str] = set()
    i = 0
    while i < len(tokens):
        placeholder = _placeholder(tokens, i)
        if placeholder is None:
            out.append(tokens[i].text)
            i += 1
            continue
        name, sql_type, width = placeholder
        if name not in params:
            raise QueryParameterError(f"no value for query parameter {name!r}")
        out.append(literal(params[name], sql_type, name))
        used.add(name)
        i += width
    unused = sorted(set(params) - used)
    if unused:
        raise QueryParameterError(f"query parameter(s) {', '.join(unused)} not used in the query")
    return "".join(out)


def _placeholder(tokens: Sequence[Token], i: int) -> tuple[str, str, int] | None:
    """(name, type, tokens spanned) when tokens[i:] start `{name:Type}` (Type may be `Array(String)`)."""
    if not _punct(tokens[i], "{"):
        return None
    texts: list[str] = []
    for j in range(i + 1, min(i + 10, len(tokens))):
        token = tokens[j]
        if _punct(token, "}"):
            inner = "".join(texts)
            name, colon, sql_type = inner.partition(":")
            if not colon or not _NAME.match(name) or not _TYPE.match(sql_type):
                raise QueryParameterError(f"malformed query parameter {{{inner}}}: write {{name:Type}}")
            return name, sql_type, j - i + 1
        if token.kind not in (TokenKind.WORD, TokenKind.PUNCTUATION):
            return None
        texts.append(token.text)
    return None


def _punct(token: Token, text: str) -> bool:
    return token.kind is TokenKind.PUNCTUATION and token.text == text


def literal(value: Any, sql_type: str, name: str = "value") -> str:
    """A ClickHouse literal of `sql_type` for `value`; QueryParameterError if `value` is not of that type."""
    if sql_type.startswith("Array(") and sql_type.endswith(")"):
        inner = sql_type[len("Array(") : -1]
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise QueryParameterError(f"query parameter {name!r} must be a list for {sql_type}")
        return "[" + ", ".join(literal(v, inner, name) for v in value) + "]"
    if sql_type == "String":
        if not isinstance(value, str):
            raise QueryParameterError(f"query parameter {name!r} must be a string, got {type(value).__name__}")
        return string_literal(value)
    if sql_type in _INTEGER_TYPES:
        if isinstance(value, bool) or not isinstance(value, int):
            raise QueryParameterError(f"query parameter {name!r} must be an integer for {sql_type}")
        if sql_type.startswith("U") and value < 0:
            raise QueryParameterError(f"query parameter {name!r} must not be negative for {sql_type}")
        return str(int(value))
    if sql_type in _FLOAT_TYPES:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise QueryParameterError(f"query parameter {name!r} must be a finite number for {sql_type}")
        return repr(float(value))
    if sql_type == "Bool":
        if not isinstance(value, bool):
            raise QueryParameterError(f"query parameter {name!r} must be true or false")
        return "true" if value else "false"
    if sql_type == "DateTime64":
        if isinstance(value, datetime):
            aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
            micros = round(aware.timestamp() * 1_000_000)
        elif isinstance(value, int) and not isinstance(value, bool):
            micros = value
        else:
            raise QueryParameterError(f"query parameter {name!r} must be a datetime or UTC micros")
        return f"fromUnixTimestamp64Micro(toInt64({int(micros)}), 'UTC')"
    raise QueryParameterError(f"query parameter {name!r} has an unsupported type {sql_type}")


def quote(value: str) -> str:
    """A ClickHouse string literal: backslashes and quotes escaped, so any text stays one value."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def string_literal(text: str) -> str:
    """A ClickHouse string literal that reads back exactly `text`: quotes, backslashes and controls escaped."""
    out = ["'"]
    for ch in text:
        if ch in ("\\", "'"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    out.append("'")
    return "".join(out)
