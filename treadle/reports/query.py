"""How the reports read ClickHouse: any callable that runs one read-only statement and answers (columns, rows).

The CLI passes `sinks.sql_client.run_sql` bound to its settings; tests pass the same against their deployment.
Reports take the callable rather than settings so one report can run over the endpoint, chDB or a server alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Rows = tuple[list[str], list[list[Any]]]
Query = Callable[..., Rows]


def as_dicts(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[dict[str, Any]]:
    """Rows as column name -> value."""
    return [dict(zip(columns, row, strict=True)) for row in rows]


def query_dicts(query: Query, sql: str, **kwargs: Any) -> list[dict[str, Any]]:
    """`query(sql, **kwargs)` with its rows as dicts (kwargs: e.g. `params` for `{name:Type}` placeholders)."""
    return as_dicts(*query(sql, **kwargs))
