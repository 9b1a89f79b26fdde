"""WriteBehind: table writes held back until the offset commit (pure logic; the pipeline tests cover the commit)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from streams.runtime.write_behind import WriteBehind


def test_a_marked_value_is_read_back_and_written_out_once():
    unwritten: WriteBehind[str] = WriteBehind(capacity=10)
    unwritten.mark(b"a", 2, "A1")
    unwritten.mark(b"a", 2, "A2")  # changed again before the commit: one write, the newest value
    unwritten.mark(b"b", 0, "B")
    assert unwritten.get(b"a") == "A2"
    assert [(u.key, u.partition, u.value) for u in unwritten.take()] == [(b"a", 2, "A2"), (b"b", 0, "B")]
    assert unwritten.take() == [] and unwritten.get(b"a") is None


def test_a_discarded_key_is_not_written_out():
    unwritten: WriteBehind[str] = WriteBehind(capacity=10)
    unwritten.mark(b"a", 0, "A")
    unwritten.discard(b"a")
    assert unwritten.get(b"a") is None and unwritten.take() == []


@given(st.lists(st.integers(0, 20), max_size=100), st.integers(1, 10))
def test_full_counts_distinct_keys_and_take_returns_each_newest_value(keys, capacity):
    unwritten: WriteBehind[tuple[int, int]] = WriteBehind(capacity)
    for i, k in enumerate(keys):
        unwritten.mark(str(k).encode(), k % 4, (k, i))
    assert len(unwritten) == len(set(keys)) and unwritten.full() == (len(set(keys)) >= capacity)
    newest = {k: (k, i) for i, k in enumerate(keys)}
    assert {u.key: u.value for u in unwritten.take()} == {str(k).encode(): v for k, v in newest.items()}
