"""The read-only guard of `treadle sql`: a table of verdicts, properties over literals and comments, and chDB
checks that the guard reads literals the way ClickHouse does and that readonly=1 holds on its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sinks.clickhouse import ClickHouseStore
from sinks.sql_guard import (
    DENIED_FUNCTIONS,
    SAFE_TABLE_FUNCTIONS,
    ReadOnlyQueryError,
    check_read_only,
    read_only_settings,
)
from sinks.sql_lexer import SqlLexError, TokenKind, split_statements, tokenize
from topics.settings import Settings

ALLOWED = [
    ("SELECT 1", "SELECT 1"),
    ("  select * from t limit 5 ;  ", "select * from t limit 5"),
    ("SELECT 1; -- done\n/* really */  ", "SELECT 1"),
    ("-- leading comment\nSELECT 2", "SELECT 2"),
    ("SELECT 'a;b' AS x", None),
    ("SELECT 'file(''/etc/passwd'')' AS x", None),
    ("SELECT 'x\\'; DROP TABLE t; --' AS y", None),
    ("SELECT `weird;name` FROM (SELECT 1 AS `weird;name`)", None),
    ('SELECT "file" FROM (SELECT 1 AS "file")', None),
    ("SELECT 1 /* ; INSERT INTO t VALUES (1) */", "SELECT 1"),
    ("SELECT /* ; INSERT INTO t VALUES (1) */ 1", None),
    ("SELECT 1 /* nested /* ; */ still comment */ + 1", None),
    ("SELECT 1 # hash comment; DROP TABLE t\n", "SELECT 1"),
    ("SELECT $$it's; a heredoc$$", None),
    ("SELECT $tag$ file('x') $tag$", None),
    ("SELECT \u2018curly; quotes\u2019", None),
    ("WITH 2 AS x SELECT x * 2", None),
    ("WITH replace('abc', 'b', 'c') AS r, trim(BOTH ' ' FROM ' x ') AS t SELECT r, t", None),
    ("(SELECT 1) UNION ALL (SELECT 2)", None),
    ("SELECT count() FROM numbers(10)", None),
    ("SELECT * FROM numbers(3) AS a, generate_series(1, 2) AS b", None),
    ("SELECT extract(YEAR FROM toDate('2025-01-02'))", None),
    ("SELECT format('{} is {}', 'x', 1)", None),
    ("SELECT x FROM (SELECT [1, 2] AS arr) ARRAY JOIN arr AS x", None),
    ("SELECT * FROM system.tables WHERE database = currentDatabase()", None),
    ("SHOW TABLES", None),
    ("SHOW CREATE TABLE t", None),
    ("DESCRIBE TABLE system.one", None),
    ("DESC system.one", None),
    ("EXPLAIN SELECT 1", None),
    ("EXPLAIN SYNTAX SELECT count() FROM numbers(5)", None),
    ("EXISTS TABLE system.one", None),
    ("SELECT 1 FROM numbers(1) WHERE 1 IN (SELECT 1)", None),
    ("SELECT update, `system` FROM (SELECT 1 AS update, 2 AS `system`)", None),
    ("SELECT table FROM system.tables WHERE table IN ('transitions')", None),
    ("SELECT table FROM system.tables WHERE table NOT IN ('transitions', 'raw_events')", None),
    ("SELECT database, table FROM system.tables WHERE (database, table) IN (('system', 'one'))", None),
    ("SELECT count() FROM system.tables WHERE table IN (SELECT 'one') AND (1 = 1)", None),
]

REFUSED = [
    ("INSERT INTO transitions VALUES (1)", "INSERT is refused: it writes data"),
    ("insert into t select 1", "INSERT is refused"),
    ("ALTER TABLE transitions DELETE WHERE 1", "ALTER is refused"),
    ("DELETE FROM transitions WHERE 1", "DELETE is refused"),
    ("UPDATE transitions SET reward = 1 WHERE 1", "UPDATE is refused"),
    ("OPTIMIZE TABLE transitions FINAL", "OPTIMIZE is refused"),
    ("TRUNCATE TABLE transitions", "TRUNCATE is refused"),
    ("CREATE TABLE t (x Int32) ENGINE = Memory", "CREATE is refused: it changes the schema"),
    ("DROP TABLE transitions", "DROP is refused"),
    ("RENAME TABLE a TO b", "RENAME is refused"),
    ("ATTACH TABLE t", "ATTACH is refused"),
    ("DETACH TABLE t", "DETACH is refused"),
    ("SYSTEM STOP MERGES", "SYSTEM is refused: it changes server or session state"),
    ("KILL QUERY WHERE 1", "KILL is refused"),
    ("SET readonly = 0", "SET is refused"),
    ("USE other", "USE is refused"),
    ("GRANT ALL ON *.* TO x", "GRANT is refused"),
    ("WITH 1 AS x INSERT INTO t SELECT x", "WITH … INSERT is refused"),
    ("EXPLAIN AST INSERT INTO t VALUES (1)", "EXPLAIN … INSERT is refused"),
    ("(INSERT INTO t VALUES (1))", "INSERT is refused"),
    ("FROM t SELECT 1", "FROM is refused"),
    ("\x1f", "control character '\\x1f'"),
    ("SELECT * FROM file\x1f('/etc/passwd')", "control character"),
    ("?", "a statement starting with '?' is refused"),
    ("SELECT 1; SELECT 2", "only one statement"),
    ("SELECT 1; DROP TABLE transitions", "only one statement"),
    ("SELECT 1;;", "only one statement"),
    ("SELECT 'a'; -- fine\n SELECT 2", "only one statement"),
    ("", "empty query"),
    ("  -- nothing\n /* here */ ", "empty query"),
    (";", "empty query"),
    ("SELECT * FROM file('/etc/passwd', 'LineAsString')", "file() is refused"),
    ("SELECT file('/etc/passwd')", "file() is refused"),
    ("SELECT 1 WHERE 1 IN file('/etc/passwd')", "file() is refused"),
    ("SELECT * FROM `file`('/etc/passwd', 'LineAsString')", "file() is refused"),
    ("SELECT * FROM \"file\"('/etc/passwd', 'LineAsString')", "file() is refused"),
    ("SELECT * FROM \u201cfile\u201d('/etc/passwd', 'LineAsString')", "file() is refused"),
    ("SELECT * FROM file /* hidden */ ('/etc/passwd', 'LineAsString')", "file() is refused"),
    ("SELECT * FROM file\n('/etc/passwd', 'LineAsString')", "file() is refused"),
    ("SELECT * FROM FILE('/etc/passwd', 'LineAsString')", "FILE() is refused"),
    ("SELECT * FROM url('http://example.com', 'CSV')", "url() is refused"),
    ("SELECT * FROM s3('https://b.s3.amazonaws.com/x.csv')", "s3() is refused"),
    ("SELECT * FROM s3Cluster('c', 'https://b/x')", "s3Cluster() is refused"),
    ("SELECT * FROM remote('10.0.0.1', system.one)", "remote() is refused"),
    ("SELECT * FROM remoteSecure('h', db.t)", "remoteSecure() is refused"),
    ("SELECT * FROM cluster('c', db.t)", "cluster() is refused"),
    ("SELECT * FROM mysql('h:3306', 'db', 't', 'u', 'p')", "mysql() is refused"),
    ("SELECT * FROM postgresql('h', 'db', 't', 'u', 'p')", "postgresql() is refused"),
    ("SELECT * FROM executable('x.sh', 'TSV', 'a String')", "executable() is refused"),
    ("SELECT * FROM python(df)", "python() is refused"),
    ("SELECT * FROM Python(df)", "Python() is refused"),
    ("SELECT * FROM input('a Int32')", "input() is refused"),
    ("SELECT * FROM iceberg('s3://b/t')", "iceberg() is refused"),
    ("SELECT * FROM deltaLake('s3://b/t')", "deltaLake() is refused"),
    ("SELECT * FROM hdfs('hdfs://h/x', 'TSV')", "hdfs() is refused"),
    ("SELECT * FROM azureBlobStorage('c', 'x')", "azureBlobStorage() is refused"),
    ("SELECT * FROM sqlite('/tmp/x.db', 't')", "sqlite() is refused"),
    ("SELECT * FROM numbers(1), format(JSONEachRow, '{\"a\": 1}')", "table function format() is refused"),
    ("SELECT * FROM format(JSONEachRow, '{\"a\": 1}')", "table function format() is refused"),
    ("SELECT * FROM t JOIN someNewTableFunction('x') ON 1", "table function someNewTableFunction() is refused"),
    ("SELECT * FROM (SELECT * FROM url('http://x', 'CSV'))", "url() is refused"),
    ("DESCRIBE TABLE url('http://x', 'CSV')", "url() is refused"),
    ("DESCRIBE TABLE in('x')", "table function in() is refused"),
    ("SELECT * FROM numbers(1), in(1)", "table function in() is refused"),
    ("SELECT table FROM system.tables WHERE table IN (SELECT * FROM file('/etc/passwd'))", "file() is refused"),
    ("SELECT 1 INTO OUTFILE '/tmp/x'", "INTO OUTFILE is refused"),
    ("SELECT * FROM `fi\\le`('/etc/passwd')", "escapes in quoted function names"),
    ("SELECT 'unterminated", "unterminated"),
    ("SELECT 1 /* unterminated", "unterminated /* comment"),
    ("SELECT $x$ never closed", "unterminated heredoc"),
    ("SELECT \u2018never closed", "unterminated"),
    ("SELECT caf\u00e9", "non-ASCII character"),
    ("SELECT * FROM file\u00a0('/etc/passwd')", "non-ASCII character"),
    ("SELECT \u2018'\u2019, * FROM file('/etc/passwd', \u2018'\u2019)", "file() is refused"),
]


@pytest.mark.parametrize(("sql", "normalized"), ALLOWED)
def test_allowed(sql: str, normalized: str | None) -> None:
    assert check_read_only(sql) == (normalized if normalized is not None else sql.strip())


@pytest.mark.parametrize(("sql", "reason"), REFUSED)
def test_refused_with_a_one_line_reason(sql: str, reason: str) -> None:
    with pytest.raises(ReadOnlyQueryError) as caught:
        check_read_only(sql)
    message = str(caught.value)
    assert reason in message
    assert "\n" not in message


def sql_string(text: str) -> str:
    """`text` as a ClickHouse string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


BASES = [
    "SELECT {lit} AS x",
    "SELECT count() FROM numbers(3) WHERE toString(number) != {lit}",
    "WITH {lit} AS x SELECT x",
    "INSERT INTO t VALUES ({lit})",
    "SELECT * FROM file({lit})",
    "SELECT {lit}; DROP TABLE t",
    "SELECT * FROM url({lit}, 'CSV')",
]


def verdict(sql: str) -> str:
    try:
        check_read_only(sql)
    except ReadOnlyQueryError as exc:
        return str(exc)
    return "allowed"


@given(text=st.text(), base=st.sampled_from(BASES))
def test_string_literal_content_never_changes_the_verdict(text: str, base: str) -> None:
    assert verdict(base.format(lit=sql_string(text))) == verdict(base.format(lit="'x'"))


@given(text=st.text(), base=st.sampled_from(BASES))
def test_comment_content_never_changes_the_verdict(text: str, base: str) -> None:
    line_comment = "-- " + text.replace("\n", " ").replace("\r", " ") + "\n"
    block_comment = "/* " + text.replace("/*", "/ *").replace("*/", "* /") + " */"
    plain = verdict(base.format(lit="'x'"))
    assert verdict(line_comment + base.format(lit="'x'")) == plain
    assert verdict(base.format(lit=block_comment + "'x'")) == plain


@given(st.text())
def test_arbitrary_text_is_either_allowed_or_refused_cleanly(sql: str) -> None:
    try:
        normalized = check_read_only(sql)
    except ReadOnlyQueryError as exc:
        assert "\n" not in str(exc)
    else:
        assert check_read_only(normalized) == normalized


COLUMN_NAMES = st.sampled_from(["table", "database", "name", "engine", "`table`", "select", "x"])


@given(
    column=COLUMN_NAMES,
    operator=st.sampled_from(["IN", "NOT IN", "GLOBAL IN", "in", "not in"]),
    values=st.lists(st.text(), min_size=1, max_size=4),
)
def test_in_after_an_expression_is_an_operator(column: str, operator: str, values: list[str]) -> None:
    """`x IN (...)` is never a table function, whatever the column is called (`table` looked like a keyword)."""
    listed = ", ".join(sql_string(v) for v in values)
    assert verdict(f"SELECT {column} FROM system.tables WHERE {column} {operator} ({listed})") == "allowed"
    denied = f"SELECT {column} FROM system.tables WHERE {column} {operator} (SELECT * FROM url({listed}))"
    assert "url() is refused" in verdict(denied)


def test_split_statements_ignores_semicolons_in_literals_and_comments() -> None:
    script = "CREATE TABLE a (x String COMMENT 'a;b');\n-- c;d\nCREATE VIEW v AS SELECT ';' /* ; */ ;\n;\n"
    assert split_statements(script) == ["CREATE TABLE a (x String COMMENT 'a;b')", "CREATE VIEW v AS SELECT ';'"]
    with pytest.raises(SqlLexError):
        tokenize("SELECT 'open")


# --- against chDB ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guard_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """This module's chDB path with a table `t` in database `guard`, kept open for the module."""
    settings = Settings(home=tmp_path_factory.mktemp("guard-home"))
    with ClickHouseStore.open(settings, database="guard") as anchor:
        anchor.command_sync("CREATE TABLE IF NOT EXISTS t (x Int64) ENGINE = MergeTree ORDER BY x")
        yield settings


@pytest.fixture
def store(guard_settings: Settings) -> Iterator[ClickHouseStore]:
    """A fresh store (its own chDB session) per test, so no test inherits another's session state."""
    with ClickHouseStore.open(guard_settings, database="guard") as opened:
        yield opened


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(exclude_characters="\x00", exclude_categories=("Cs",))))
def test_the_guard_reads_string_literals_as_chdb_does(store: ClickHouseStore, text: str) -> None:
    sql = f"SELECT {sql_string(text)} AS x"
    tokens = [t for t in tokenize(check_read_only(sql)) if t.significant]
    assert [t.kind for t in tokens].count(TokenKind.STRING) == 1
    assert store.read_only_query_sync(sql).result_rows == [(text,)]


@pytest.mark.parametrize(("sql", "normalized"), ALLOWED)
def test_allowed_queries_run_in_the_read_only_session(store: ClickHouseStore, sql: str, normalized: str | None) -> None:
    store.read_only_query_sync(sql)


async def test_the_store_guards_users_sql_and_keeps_the_writer_writable(store: ClickHouseStore) -> None:
    with pytest.raises(ReadOnlyQueryError, match="INSERT is refused"):
        await store.read_only_query("INSERT INTO t VALUES (1)")
    with pytest.raises(ReadOnlyQueryError, match="file"):
        store.read_only_query_sync("SELECT * FROM file('/etc/hostname', 'LineAsString')")
    assert (await store.read_only_query("SELECT getSetting('readonly')")).result_rows == [(1,)]
    assert (await store.query("SELECT getSetting('readonly')")).result_rows == [(0,)]
    await store.command("INSERT INTO t VALUES (7)")
    assert (await store.read_only_query("SELECT count() FROM t WHERE x = 7")).result_rows[0][0] >= 1


@pytest.mark.parametrize(
    "sql",
    [
        "INSERT INTO t VALUES (1)",
        "CREATE TABLE t2 (x Int32) ENGINE = Memory",
        "DROP TABLE t",
        "SELECT * FROM file('/etc/hostname', 'LineAsString')",
        "SELECT * FROM format(JSONEachRow, '{\"a\": 1}')",
        "SELECT * FROM file('/etc/hostname', 'LineAsString') SETTINGS readonly = 0",
    ],
)
def test_read_only_settings_refuse_on_their_own(store: ClickHouseStore, sql: str) -> None:
    """Defense in depth: had the guard let these through, chDB itself would refuse them."""
    with pytest.raises(Exception, match="readonly"):
        store.query_sync(sql, settings=read_only_settings())


def test_into_outfile_would_write_a_file(store: ClickHouseStore, tmp_path: Path) -> None:
    """Why INTO OUTFILE is refused: chDB writes the file even for a SELECT."""
    target = tmp_path / "out.tsv"
    store.query_sync(f"SELECT 1 INTO OUTFILE '{target}'")
    assert target.exists()


def test_every_chdb_table_function_is_classified(store: ClickHouseStore) -> None:
    """A chDB upgrade that adds a table function must decide here whether treadle sql may call it."""
    names = {name.casefold() for (name,) in store.query_sync("SELECT name FROM system.table_functions").result_rows}
    unclassified = names - SAFE_TABLE_FUNCTIONS - DENIED_FUNCTIONS - {"format"}
    assert not unclassified
    assert not SAFE_TABLE_FUNCTIONS & DENIED_FUNCTIONS
