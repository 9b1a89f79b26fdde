"""Table writes held back until the offset commit, so a key changed by many batches is written once.

A step's events reach the worker over several batches, and writing its state after each one cost a RocksDB put,
an orjson dump and a ~2.7 KB changelog record every time: the bulk of what a worker sent to Kafka. Kafka Streams
caches its stores the same way (`statestore.cache.max.bytes`, flushed on commit). Here a processor marks a changed
value, reads its own unwritten values first, and writes them all out before Faust commits input offsets
(`ResumingApp.before_commit`), or earlier when `capacity` values are waiting.

Why this loses nothing: an input offset is committed only after the write-out that covers it, and a worker that
dies before then is replayed from the last commit (the fold is idempotent). The app also writes out when a
rebalance revokes partitions and when the consumer stops, before Faust lets go of the tables: no value is held
across a rebalance. One that belongs to a partition this worker no longer owns is dropped by its processor, not
written: Faust never commits a revoked partition's offsets, so the new owner replays its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class Unwritten(Generic[T]):
    key: bytes
    partition: int
    value: T


class WriteBehind(Generic[T]):
    """Values changed since the last write-out, by key; the newest mark of a key wins."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._values: dict[bytes, Unwritten[T]] = {}

    def mark(self, key: bytes, partition: int, value: T) -> None:
        self._values[key] = Unwritten(key, partition, value)

    def get(self, key: bytes) -> T | None:
        unwritten = self._values.get(key)
        return unwritten.value if unwritten is not None else None

    def discard(self, key: bytes) -> None:
        """The key is deleted (or written) some other way: do not write this value out."""
        self._values.pop(key, None)

    def full(self) -> bool:
        return len(self._values) >= self.capacity

    def take(self) -> list[Unwritten[T]]:
        """Everything to write out now, in the order keys were first marked; empties it."""
        values = list(self._values.values())
        self._values.clear()
        return values

    def __len__(self) -> int:
        return len(self._values)
