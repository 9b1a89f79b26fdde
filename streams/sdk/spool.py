"""An on-disk queue of encoded events, bounded in bytes: where the SDK puts events while the brokers are unreachable.

Events are appended to segment files as length-prefixed frames (topic, key, value, CRC-32) and read back oldest
segment first, so they leave in the order they came in. A segment is deleted only after every event in it was
acknowledged (`Spool.drop`); a process that dies before that leaves it on disk, and the next `Spool` opened on the
directory hands it out again: at-least-once, the duplicates carry their event_id. Each write goes to the operating
system at once (no user-space buffer), so a killed process loses nothing; a machine crash may lose the last writes
(no fsync per event: it would cost milliseconds each).

One process owns a spool directory at a time (an flock on its LOCK file); `Spool.claim` takes the first free one of
a family, so a restarted agent finds its predecessor's spool. No Kafka here: the emitter sends what it reads.
"""

from __future__ import annotations

import fcntl
import os
import struct
import zlib
from pathlib import Path

from streams.sdk.types import StreamError

__all__ = ["Spool", "SpoolFullError", "SpooledEvent"]

_FRAME = struct.Struct(">IHI")  # body length, topic length, key length; then topic, key, value, CRC-32 of them
_CRC = struct.Struct(">I")
SEGMENT_BYTES = 4 * 1024 * 1024  # a segment is sent, acknowledged and deleted as one unit

SpooledEvent = tuple[str, bytes, bytes]  # (topic, key, value)


class SpoolFullError(StreamError):
    """The spool holds its maximum; the event was not written."""


class Spool:
    """Segments `<n>.seg` in one directory; append to the newest, read and drop the oldest."""

    def __init__(self, directory: Path, max_bytes: int, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        directory.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock)
            raise
        self._sizes: dict[int, int] = {}  # segment number -> bytes, oldest first
        self._counts: dict[int, int] = {}  # segment number -> events
        for path in sorted(directory.glob("*.seg"), key=lambda p: int(p.stem)):
            events = _read_segment(path)
            if events:
                self._sizes[int(path.stem)] = path.stat().st_size
                self._counts[int(path.stem)] = len(events)
            else:
                path.unlink()
        self._active: int | None = None  # the segment appended to, open in _fd
        self._fd = -1

    @classmethod
    def claim(cls, parent: Path, name: str, max_bytes: int) -> Spool:
        """The first spool `parent/name-<i>` no other process holds: a restarted process gets its predecessor's."""
        for i in range(1024):
            try:
                return cls(parent / f"{name}-{i}", max_bytes)
            except BlockingIOError:
                continue
        raise OSError(f"every spool directory {parent}/{name}-* is held by another process")

    @property
    def depth(self) -> int:
        """Events in the spool (written and not yet dropped)."""
        return sum(self._counts.values())

    @property
    def size_bytes(self) -> int:
        return sum(self._sizes.values())

    def __bool__(self) -> bool:
        return bool(self._counts)

    def append(self, topic: str, key: bytes, value: bytes, *, force: bool = False) -> None:
        """Write one event behind the others; SpoolFullError (nothing written) past max_bytes, unless `force`
        (events the producer had already accepted are never refused)."""
        name = topic.encode()
        body = b"".join((name, key, value))
        frame = b"".join((_FRAME.pack(len(body), len(name), len(key)), body, _CRC.pack(zlib.crc32(body))))
        if not force and self.size_bytes + len(frame) > self.max_bytes:
            raise SpoolFullError(
                f"the producer spool in {self.directory} holds {self.size_bytes:,} bytes; this event would pass "
                f"TREADLE_SPOOL_MAX_BYTES ({self.max_bytes:,})"
            )
        if self._active is None or self._sizes[self._active] + len(frame) > self.segment_bytes:
            self._open_segment()
        assert self._active is not None
        written = os.write(self._fd, frame)
        if written != len(frame):  # a full disk: drop the torn frame's bytes so the segment stays readable
            os.ftruncate(self._fd, self._sizes[self._active])
            raise OSError(f"the producer spool in {self.directory} could not write an event (disk full?)")
        self._sizes[self._active] += len(frame)
        self._counts[self._active] += 1

    def oldest(self) -> tuple[int, list[SpooledEvent]] | None:
        """The oldest segment's number and events, in order (the segment being appended to is closed first)."""
        if not self._counts:
            return None
        number = next(iter(self._counts))
        if number == self._active:
            self._close_active()
        return number, _read_segment(self.directory / f"{number}.seg")

    def drop(self, number: int) -> None:
        """Forget a segment whose events were all acknowledged."""
        if number == self._active:
            self._close_active()
        self._forget(number)

    def close(self) -> None:
        self._close_active()
        if self._lock >= 0:
            os.close(self._lock)  # releases the flock
            self._lock = -1

    def _open_segment(self) -> None:
        self._close_active()
        number = max(self._sizes, default=-1) + 1
        self._fd = os.open(self.directory / f"{number}.seg", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._active = number
        self._sizes[number] = 0
        self._counts[number] = 0

    def _close_active(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._active is not None and not self._counts.get(self._active):
            self._forget(self._active)
        self._active = None

    def _forget(self, number: int) -> None:
        (self.directory / f"{number}.seg").unlink(missing_ok=True)
        self._sizes.pop(number, None)
        self._counts.pop(number, None)


def _read_segment(path: Path) -> list[SpooledEvent]:
    """A segment's events; reading stops at a torn or corrupt frame (a write cut short by a crash)."""
    data = path.read_bytes()
    events: list[SpooledEvent] = []
    at = 0
    while at + _FRAME.size <= len(data):
        size, name_len, key_len = _FRAME.unpack_from(data, at)
        start, end = at + _FRAME.size, at + _FRAME.size + size
        if end + _CRC.size > len(data) or name_len + key_len > size:
            break
        body = data[start:end]
        if _CRC.unpack_from(data, end)[0] != zlib.crc32(body):
            break
        events.append((body[:name_len].decode(), body[name_len : name_len + key_len], body[name_len + key_len :]))
        at = end + _CRC.size
    return events
