"""The producer spool (Spool): order, bounds, reopening after a restart, a torn last write, one owner per directory."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streams.sdk.spool import Spool, SpoolFullError

events = st.lists(
    st.tuples(st.sampled_from(["t.actions", "t.rewards", "ü-topic"]), st.binary(max_size=40), st.binary(max_size=300)),
    max_size=60,
)


def _drain(spool: Spool) -> list[tuple[str, bytes, bytes]]:
    out = []
    while (oldest := spool.oldest()) is not None:
        number, got = oldest
        out += got
        spool.drop(number)
    return out


@settings(max_examples=60, deadline=None)
@given(first=events, second=events, split=st.integers(0, 60))
def test_events_come_back_in_order_across_segments_and_a_restart(first: list, second: list, split: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spool = Spool(Path(tmp), max_bytes=1 << 20, segment_bytes=700)  # many segments
        for event in first:
            spool.append(*event)
        assert spool.depth == len(first)
        spool.close()  # the process ends with the spool non-empty

        reopened = Spool(Path(tmp), max_bytes=1 << 20, segment_bytes=700)
        assert reopened.depth == len(first)
        got = []
        for i, event in enumerate(second):  # new events go behind the old ones, also while they are being read
            reopened.append(*event)
            if i == split and (oldest := reopened.oldest()) is not None:
                got += oldest[1]
                reopened.drop(oldest[0])
        got += _drain(reopened)
        assert got == first + second
        assert reopened.depth == 0 and reopened.size_bytes == 0 and not reopened
        reopened.close()
        assert sorted(p.name for p in Path(tmp).iterdir()) == ["LOCK"]


def test_a_full_spool_refuses_and_writes_nothing(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1000)
    spool.append("t", b"k", b"x" * 400)
    spool.append("t", b"k", b"y" * 400)
    with pytest.raises(SpoolFullError, match="TREADLE_SPOOL_MAX_BYTES"):
        spool.append("t", b"k", b"z" * 400)
    assert spool.depth == 2
    spool.append("t", b"k", b"z" * 400, force=True)  # an event the producer had already accepted
    assert [v[:1] for _, _, v in _drain(spool)] == [b"x", b"y", b"z"]
    spool.append("t", b"k", b"w" * 400)  # room again once resent
    spool.close()


def test_a_torn_last_write_is_dropped_and_the_rest_kept(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    for i in range(3):
        spool.append("t", b"k", bytes([i]) * 50)
    spool.close()
    (segment,) = tmp_path.glob("*.seg")
    data = segment.read_bytes()
    segment.write_bytes(data[:-10])  # the process died in the middle of the third write
    reopened = Spool(tmp_path, max_bytes=1 << 20)
    assert [v for _, _, v in _drain(reopened)] == [bytes([0]) * 50, bytes([1]) * 50]
    reopened.close()


def test_one_process_per_spool_directory_and_claim_takes_the_next_free_one(tmp_path: Path) -> None:
    held = Spool.claim(tmp_path, "agent", 1 << 20)
    held.append("t", b"k", b"v")
    with pytest.raises(BlockingIOError):
        Spool(held.directory, 1 << 20)
    other = Spool.claim(tmp_path, "agent", 1 << 20)
    assert (held.directory.name, other.directory.name) == ("agent-0", "agent-1")
    assert other.depth == 0
    held.close()
    other.close()
    again = Spool.claim(tmp_path, "agent", 1 << 20)  # a restarted process finds the first one's events
    assert again.directory.name == "agent-0" and again.depth == 1
    again.close()
