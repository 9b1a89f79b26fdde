"""Connecting to ClickHouse (embedded chDB or a server) and owning the connection safely.

chDB runs ClickHouse inside this process: one process per data path, one data path per process, and its
client must not be called from two threads at once. `ClickHouseStore` therefore owns the client together with
a single worker thread and runs every call there, so an asyncio worker never blocks its event loop and a
client is never called from two threads; the CLI gets the same calls synchronously. The one exception is a
read pair (`read_only_queries_arrow`): while the store's thread waits, a second read-only session on a
thread of its own runs some of the statements, so two reads use both cores; no write runs meanwhile.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

import clickhouse_connect
import pyarrow as pa
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.query import QueryResult

from sinks.chdb_insert import insert_from_memory
from sinks.sql_guard import check_read_only, read_only_settings
from topics.settings import Settings

DEFAULT_DATABASE = "treadle"
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
T = TypeVar("T")
# Read-only sessions send Arrow results with LowCardinality columns as dictionaries: no per-row string copies
# (about 5 ms per 100,000-row column on chDB), and pyarrow keeps them as DictionaryArrays. Uncompressed: the
# default (lz4_frame) costs more than it saves when the bytes stay on this machine (measured on chDB at 100,000
# nodes: the nodes of "state at V" 28 -> 19 ms, the edges 20 -> 14 ms, for 3x the bytes; bench/state_bench.py).
ARROW_OUTPUT_SETTINGS = {
    "output_format_arrow_low_cardinality_as_dictionary": 1,
    "output_format_arrow_compression_method": "none",
}


def arrow_table(stream: bytes | memoryview) -> pa.Table:
    """An Arrow IPC stream (ClickHouse's ArrowStream format) as a table."""
    return pa.ipc.open_stream(pa.py_buffer(stream)).read_all()


class ClickHouseUnavailableError(RuntimeError):
    """ClickHouse cannot be opened or reached; the message is one line that says why and what to do."""


def database_name(settings: Settings) -> str:
    """The database treadle's tables live in: the path of CLICKHOUSE_URL (http://host:8123/db) or 'treadle'."""
    if settings.clickhouse_url:
        path = urlsplit(settings.clickhouse_url).path.strip("/")
        if path:
            return checked_identifier(path)
    return DEFAULT_DATABASE


def checked_identifier(name: str) -> str:
    """`name` if it is a plain ClickHouse identifier, safe to put into SQL unquoted."""
    if not _IDENTIFIER.match(name):
        raise ValueError(f"{name!r} is not a plain identifier (letters, digits and _, not starting with a digit)")
    return name


def open_client(settings: Settings) -> Client:
    """A clickhouse-connect client: chDB at settings.chdb_path, or the server at settings.clickhouse_url.

    Raises ClickHouseUnavailableError with a readable one-line reason when it cannot be opened.
    """
    if settings.clickhouse_url is None:
        return _open_chdb(settings.chdb_path)
    return _open_server(settings.clickhouse_url)


def _open_chdb(path: Path) -> Client:
    path = path.resolve()
    path.mkdir(parents=True, exist_ok=True)
    try:
        return clickhouse_connect.get_client(dsn=f"chdb:///{path}")
    except Exception as exc:
        raise ClickHouseUnavailableError(_explain_chdb_failure(path, exc)) from exc


def _explain_chdb_failure(path: Path, exc: Exception) -> str:
    text = " ".join(str(exc).split())
    other = re.search(r"already initialized with path '([^']*)'", text)
    if other:
        return (
            f"cannot open chDB at {path}: this process already has chDB open at {other.group(1)}, "
            "and chDB allows one data path per process"
        )
    if "EmbeddedServer" in text or "Cannot lock file" in text:
        explained = _explain_locked_path(path)
        if explained:
            return explained
        return (
            f"cannot open chDB at {path}: it is probably held by another process (such as a running "
            "`treadle worker`); chDB allows one process per data path, so stop it or query through it with "
            "`treadle sql`"
        )
    return f"cannot open chDB at {path}: {text}"


def _explain_locked_path(path: Path) -> str | None:
    try:
        from sinks.chdb_lock import explain_locked_path
    except ImportError:
        return None
    try:
        return explain_locked_path(path)
    except Exception:  # an explanation is a courtesy; never hide the original failure behind a new one
        return None


def _open_server(url: str) -> Client:
    parts = urlsplit(url)
    shown = _without_password(url)
    try:
        # The database is chosen after connecting (it may not exist yet), so the DSN carries none.
        return clickhouse_connect.get_client(dsn=urlunsplit(parts._replace(path="")))
    except Exception as exc:
        reason = " ".join(str(exc).split())
        raise ClickHouseUnavailableError(f"cannot reach ClickHouse at {shown}: {reason}") from exc


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def ensure_database(client: Client, database: str) -> None:
    """Create `database` if missing; checks first, since a server user may see it but lack CREATE rights."""
    checked_identifier(database)
    exists = client.query("SELECT count() FROM system.databases WHERE name = {db:String}", parameters={"db": database})
    if not exists.result_rows[0][0]:
        client.command(f"CREATE DATABASE IF NOT EXISTS {database}")


class ClickHouseStore:
    """The one owner of a process's ClickHouse clients: every call runs on its single thread, in call order.

    Use `await store.insert(...)` / `await store.query(...)` from asyncio code and the `*_sync` twins from
    synchronous code (never from inside a running event loop: they wait). Queries resolve unqualified table
    names in `database`, which `open` creates when missing. Keep one store per process for a chDB path: two
    stores would have two threads entering chDB. Users' SQL goes through `read_only_query`, which runs on a
    second, read-only session. Opening blocks briefly: from asyncio code, open it with
    `await asyncio.to_thread(ClickHouseStore.open, settings)`.
    """

    def __init__(self, client_factory: Callable[[], Client], database: str = DEFAULT_DATABASE) -> None:
        self.database = checked_identifier(database)
        self._client_factory = client_factory
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-clickhouse")
        self._client: Client | None = None
        self._read_only_client: Client | None = None
        self._pair_executor: ThreadPoolExecutor | None = None  # the second read-only session's thread
        self._pair_client: Client | None = None
        try:
            self._client = self._executor.submit(self._connect, client_factory).result()
        except BaseException:
            self._executor.shutdown(wait=True)
            raise

    @classmethod
    def open(cls, settings: Settings, database: str | None = None) -> ClickHouseStore:
        """A store on chDB or the server named by `settings`; raises ClickHouseUnavailableError."""
        return cls(lambda: open_client(settings), database or database_name(settings))

    def _connect(self, client_factory: Callable[[], Client]) -> Client:
        client = client_factory()
        try:
            ensure_database(client, self.database)
            client.database = self.database
        except BaseException:
            client.close()
            raise
        return client

    @property
    def closed(self) -> bool:
        return self._client is None

    def _read_only(self) -> Client:
        """A second client, in readonly=1 for its whole session, opened on first use (store thread only).

        Users' SQL never runs on the writer's client: with chDB, per-query settings on an INSERT are applied
        with SET and restored after, and a restore cannot run in readonly mode, so the writer would be left
        read-only. A session that is read-only from the start has nothing to restore.
        """
        if self._read_only_client is None:
            self._read_only_client = self._open_read_only()
        return self._read_only_client

    def _open_read_only(self) -> Client:
        read_only = self._client_factory()
        try:
            read_only.database = self.database
            for name, value in ARROW_OUTPUT_SETTINGS.items():  # before readonly, which forbids changing them
                read_only.set_client_setting(name, str(value))
            for name, value in read_only_settings().items():
                read_only.set_client_setting(name, str(value))
        except BaseException:
            read_only.close()
            raise
        return read_only

    def _read_in_pair(self, statements: list[str]) -> list[bytes]:
        """Run checked statements on two read-only sessions at once (store thread only; see read_only_queries_arrow).

        The store's thread is held until both are done, so the pair never overlaps a write: at most two
        read-only sessions of this process are inside chDB together (its Python binding releases the GIL, and
        clients on one path share the engine; each keeps its own session settings, set once, never per query).
        Concurrent queries on separate handles are safe since chDB 4.0 (chdb-io/chdb-core#130).

        Each answer is chDB's own Arrow IPC stream (format ArrowStream): about half the bytes of the same table
        written again by pyarrow, and no pa.Table built here when the bytes only pass through (the sink's /arrow).
        """
        queue = deque(enumerate(statements))
        results: list[bytes | None] = [None] * len(statements)

        def drain(client: Client) -> None:
            while True:
                try:
                    i, sql = queue.popleft()  # atomic: each statement runs once, on whichever session is free
                except IndexError:
                    return
                results[i] = client.raw_query(sql, fmt="ArrowStream")

        if len(statements) < 2:
            drain(self._read_only())
            return cast(list[bytes], results)
        if self._pair_executor is None:
            self._pair_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-clickhouse-read")

        def drain_second() -> None:
            if self._pair_client is None:
                self._pair_client = self._open_read_only()
            drain(self._pair_client)

        second = self._pair_executor.submit(drain_second)
        try:
            drain(self._read_only())
        finally:
            wait([second])  # never leave a read running when this thread moves on
        second.result()
        return cast(list[bytes], results)

    def _submit(self, fn: Callable[[Client], T]) -> Future[T]:
        """Queue fn(client) on the store's thread."""

        def call() -> T:
            if self._client is None:
                raise ClickHouseUnavailableError("the ClickHouse store is closed")
            return fn(self._client)

        try:
            return self._executor.submit(call)
        except RuntimeError:  # the executor was shut down by close()
            raise ClickHouseUnavailableError("the ClickHouse store is closed") from None

    # --- asyncio ---------------------------------------------------------------------------------------------

    async def call(self, fn: Callable[[Client], T]) -> T:
        """Run fn(client) on the store's thread; for anything the methods below do not cover (e.g. migrations)."""
        return await asyncio.wrap_future(self._submit(fn))

    async def insert(
        self,
        table: str,
        data: Sequence[Sequence[Any]],
        column_names: Sequence[str],
        *,
        column_oriented: bool = False,
        settings: Mapping[str, Any] | None = None,
    ) -> int:
        """Insert rows (or columns, with column_oriented=True) into `table` of the store's database."""
        return await self.call(_inserter(table, data, column_names, column_oriented, settings, self.database))

    async def insert_avro(
        self,
        table: str,
        container: bytes,
        column_names: Sequence[str],
        settings: Mapping[str, Any] | None = None,
    ) -> int:
        """Insert an Avro object container file (FORMAT Avro; fields matched to `column_names` by name) into `table`."""
        return await self.insert_formatted(table, container, column_names, "Avro", settings)

    async def insert_formatted(
        self,
        table: str,
        data: bytes | bytearray,
        column_names: Sequence[str],
        fmt: str,
        settings: Mapping[str, Any] | None = None,
    ) -> int:
        """Insert `data`, already in ClickHouse input format `fmt` (Avro, Native...), into `table`.

        On chDB the bytes go in from memory (sinks.chdb_insert), not through the temporary file of raw_insert."""

        def insert(client: Client) -> int:
            names = list(column_names)
            target = f"{self.database}.{checked_identifier(table)}"
            chosen = dict(settings) if settings else None
            written = insert_from_memory(client, target, names, data, fmt, chosen)
            if written is not None:
                return written
            return client.raw_insert(target, names, insert_block=data, fmt=fmt, settings=chosen).written_rows

        return await self.call(insert)

    async def query(
        self, sql: str, parameters: Mapping[str, Any] | None = None, settings: Mapping[str, Any] | None = None
    ) -> QueryResult:
        return await self.call(lambda client: client.query(sql, parameters=parameters, settings=settings))

    async def command(self, sql: str, settings: Mapping[str, Any] | None = None) -> Any:
        return await self.call(lambda client: client.command(sql, settings=settings))

    async def read_only_query(self, sql: str) -> QueryResult:
        """Users' SQL (`treadle sql`): checked by sinks.sql_guard, then run in a read-only session.

        Raises ReadOnlyQueryError for anything but one read-only statement.
        """
        checked = check_read_only(sql)
        return await self.call(lambda _writer: self._read_only().query(checked))

    async def read_only_queries_arrow(self, statements: Sequence[str]) -> list[pa.Table]:
        """Several read-only statements as Arrow tables, run two at a time (one state_at's nodes and edges)."""
        return [arrow_table(stream) for stream in await self.read_only_queries_arrow_streams(statements)]

    async def read_only_queries_arrow_streams(self, statements: Sequence[str]) -> list[bytes]:
        """read_only_queries_arrow as chDB's Arrow IPC streams, unparsed (to pass on as they are)."""
        checked = [check_read_only(sql) for sql in statements]
        return await self.call(lambda _writer: self._read_in_pair(checked))

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    async def __aenter__(self) -> ClickHouseStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- synchronous twins (CLI) ---------------------------------------------------------------------------------

    def call_sync(self, fn: Callable[[Client], T]) -> T:
        return self._submit(fn).result()

    def insert_sync(
        self,
        table: str,
        data: Sequence[Sequence[Any]],
        column_names: Sequence[str],
        *,
        column_oriented: bool = False,
        settings: Mapping[str, Any] | None = None,
    ) -> int:
        return self.call_sync(_inserter(table, data, column_names, column_oriented, settings, self.database))

    def query_sync(
        self, sql: str, parameters: Mapping[str, Any] | None = None, settings: Mapping[str, Any] | None = None
    ) -> QueryResult:
        return self.call_sync(lambda client: client.query(sql, parameters=parameters, settings=settings))

    def command_sync(self, sql: str, settings: Mapping[str, Any] | None = None) -> Any:
        return self.call_sync(lambda client: client.command(sql, settings=settings))

    def read_only_query_sync(self, sql: str) -> QueryResult:
        checked = check_read_only(sql)
        return self.call_sync(lambda _writer: self._read_only().query(checked))

    def read_only_query_arrow_sync(self, sql: str) -> pa.Table:
        checked = check_read_only(sql)
        return self.call_sync(lambda _writer: self._read_only().query_arrow(checked))

    def read_only_queries_arrow_sync(self, statements: Sequence[str]) -> list[pa.Table]:
        checked = [check_read_only(sql) for sql in statements]
        return [arrow_table(stream) for stream in self.call_sync(lambda _writer: self._read_in_pair(checked))]

    def close(self) -> None:
        """Close the client on its own thread (releasing chDB's data path) and stop the thread; idempotent."""
        if self._client is None:
            return
        if self._pair_executor is not None:
            pair, self._pair_executor = self._pair_executor, None

            def close_pair() -> None:
                if self._pair_client is not None:
                    self._pair_client.close()
                    self._pair_client = None

            try:
                pair.submit(close_pair).result()
            finally:
                pair.shutdown(wait=True)

        def close_clients() -> None:
            clients = [self._read_only_client, self._client]
            self._client = self._read_only_client = None
            for client in clients:
                if client is not None:
                    client.close()

        try:
            self._executor.submit(close_clients).result()
        finally:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> ClickHouseStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _inserter(
    table: str,
    data: Sequence[Sequence[Any]],
    column_names: Sequence[str],
    column_oriented: bool,
    settings: Mapping[str, Any] | None,
    database: str,
) -> Callable[[Client], int]:
    def insert(client: Client) -> int:
        summary = client.insert(
            table,
            data,
            column_names=list(column_names),
            database=database,
            column_oriented=column_oriented,
            settings=dict(settings) if settings else None,
        )
        return summary.written_rows

    return insert
