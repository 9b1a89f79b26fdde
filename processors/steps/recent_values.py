"""The last reward values of each source a worker folded: what `rolling_mean` imputation averages.

A spec's `rolling_count` belongs to its policy version, and versions may differ: a step imputes the mean of the last
`rolling_count` values of its own spec, so each source keeps as many values as the largest count asked for so far
(a later version that asks for more grows it, from then on). The values are this worker's, in the order it folded
them: not replay-exact (docs/reward-weaving.md).
"""

from __future__ import annotations

from collections import deque
from itertools import islice


class RecentValues:
    """Per spec key (source/name), its latest values, newest last."""

    def __init__(self) -> None:
        self._values: dict[str, deque[float]] = {}

    def add(self, key: str, value: float, keep: int) -> None:
        """Remember `value`, keeping at least the last `keep` values of `key`."""
        values = self._values.get(key)
        if values is None or (values.maxlen or 0) < keep:
            values = self._values[key] = deque(values or (), maxlen=keep)
        values.append(value)

    def mean(self, key: str, count: int) -> float | None:
        """The mean of the last `count` values of `key` (all it has, if fewer); None when it has none."""
        values = self._values.get(key)
        if not values:
            return None
        last = list(islice(reversed(values), count))
        return sum(last) / len(last)
