"""Export filters as SQL: every user value is one escaped literal, and each filter lands where it should."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from sinks.export_sql import ExportFilters, Shape, page_end_sql, quote, shape_sql, step_conditions
from sinks.sql_guard import check_read_only
from sinks.sql_lexer import TokenKind, quoted_content, tokenize

HOSTILE = ["x'y", "a\\", "\\'; DROP TABLE transitions; --", "multi\nline", "naïve ✓", "' OR 1=1 --"]


def string_literals(sql: str) -> list[str]:
    """The values of the '…' literals as ClickHouse reads them (backslash escapes undone)."""
    return [re.sub(r"\\(.)", r"\1", quoted_content(t), flags=re.S) for t in tokenize(sql) if t.kind is TokenKind.STRING]


@pytest.mark.parametrize("value", HOSTILE)
def test_a_value_stays_one_literal_with_its_exact_text(value: str) -> None:
    assert string_literals(f"SELECT {quote(value)}") == [value]


@pytest.mark.parametrize("shape", list(Shape))
def test_hostile_filter_values_are_literals_in_every_shape_and_the_query_is_read_only(shape: Shape) -> None:
    filters = ExportFilters(policy_versions=tuple(HOSTILE), agents=("a'1",), sessions=("s\\1",), episodes=("e'",))
    sql = shape_sql(shape, filters, ("lo'", "hi\\"))
    literals = string_literals(sql)
    for value in (*HOSTILE, "a'1", "s\\1", "e'", "lo'", "hi\\"):
        assert value in literals, value
    assert check_read_only(sql)  # one statement, nothing but a SELECT
    assert "DROP" not in "".join(t.text for t in tokenize(sql) if t.kind is TokenKind.WORD).upper()


def test_each_filter_becomes_its_condition() -> None:
    since = datetime(2026, 11, 30, 8, 0, tzinfo=timezone(timedelta(hours=2)))
    filters = ExportFilters(
        since=since, until=datetime(2026, 12, 1), policy_versions=("v1", "v2"), agents=("a",), settled=True,
        statuses=("complete",), min_confidence=0.5,
    )  # fmt: skip
    assert step_conditions(filters, "t") == [
        "t.dispatched_at >= toDateTime64('2026-11-30 06:00:00.000000', 6, 'UTC')",
        "t.dispatched_at < toDateTime64('2026-12-01 00:00:00.000000', 6, 'UTC')",
        "t.policy_version IN ('v1', 'v2')",
        "t.agent_id IN ('a')",
        "t.reward_status != 'pending'",
        "t.reward_status IN ('complete')",
        "arrayAll(c -> c >= 0.5, t.reward_components.confidence)",
    ]
    assert filters.since == since.astimezone(UTC) and filters.until.tzinfo is UTC, "naive means UTC"


def test_no_filters_no_where_and_the_order_of_the_sort_key() -> None:
    sql = shape_sql(Shape.TRANSITIONS, ExportFilters())
    assert "WHERE" not in sql and sql.endswith("ORDER BY session_id, step, logical_event_id")


def test_trajectories_apply_quality_filters_to_whole_episodes_and_time_to_their_start() -> None:
    since = datetime(2026, 1, 1, tzinfo=UTC)
    sql = shape_sql(Shape.TRAJECTORIES, ExportFilters(since=since, settled=True, policy_versions=("v1",)))
    assert "countIf(NOT (t.reward_status != 'pending')) = 0" in sql
    assert "min(t.dispatched_at) >= toDateTime64('2026-01-01 00:00:00.000000', 6, 'UTC')" in sql
    assert "WHERE t.policy_version IN ('v1')" in sql and "t.dispatched_at >=" not in sql


def test_pages_are_session_ranges() -> None:
    sql = shape_sql(Shape.TRIPLETS, ExportFilters(), ("s-1", "s-9"))
    assert "c.session_id > 's-1' AND c.session_id <= 's-9'" in sql
    assert "t.session_id > 's-1' AND t.session_id <= 's-9'" in sql
    assert page_end_sql(Shape.TRIPLETS, None, 100) == (
        "SELECT session_id FROM llm_calls  ORDER BY session_id LIMIT 1 OFFSET 100"
    )
    assert string_literals(page_end_sql(Shape.TRANSITIONS, "a'b", 5)) == ["a'b"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"statuses": ("done",)}, "unknown reward status 'done'"),
        ({"min_confidence": 1.5}, "min_confidence must be in [0, 1]"),
        ({"min_confidence": float("nan")}, "min_confidence must be in [0, 1]"),
        ({"colour": "red"}, "Extra inputs are not permitted"),
    ],
)
def test_bad_filters_are_refused_with_a_reason(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ExportFilters(**fields)


@pytest.mark.parametrize("shape", list(Shape))
def test_a_variant_reads_its_rows_from_the_variants_view_and_live_reads_as_before(shape: Shape) -> None:
    live = shape_sql(shape, ExportFilters())
    assert "transitions_variants" not in live and "variant" not in live
    assert live == shape_sql(shape, ExportFilters(variant="live"))
    sql = shape_sql(shape, ExportFilters(variant="judge-x3'"))
    assert "transitions_latest" not in sql and "FROM transitions_variants AS t" in sql
    assert "t.variant = 'judge-x3\\''" in sql and "judge-x3'" in string_literals(sql)
    assert check_read_only(sql)
