"""The read-only guard for `treadle sql`: one SELECT-like statement, no writes, no files, no network.

`treadle sql` runs users' text inside the process that owns the embedded database (the worker), so a query
must not be able to change data or schema, change the session, or use ClickHouse's reach beyond its tables
(`file()`, `url()`, `s3()`, `remote()`, `executable()`, `INTO OUTFILE`…). The guard works on tokens from
sinks.sql_lexer, so text inside literals and comments never counts, and anything it cannot read for certain
is refused. `read_only_settings()` adds ClickHouse's own readonly mode on top.
"""

from __future__ import annotations

from sinks.sql_lexer import SqlLexError, Token, TokenKind, quoted_content, tokenize

ALLOWED_STATEMENTS = ("SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN", "EXISTS")
_ALLOWED_TEXT = "SELECT, WITH … SELECT, SHOW, DESCRIBE, EXPLAIN or EXISTS"

_WRITES = frozenset({"INSERT", "UPDATE", "DELETE", "ALTER", "OPTIMIZE", "TRUNCATE", "REPLACE", "UPSERT", "MERGE"})
_DDL = frozenset({"CREATE", "DROP", "RENAME", "ATTACH", "DETACH", "EXCHANGE", "UNDROP", "MOVE", "BACKUP", "RESTORE"})
_ADMIN = frozenset(
    {"SYSTEM", "KILL", "SET", "USE", "GRANT", "REVOKE", "CHECK", "BEGIN", "COMMIT", "ROLLBACK", "WATCH", "PARALLEL"}
)
_STATEMENT_KEYWORDS = _WRITES | _DDL | _ADMIN | {"SELECT"}

# Table functions that cannot reach files, the network, other processes or code. Anything else in a table
# position (after FROM, JOIN, TABLE, DESCRIBE or a comma in a FROM list) is refused, so a table function
# added by a future ClickHouse is refused until someone lists it here.
SAFE_TABLE_FUNCTIONS = frozenset(
    name.casefold()
    for name in (
        "numbers", "numbers_mt", "zeros", "zeros_mt", "primes", "generateRandom", "generateSeries",
        "generate_series", "values", "SQLStandardValues", "null", "view", "viewIfPermitted", "viewExplain",
        "merge", "loop", "dictionary", "fuzzJSON", "fuzzQuery", "mergeTreeIndex", "mergeTreeProjection",
        "mergeTreeAnalyzeIndexes", "mergeTreeAnalyzeIndexesUUID", "mergeTreeCodecBlockCounts", "mergeTreeTextIndex",
        "timeSeriesData", "timeSeriesMetrics", "timeSeriesTags", "timeSeriesSamples", "timeSeriesSelector",
        "timeSeriesMetricFamilies",
    )
)  # fmt: skip

# Functions refused wherever they appear: they read files, reach the network or other databases, or run code.
# None is also a harmless scalar function (the scalar `file` reads a file too). `format` is not here: it is a
# string function in expressions, and as a table function (FROM format(...)) the table-position rule refuses it.
DENIED_FUNCTIONS = frozenset(
    name.casefold()
    for name in (
        "file", "fileCluster", "filesystem", "url", "urlCluster", "s3", "s3Cluster", "gcs", "oss", "cosn",
        "azureBlobStorage", "azureBlobStorageCluster", "hdfs", "hdfsCluster", "remote", "remoteSecure", "cluster",
        "clusterAllReplicas", "mysql", "postgresql", "mongodb", "redis", "jdbc", "odbc", "sqlite", "executable",
        "executablePool", "input", "python", "eval", "arrowstream", "arrowFlight", "bigquery", "ytsaurus", "hive",
        "prometheusQuery", "prometheusQueryRange", "deltaLake", "deltaLakeAzure", "deltaLakeAzureCluster",
        "deltaLakeCluster", "deltaLakeLocal", "deltaLakeS3", "deltaLakeS3Cluster", "iceberg", "icebergAzure",
        "icebergAzureCluster", "icebergCluster", "icebergHDFS", "icebergHDFSCluster", "icebergLocal",
        "icebergLocalCluster", "icebergS3", "icebergS3Cluster", "hudi", "hudiCluster", "paimon", "paimonAzure",
        "paimonAzureCluster", "paimonCluster", "paimonHDFS", "paimonHDFSCluster", "paimonLocal", "paimonS3",
        "paimonS3Cluster",
    )
)  # fmt: skip

_CLAUSE_KEYWORDS = frozenset(
    {"SELECT", "FROM", "JOIN", "WHERE", "PREWHERE", "GROUP", "ORDER", "HAVING", "LIMIT", "OFFSET", "SETTINGS",
     "FORMAT", "WINDOW", "QUALIFY", "UNION", "EXCEPT", "INTERSECT", "ON", "USING", "ARRAY", "WITH", "INTO"}
)  # fmt: skip


# Words that take a parenthesised operand after an expression: `x IN (...)`, `x NOT IN (...)`, `a AND (...)`.
_OPERATORS = frozenset({"IN", "NOT", "AND", "OR", "LIKE", "ILIKE", "BETWEEN", "IS", "GLOBAL"})
_TABLE_KEYWORD_BEFORE = frozenset({"DESCRIBE", "DESC", "EXISTS", "CREATE", "SHOW", "TEMPORARY"})  # `DESCRIBE TABLE x`


class ReadOnlyQueryError(ValueError):
    """A query `treadle sql` refuses; the message is one line meant for the user."""


def read_only_settings() -> dict[str, int]:
    """Query settings to send with every guarded query: ClickHouse's own read-only mode, as defense in depth.

    readonly=1 (checked on chDB 26.9) refuses writes, DDL and SET, and also the file()/url() table functions;
    it also refuses a SETTINGS clause in the query itself. readonly=2 would allow SETTINGS but not block file().
    """
    return {"readonly": 1}


def check_read_only(sql: str) -> str:
    """The single statement in `sql`, trimmed of surrounding comments and a trailing `;`, if it is read-only.

    Raises ReadOnlyQueryError naming the first reason to refuse it.
    """
    try:
        tokens = [t for t in tokenize(sql) if t.significant]
    except SqlLexError as exc:
        raise ReadOnlyQueryError(f"cannot check this query: {exc}") from None
    tokens = _single_statement(tokens)
    _check_statement_kind(tokens)
    _check_reach(tokens)
    return sql[tokens[0].start : tokens[-1].end]


def _single_statement(tokens: list[Token]) -> list[Token]:
    """The tokens before an optional final `;`; anything after a `;` is a second statement."""
    for i, token in enumerate(tokens):
        if _is(token, ";"):
            if i + 1 < len(tokens):
                raise ReadOnlyQueryError("only one statement is allowed: remove everything after the `;`")
            tokens = tokens[:i]
            break
    if not tokens:
        raise ReadOnlyQueryError(f"empty query: write one {_ALLOWED_TEXT} statement")
    return tokens


def _check_statement_kind(tokens: list[Token]) -> None:
    first = next((t for t in tokens if not _is(t, "(")), tokens[0])
    keyword = first.upper
    if keyword not in ALLOWED_STATEMENTS or (first is not tokens[0] and keyword not in ("SELECT", "WITH")):
        _refuse_statement(keyword or f"a statement starting with {first.text!r}")
    if keyword in ("WITH", "EXPLAIN"):
        # `WITH … INSERT` is valid ClickHouse, and EXPLAIN names another statement: the first statement keyword
        # at the outer level decides.
        start = tokens.index(first) + 1
        inner = next((t.upper for t in _outer_level(tokens[start:]) if t.upper in _STATEMENT_KEYWORDS), None)
        if inner is not None and inner != "SELECT":
            _refuse_statement(f"{keyword} … {inner}")


def _refuse_statement(what: str) -> None:
    last = what.rsplit(" ", 1)[-1]
    if last in _WRITES:
        why = "it writes data"
    elif last in _DDL:
        why = "it changes the schema"
    elif last in _ADMIN:
        why = "it changes server or session state"
    else:
        why = "it is not a read-only statement"
    raise ReadOnlyQueryError(f"{what} is refused: {why}; treadle sql runs one {_ALLOWED_TEXT} statement")


def _check_reach(tokens: list[Token]) -> None:
    """Refuse INTO OUTFILE and calls of functions that reach beyond ClickHouse's tables."""
    scopes = [_Scope()]  # one per open parenthesis: what the text at that level is doing
    for i, token in enumerate(tokens):
        previous = tokens[i - 1] if i > 0 else None
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if token.upper == "INTO" and nxt is not None and nxt.upper == "OUTFILE":
            raise ReadOnlyQueryError("INTO OUTFILE is refused: it writes a file on the server")
        if _is(token, "("):
            scopes.append(_Scope())
        elif _is(token, ")"):
            if len(scopes) > 1:
                scopes.pop()
        elif token.upper in _CLAUSE_KEYWORDS and not (nxt is not None and _is(nxt, "(")):
            array_join = token.upper == "JOIN" and previous is not None and previous.upper == "ARRAY"
            scopes[-1].clause = "ARRAY JOIN" if array_join else token.upper
            scopes[-1].saw_select |= token.upper == "SELECT"
        if nxt is None or not _is(nxt, "(") or token.kind not in (TokenKind.WORD, TokenKind.QUOTED_IDENTIFIER):
            continue
        name = _function_name(token)
        key = name.casefold()
        if key in DENIED_FUNCTIONS:
            raise ReadOnlyQueryError(f"{name}() is refused: it reaches files, the network or other systems")
        if (
            previous is not None
            and _in_table_position(previous, scopes[-1])
            and key not in SAFE_TABLE_FUNCTIONS
            and not _is_operator(token, previous, tokens[i - 2] if i > 1 else None)
        ):
            raise ReadOnlyQueryError(
                f"table function {name}() is refused: treadle sql allows only table functions that stay inside "
                "ClickHouse (numbers, values, view, merge, ...)"
            )


class _Scope:
    """The clause being read at one parenthesis depth, and whether that level is a SELECT (not `f(x FROM y)`)."""

    __slots__ = ("clause", "saw_select")

    def __init__(self) -> None:
        self.clause = ""
        self.saw_select = False


def _in_table_position(previous: Token, scope: _Scope) -> bool:
    """Whether a call after `previous` names a table function: FROM t(...), JOIN t(...), FROM a, t(...)."""
    if previous.upper in ("TABLE", "DESCRIBE", "DESC"):
        return True
    if not scope.saw_select or scope.clause not in ("FROM", "JOIN"):
        return False
    return previous.upper in ("FROM", "JOIN") or _is(previous, ",")


def _is_operator(token: Token, previous: Token, before: Token | None) -> bool:
    """Whether `token (` is an operator after an expression, not a call: `WHERE table IN ('t')`.

    The column `table` of system.tables reads like the keyword of `DESCRIBE TABLE f(...)`, so the IN after it
    looked like a table function. An operator word counts as one only after an operand (a name, a literal or
    a `)`), never right after FROM, JOIN, a comma or the TABLE of `DESCRIBE TABLE`; what is inside its
    parentheses is still checked (a denied function is refused by name).
    """
    if token.kind is not TokenKind.WORD or token.upper not in _OPERATORS:
        return False
    if previous.kind is TokenKind.PUNCTUATION:
        return previous.text == ")"
    if previous.upper in ("FROM", "JOIN", "DESCRIBE", "DESC"):
        return False
    return previous.upper != "TABLE" or before is None or before.upper not in _TABLE_KEYWORD_BEFORE


def _function_name(token: Token) -> str:
    if token.kind is TokenKind.WORD:
        return token.text
    name = quoted_content(token)
    if "\\" in name or token.text[0] in name:
        raise ReadOnlyQueryError(f"function name {token.text} is refused: escapes in quoted function names")
    return name


def _outer_level(tokens: list[Token]) -> list[Token]:
    """The tokens outside any parentheses, less the names of function calls (`replace(...)` is no REPLACE)."""
    depth, outer = 0, []
    for i, token in enumerate(tokens):
        if _is(token, "("):
            depth += 1
        elif _is(token, ")"):
            depth -= 1
        elif depth == 0 and not (i + 1 < len(tokens) and _is(tokens[i + 1], "(")):
            outer.append(token)
    return outer


def _is(token: Token, punctuation: str) -> bool:
    return token.kind is TokenKind.PUNCTUATION and token.text == punctuation
