"""A commit's versions split into version keys (TableGraphStore): every version once, in order, each key small."""

from __future__ import annotations

import orjson
from hypothesis import given
from hypothesis import strategies as st

from processors.state.store import _pieces


@given(st.lists(st.integers(min_value=0, max_value=3_000), min_size=1, max_size=60))
def test_pieces_keep_every_version_in_order_and_stay_under_the_limit(sizes: list[int]) -> None:
    chunk = [{"ordinal": i + 1, "data": "x" * size} for i, size in enumerate(sizes)]
    limit = 4_000
    pieces = _pieces(chunk, limit)
    assert [v for piece, _ in pieces for v in piece] == chunk
    for piece, value in pieces:
        assert orjson.loads(value) == piece
        assert len(value) <= limit + 2 or len(piece) == 1  # only a single large version goes over
