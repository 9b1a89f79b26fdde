"""treadle_native's uuid7 (native/src/ids.rs) against topics.ids.uuid7_py, the reference: same layout (48-bit Unix
milliseconds, version 7, variant 10, the rest random), unique, and a forked child never repeats its parent's ids.
Like the native codec's tests, these fail, not skip, where the native module is missing."""

from __future__ import annotations

import os
import uuid

import treadle_native
from hypothesis import given
from hypothesis import strategies as st

from topics import ids

TWINS = (treadle_native.uuid7, ids.uuid7_py)


def test_uuid7_is_the_native_one_when_enabled() -> None:
    assert ids.uuid7 is treadle_native.uuid7


@given(st.integers(min_value=0, max_value=2**48 - 1))
def test_same_layout_for_any_millisecond(unix_ms: int) -> None:
    native, python = (make(unix_ms) for make in TWINS)
    assert native[:15] == python[:15]  # tttttttt-tttt-7: the time and the version
    for text in (native, python):
        parsed = uuid.UUID(text)
        assert str(parsed) == text  # lower-case hex, dashes where uuid puts them
        assert parsed.version == 7 and parsed.variant == uuid.RFC_4122
        assert int(parsed.hex[:12], 16) == unix_ms


def test_now_and_unique() -> None:
    for make in TWINS:
        before = uuid.UUID(make()).int >> 80
        made = [make() for _ in range(20_000)]
        assert len(set(made)) == len(made)
        assert before <= uuid.UUID(made[-1]).int >> 80 <= before + 60_000  # milliseconds from now, not garbage


def test_forked_child_does_not_repeat_the_parent() -> None:
    ids.uuid7()  # the parent holds a block of random bytes the child inherits
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, through the pipe
        os.close(read)
        os.write(write, "\n".join(ids.uuid7(0) for _ in range(50)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = set(pipe.read().split("\n"))
    os.waitpid(pid, 0)
    parent = {ids.uuid7(0) for _ in range(50)}
    assert len(child) == 50 and not child & parent
