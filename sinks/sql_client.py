"""Where `treadle sql` runs a query: through the sink that owns embedded chDB, or directly.

chDB allows one process per data path, so while a sink runs, a second process cannot open the
database even to read; the sink serves read-only SQL on 127.0.0.1 for exactly this.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import pyarrow as pa

from sinks.sql_auth import bearer
from sinks.sql_guard import ReadOnlyQueryError, check_read_only
from sinks.sql_params import bind_parameters
from streams.runtime.run_info import SinkRefusal, SqlEndpoint, WorkerInfo
from topics.settings import Settings


class QueryFailedError(Exception):
    """ClickHouse rejected the query (unknown table, syntax error...) or the worker did not answer."""


def run_sql(
    settings: Settings, query: str, timeout: float = 60.0, *, params: Mapping[str, Any] | None = None
) -> tuple[list[str], list[list[Any]]]:
    """(column names, rows) of one read-only statement; ReadOnlyQueryError for anything else.

    `params` fills `{name:Type}` placeholders with typed literals (sinks.sql_params.bind_parameters) before the
    guard reads the statement, so values people type never become SQL.
    """
    statement = check_read_only(query if params is None else bind_parameters(query, params))
    endpoint = SqlEndpoint.read(settings)
    if endpoint is not None and settings.embedded_clickhouse:
        return _via_endpoint(endpoint, statement, timeout, bearer(settings))
    worker = WorkerInfo.read(settings)
    if worker is not None and settings.embedded_clickhouse:
        # Opening chDB here would take the data path from the worker's sink, which is about to open it.
        raise _no_sink_yet(settings, worker)
    from sinks.clickhouse import ClickHouseStore

    with ClickHouseStore.open(settings) as store:
        try:
            result = store.read_only_query_sync(statement)
        except ReadOnlyQueryError:
            raise
        except Exception as exc:  # unknown table, syntax error...: ClickHouse's first line says which
            text = str(exc).strip()
            raise QueryFailedError(text.splitlines()[0] if text else type(exc).__name__) from None
    return list(result.column_names), [list(row) for row in result.result_rows]


def _no_sink_yet(settings: Settings, worker: WorkerInfo) -> QueryFailedError:
    """Why a running worker's sink does not answer: refused by its group (for good), or still starting."""
    refusal = SinkRefusal.read(settings)
    if refusal is not None:
        return QueryFailedError(f"worker pid {worker.pid} runs without a sink, so this database is not filled: "
                                f"its sink was {refusal.reason}; query where that sink runs")  # fmt: skip
    return QueryFailedError(f"worker pid {worker.pid} runs but its sink is not serving SQL yet; retry shortly")


ArrowRunner = Callable[[str], pa.Table]
ArrowBatchRunner = Callable[[Sequence[str]], list[pa.Table]]  # statements in, one table each, same order


def run_sql_arrow(settings: Settings, query: str, timeout: float = 60.0) -> pa.Table:
    """One read-only statement as an Arrow table (LowCardinality columns as dictionaries)."""
    with arrow_queries(settings, timeout) as run:
        return run(query)


@contextmanager
def arrow_queries(settings: Settings, timeout: float = 60.0) -> Iterator[ArrowRunner]:
    """A function running read-only statements as Arrow tables, through one connection for all of them."""
    with arrow_batches(settings, timeout) as run_many:
        yield lambda query: run_many([query])[0]


@contextmanager
def arrow_batches(settings: Settings, timeout: float = 60.0) -> Iterator[ArrowBatchRunner]:
    """A function running lists of read-only statements as Arrow tables, two at a time, in one round trip.

    Through the sink's `/arrow` endpoint while it owns embedded chDB; otherwise on a store opened once here
    (opening chDB per statement would cost more than the statements).
    """
    endpoint = SqlEndpoint.read(settings)
    if endpoint is not None and settings.embedded_clickhouse:
        auth = bearer(settings)
        yield lambda queries: _arrow_via_endpoint(endpoint, [check_read_only(q) for q in queries], timeout, auth)
        return
    worker = WorkerInfo.read(settings)
    if worker is not None and settings.embedded_clickhouse:
        raise _no_sink_yet(settings, worker)
    from sinks.clickhouse import ClickHouseStore

    with ClickHouseStore.open(settings) as store:

        def run(queries: Sequence[str]) -> list[pa.Table]:
            try:
                return store.read_only_queries_arrow_sync(queries)
            except ReadOnlyQueryError:
                raise
            except Exception as exc:
                text = str(exc).strip()
                raise QueryFailedError(text.splitlines()[0] if text else type(exc).__name__) from None

        yield run


def _arrow_via_endpoint(
    info: SqlEndpoint, statements: list[str], timeout: float, auth: dict[str, str]
) -> list[pa.Table]:
    from sinks.clickhouse import arrow_table  # lazily, like ClickHouseStore: the CLI starts without it

    body = _post(info, "/arrow", {"sql": statements}, timeout, auth)
    tables, at = [], 0
    view = memoryview(body)
    while at < len(view):  # per statement: its stream's length (8 bytes, big-endian), then the stream
        size = int.from_bytes(view[at : at + 8], "big")
        tables.append(arrow_table(view[at + 8 : at + 8 + size]))
        at += 8 + size
    return tables


def _via_endpoint(
    info: SqlEndpoint, statement: str, timeout: float, auth: dict[str, str]
) -> tuple[list[str], list[list[Any]]]:
    body = json.loads(_post(info, "/sql", {"sql": statement}, timeout, auth))
    return body["columns"], body["rows"]


def post_json(
    info: SqlEndpoint, path: str, payload: dict[str, Any], timeout: float, auth: dict[str, str] | None = None
) -> bytes:
    """POST JSON to the sink's endpoint (with the token header `auth`, if any); its answer's body, or
    QueryFailedError with the sink's reason."""
    return _post(info, path, payload, timeout, auth or {})


def _post(info: SqlEndpoint, path: str, payload: dict[str, Any], timeout: float, auth: dict[str, str]) -> bytes:
    """POST JSON to the sink's endpoint (with the token header `auth`, if any); its answer's body, or
    QueryFailedError with the sink's reason."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{info.port}{path}",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", **auth},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        error = json.loads(exc.read() or b"{}")
        raise QueryFailedError(error.get("error", f"worker answered HTTP {exc.code}")) from None
    except (urllib.error.URLError, TimeoutError) as exc:
        raise QueryFailedError(
            f"sink pid {info.pid} holds the embedded ClickHouse but did not answer on port {info.port}: {exc}"
        ) from None
