"""A ClickHouse SQL tokenizer that knows exactly where literals and comments start and end.

The read-only guard and the migration runner both need to see statements the way ClickHouse does: a `;` or
`file(` inside a string literal, a quoted identifier or a comment is not code. The rules mirror ClickHouse 26's
lexer (checked against chDB): '…' strings and `…`/"…" identifiers with backslash escapes and doubled quotes,
strings and identifiers in Unicode quotes (U+2018…U+2019 and U+201C…U+201D) with no escapes, $tag$…$tag$
heredocs, -- and `# `/`#!` line comments, nested /* */ comments. Anything this lexer cannot place for certain
(an unterminated literal, a control or non-ASCII character outside a literal) is an error, so callers refuse, not guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class SqlLexError(ValueError):
    """The text cannot be tokenized unambiguously; `position` is the offset of the offending character."""

    def __init__(self, message: str, position: int) -> None:
        super().__init__(f"{message} at position {position}")
        self.message = message
        self.position = position


class TokenKind(Enum):
    WORD = "word"  # keyword, unquoted identifier or number
    QUOTED_IDENTIFIER = "quoted identifier"  # `x`, "x", and x in U+201C/U+201D quotes
    STRING = "string"  # 'x', $tag$x$tag$, and x in U+2018/U+2019 quotes
    PUNCTUATION = "punctuation"  # one character: ( ) , ; . = + ...
    COMMENT = "comment"
    WHITESPACE = "whitespace"


@dataclass(frozen=True, slots=True)
class Token:
    kind: TokenKind
    text: str  # exactly as written, quotes included
    start: int
    end: int

    @property
    def significant(self) -> bool:
        return self.kind not in (TokenKind.COMMENT, TokenKind.WHITESPACE)

    @property
    def upper(self) -> str:
        """Upper-cased text of a WORD (keywords are case-insensitive); '' for other kinds."""
        return self.text.upper() if self.kind is TokenKind.WORD else ""


_WORD = re.compile(r"[A-Za-z0-9_$]+")
_HEREDOC_TAG = re.compile(r"\$[A-Za-z0-9_]*\$")
_WHITESPACE = " \t\n\r\f\v"
_QUOTES_WITH_ESCAPES = {"'": TokenKind.STRING, "`": TokenKind.QUOTED_IDENTIFIER, '"': TokenKind.QUOTED_IDENTIFIER}
_UNICODE_QUOTES = {"\u2018": ("\u2019", TokenKind.STRING), "\u201c": ("\u201d", TokenKind.QUOTED_IDENTIFIER)}


def tokenize(sql: str) -> list[Token]:
    """All tokens of `sql`, whitespace and comments included, so their offsets cover the whole text."""
    tokens: list[Token] = []
    pos, end = 0, len(sql)
    while pos < end:
        start, ch = pos, sql[pos]
        if ch in _WHITESPACE:
            while pos < end and sql[pos] in _WHITESPACE:
                pos += 1
            kind = TokenKind.WHITESPACE
        elif sql.startswith("--", pos) or (ch == "#" and sql[pos + 1 : pos + 2] in (" ", "!")):
            newline = sql.find("\n", pos)
            pos = end if newline < 0 else newline + 1
            kind = TokenKind.COMMENT
        elif sql.startswith("/*", pos):
            pos = _block_comment_end(sql, pos)
            kind = TokenKind.COMMENT
        elif ch in _QUOTES_WITH_ESCAPES:
            pos = _quoted_end(sql, pos, ch)
            kind = _QUOTES_WITH_ESCAPES[ch]
        elif ch in _UNICODE_QUOTES:
            closer, kind = _UNICODE_QUOTES[ch]
            close = sql.find(closer, pos + 1)
            if close < 0:
                raise SqlLexError(f"unterminated {ch}…{closer} literal", start)
            pos = close + 1
        elif ch == "$" and (tag := _HEREDOC_TAG.match(sql, pos)):
            close = sql.find(tag.group(), tag.end())
            if close < 0:
                raise SqlLexError(f"unterminated heredoc {tag.group()}", start)
            pos = close + len(tag.group())
            kind = TokenKind.STRING
        elif word := _WORD.match(sql, pos):
            pos = word.end()
            kind = TokenKind.WORD
        elif ch.isascii() and ch.isprintable():
            pos += 1
            kind = TokenKind.PUNCTUATION
        elif ch.isascii():
            raise SqlLexError(f"control character {ch!r} outside a string literal", start)
        else:
            raise SqlLexError(f"non-ASCII character {ch!r} outside a string literal or quoted identifier", start)
        tokens.append(Token(kind, sql[start:pos], start, pos))
    return tokens


def _block_comment_end(sql: str, pos: int) -> int:
    """Offset after the */ closing the comment at `pos`; ClickHouse nests /* */ comments."""
    depth, i = 0, pos
    while i < len(sql):
        if sql.startswith("/*", i):
            depth, i = depth + 1, i + 2
        elif sql.startswith("*/", i):
            depth, i = depth - 1, i + 2
            if depth == 0:
                return i
        else:
            i += 1
    raise SqlLexError("unterminated /* comment", pos)


def _quoted_end(sql: str, pos: int, quote: str) -> int:
    """Offset after the closing `quote`; a backslash escapes the next character and a doubled quote is one."""
    i = pos + 1
    while i < len(sql):
        ch = sql[i]
        if ch == "\\":
            i += 2
        elif ch == quote:
            if sql[i + 1 : i + 2] == quote:
                i += 2
            else:
                return i + 1
        else:
            i += 1
    raise SqlLexError(f"unterminated {quote}…{quote} literal", pos)


def quoted_content(token: Token) -> str:
    """The text between the quotes of a STRING or QUOTED_IDENTIFIER, escapes left as written."""
    if token.text.startswith("$"):
        tag = _HEREDOC_TAG.match(token.text)
        assert tag is not None
        return token.text[tag.end() : len(token.text) - len(tag.group())]
    return token.text[1:-1]


def split_statements(sql: str) -> list[str]:
    """The statements of a script, split at `;` outside literals and comments; empty statements dropped."""
    statements: list[str] = []
    current: list[Token] = []
    for token in [*tokenize(sql), Token(TokenKind.PUNCTUATION, ";", len(sql), len(sql))]:
        if token.kind is TokenKind.PUNCTUATION and token.text == ";":
            significant = [t for t in current if t.significant]
            if significant:
                statements.append(sql[significant[0].start : significant[-1].end])
            current = []
        else:
            current.append(token)
    return statements
