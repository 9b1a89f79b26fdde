"""Decoded table values of recently written keys, so state folded over several batches is parsed once.

A step's events arrive over many batches; reading its table row back and parsing it each time cost about
a sixth of a batch. Only values this worker wrote are kept, and only for one consumer generation: after a
rebalance a partition may have been another worker's for a while, so the table is the truth again.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

T = TypeVar("T")


class DecodedRows(Generic[T]):
    """Up to `capacity` decoded values by key, oldest written first out; cleared when the generation changes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # OrderedDict, not dict: evicting a plain dict's oldest key with next(iter(d)) walks the slots of every key
        # deleted before it, which grew to ~3% of a worker's CPU.
        self._values: OrderedDict[bytes, T] = OrderedDict()
        self._generation: int | None = None

    def get(self, key: bytes, generation: int) -> T | None:
        return self._of(generation).get(key)

    def wrote(self, key: bytes, value: T, generation: int) -> None:
        """`value` is what the table now holds for `key` (the caller must not change it without writing)."""
        self._of(generation)
        self._values[key] = value
        self._values.move_to_end(key)  # the order is the eviction order
        if len(self._values) > self.capacity:
            self._values.popitem(last=False)

    def forget(self, key: bytes) -> None:
        self._values.pop(key, None)

    def _of(self, generation: int) -> OrderedDict[bytes, T]:
        if generation != self._generation:
            self._values.clear()
            self._generation = generation
        return self._values
