"""Identifiers: UUIDv7 for new events (time-ordered, so ClickHouse sorts them well)."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable

from topics import native_codec

_VARIANT = {c: "89ab"[int(c, 16) & 3] for c in "0123456789abcdef"}  # a random hex digit -> variant 10xx
_last_ms: tuple[int, str] = (-1, "")  # (unix ms, its "tttttttt-tttt-7" prefix): many ids share a millisecond
# 20 random hex digits per id, read from os.urandom 128 ids at a time (one system call instead of one per id).
# deque.pop is atomic, so threads never share one; a forked child drops the parent's, so processes never do.
_RANDOM: deque[str] = deque()
_REFILL_IDS = 128
os.register_at_fork(after_in_child=_RANDOM.clear)


def _refill() -> str:
    digits = os.urandom(10 * _REFILL_IDS).hex()
    _RANDOM.extend(digits[i : i + 20] for i in range(20, len(digits), 20))
    return digits[:20]


def uuid7_py(unix_ms: int | None = None) -> str:
    """A UUIDv7 (RFC 9562): 48-bit Unix milliseconds, version 7, 74 random bits from os.urandom
    (read in blocks). The reference for treadle_native's `uuid7`, and what `uuid7` is without it.

    Built as text from hex slices, not via int or uuid.UUID: about half the cost, on the SDK's hot path.
    """
    global _last_ms
    ms = time.time_ns() // 1_000_000 if unix_ms is None else unix_ms
    last, prefix = _last_ms
    if ms != last:
        t = f"{ms & 0xFFFFFFFFFFFF:012x}"
        prefix = f"{t[:8]}-{t[8:]}-7"
        _last_ms = (ms, prefix)
    try:
        r = _RANDOM.pop()  # 20 hex digits: 3 + 2 bits of r[4] + 3 + 12 of them are used
    except IndexError:
        r = _refill()
    return f"{prefix}{r[1:4]}-{_VARIANT[r[4]]}{r[5:8]}-{r[8:]}"


def _native_uuid7() -> Callable[..., str] | None:
    """treadle_native's uuid7 (same layout, a fraction of the CPU: the SDK makes one per event) when the native
    module is enabled (TREADLE_NATIVE) and has it."""
    if not native_codec.enabled() or not hasattr(native_codec.treadle_native, "uuid7_forget"):
        return None
    os.register_at_fork(after_in_child=native_codec.treadle_native.uuid7_forget)  # the parent's random bytes
    return native_codec.treadle_native.uuid7  # type: ignore[no-any-return]


uuid7: Callable[..., str] = _native_uuid7() or uuid7_py  # (unix_ms: int | None = None) -> str


_VARIANT = {f"{n:x}": f"{0x8 | (n & 0x3):x}" for n in range(16)}  # a hex digit -> the RFC 4122 variant 10xx


def uuid5_text(sha1_hex: str) -> str:
    """str(uuid.UUID(bytes=sha1[:16], version=5)) from the SHA-1 hexdigest of namespace + name, without the UUID
    object: a few times cheaper, for ids made per reward signal or contract check."""
    h = sha1_hex
    return f"{h[:8]}-{h[8:12]}-5{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:32]}"


def now_micros() -> int:
    return time.time_ns() // 1000
