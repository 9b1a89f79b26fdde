"""DecodedRows: the step processor's parsed-state cache between batches (pure logic)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from streams.runtime.decoded_rows import DecodedRows


def test_a_written_value_is_returned_in_the_same_generation_only():
    rows: DecodedRows[str] = DecodedRows(capacity=10)
    rows.wrote(b"a", "A", generation=3)
    assert rows.get(b"a", 3) == "A"
    assert rows.get(b"a", 4) is None, "a rebalance: the table is the truth again"
    assert rows.get(b"a", 3) is None, "and what was kept before it is gone"


def test_forget_drops_a_value_the_caller_may_have_changed_without_writing():
    rows: DecodedRows[str] = DecodedRows(capacity=10)
    rows.wrote(b"a", "A", 1)
    rows.forget(b"a")
    assert rows.get(b"a", 1) is None


@given(st.lists(st.integers(0, 30), max_size=200), st.integers(1, 8))
def test_keeps_the_most_recently_written_keys_up_to_capacity(keys, capacity):
    rows: DecodedRows[int] = DecodedRows(capacity)
    for k in keys:
        rows.wrote(str(k).encode(), k, 0)
    recent: list[int] = []
    for k in reversed(keys):
        if k not in recent:
            recent.append(k)
    kept = recent[:capacity]
    assert {k for k in set(keys) if rows.get(str(k).encode(), 0) is not None} == set(kept)
    assert all(rows.get(str(k).encode(), 0) == k for k in kept)
