"""Event-time watermarks per partition, across every co-partitioned input topic.

A partition's watermark is the event time up to which the worker assumes it has seen everything:
for each input topic of that partition, the largest event_time seen minus the bounded
out-of-orderness; the partition's watermark is the smallest of those (the slowest topic holds it
back, as in Flink). A topic that has been silent on the partition for `idle_timeout_s` of
processing time stops holding it back; when every topic is idle, the watermark advances with
processing time (now - idle timeout), so open steps close even when nothing arrives.
Watermarks never go back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _TopicClock:
    max_event_us: int
    last_seen_s: float  # processing time of the latest event


@dataclass
class _PartitionClock:
    topics: dict[str, _TopicClock] = field(default_factory=dict)
    watermark_us: int | None = None


class Watermarks:
    def __init__(
        self,
        out_of_orderness_s: float,
        idle_timeout_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.out_of_orderness_us = int(out_of_orderness_s * 1_000_000)
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self._partitions: dict[int, _PartitionClock] = {}

    def observe(self, partition: int, topic: str, event_time_us: int) -> None:
        clock = self._partitions.setdefault(partition, _PartitionClock())
        now = self.clock()
        seen = clock.topics.get(topic)
        if seen is None:
            clock.topics[topic] = _TopicClock(event_time_us, now)
        else:
            seen.max_event_us = max(seen.max_event_us, event_time_us)
            seen.last_seen_s = now

    def advance(self, partition: int) -> int | None:
        """Recompute and return the partition's watermark (None until it has seen an event or idled)."""
        clock = self._partitions.setdefault(partition, _PartitionClock())
        now = self.clock()
        active = [t for t in clock.topics.values() if now - t.last_seen_s < self.idle_timeout_s]
        if active:
            candidate = min(t.max_event_us for t in active) - self.out_of_orderness_us
        else:
            candidate = int((now - self.idle_timeout_s) * 1_000_000)
        if clock.watermark_us is None or candidate > clock.watermark_us:
            clock.watermark_us = candidate
        return clock.watermark_us

    def watermark(self, partition: int) -> int | None:
        clock = self._partitions.get(partition)
        return None if clock is None else clock.watermark_us

    def partitions(self) -> list[int]:
        return sorted(self._partitions)

    def lag_s(self, partition: int) -> float | None:
        """Processing time minus the watermark: how far behind real time the partition's event time is."""
        watermark = self.watermark(partition)
        return None if watermark is None else self.clock() - watermark / 1_000_000
