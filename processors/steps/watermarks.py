"""Event-time watermarks per partition, across every co-partitioned input topic.

A partition's watermark is the event time up to which the worker assumes it has seen everything:
for each input topic of that partition, the largest event_time seen minus the bounded
out-of-orderness; the partition's watermark is the smallest of those (the slowest topic holds it
back, as in Flink). A topic that has been silent on the partition for `idle_timeout_s` of
processing time stops holding it back; when every topic is idle, the watermark advances with
processing time (now - idle timeout), so open steps close even when nothing arrives.
Watermarks never go back.

A topic that has not delivered anything on the partition yet holds it back too, for `idle_timeout_s` from the
moment the worker first sees the partition. Otherwise, after a (re)start with a backlog, the first fetch could
hold only rewards, their event times alone would move the watermark past the orphan wait of rewards whose
dispatches sit in the next fetch, and those would be reported as orphans (seen in the kill -9 test whenever the
restarted worker's first fetch returned the rewards topic alone).

The same holds after a *silence*: when an event arrives on a partition whose every topic has been idle for
`idle_timeout_s`, the partition *resumes* as if just seen: each input topic (the expected ones and any seen before)
holds the watermark where it is until it has delivered since the resume, or for `idle_timeout_s` (the topics that
delivered during a hold count as heard at its end, so the ones active later do not depend on the order they came in
either). Otherwise the
topic fetched first after the silence set the watermark alone: a burst whose rewards were fetched before its
dispatches moved it past windows (and orphan waits) that the dispatches' topic had not reached, and the rows
written depended on which topic the worker happened to read first. `holding(partition)` says whether a resume
holds it now (the step processor defers pending rows meanwhile, as while catching up).

The *event watermark* is the same without the processing-time advance: how far input events alone carry the
partition (with every topic idle, the newest event time seen minus the lag).
Step expiry goes by it, so a silent partition never deletes state on processing time alone (a replay of old
events, paused for a moment, would otherwise lose its open steps), and never past the watermark (expiry_watermark).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass
class _TopicClock:
    max_event_us: int
    last_seen_s: float  # processing time of the latest event


@dataclass
class _PartitionClock:
    started_s: float  # processing time the worker first saw the partition, or it resumed after a silence
    expected: frozenset[str]  # topics that hold the watermark until they deliver (or idle) after started_s
    topics: dict[str, _TopicClock] = field(default_factory=dict)
    delivered: set[str] = field(default_factory=set)  # topics that delivered since started_s
    resumed: bool = False  # started_s is a resume after a silence, not the first sight of the partition
    released_s: float | None = None  # when the hold ended: the last expected topic delivered, or it timed out
    watermark_us: int | None = None
    event_watermark_us: int | None = None  # from events only, no idle advance


class Watermarks:
    def __init__(
        self,
        out_of_orderness_s: float,
        idle_timeout_s: float,
        clock: Callable[[], float] = time.time,
        topics: Iterable[str] = (),
    ) -> None:
        self.out_of_orderness_us = int(out_of_orderness_s * 1_000_000)
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self.topics = frozenset(topics)  # the input topics every partition expects (see the module docstring)
        self._partitions: dict[int, _PartitionClock] = {}

    def _partition(self, partition: int) -> _PartitionClock:
        clock = self._partitions.get(partition)
        if clock is None:
            clock = self._partitions[partition] = _PartitionClock(self.clock(), self.topics)
        return clock

    def observe(self, partition: int, topic: str, event_time_us: int) -> None:
        clock = self._partition(partition)
        now = self.clock()
        if clock.topics and all(
            now - self._heard_s(clock, n, t) >= self.idle_timeout_s for n, t in clock.topics.items()
        ):
            # a silence ends: every topic holds the watermark again until it delivers (see the module docstring)
            clock.started_s, clock.resumed, clock.released_s = now, True, None
            clock.expected = self.topics | clock.topics.keys()
            clock.delivered.clear()
        clock.delivered.add(topic)
        if clock.released_s is None and clock.expected and clock.expected <= clock.delivered:
            clock.released_s = now  # every expected topic has delivered: the hold ends
        seen = clock.topics.get(topic)
        if seen is None:
            clock.topics[topic] = _TopicClock(event_time_us, now)
        else:
            seen.max_event_us = max(seen.max_event_us, event_time_us)
            seen.last_seen_s = now

    @staticmethod
    def _heard_s(clock: _PartitionClock, topic: str, seen: _TopicClock) -> float:
        """When the topic last counts as heard from: a topic that delivered during a hold counts as heard at its end,
        so the topics of a burst go idle together, not in the order they happened to be fetched."""
        if clock.released_s is not None and topic in clock.delivered:
            return max(seen.last_seen_s, clock.released_s)
        return seen.last_seen_s

    def _held(self, clock: _PartitionClock, now: float) -> bool:
        """A topic has not delivered since the partition was first seen or resumed, and is not idle either."""
        return now - clock.started_s < self.idle_timeout_s and not clock.expected <= clock.delivered

    def holding(self, partition: int) -> bool:
        """Whether a resume after a silence holds the partition's watermark now (not the first sight of it)."""
        clock = self._partitions.get(partition)
        return clock is not None and clock.resumed and self._held(clock, self.clock())

    def advance(self, partition: int) -> int | None:
        """Recompute and return the partition's watermark (None until it has seen an event or idled)."""
        clock = self._partition(partition)
        now = self.clock()
        if self._held(clock, now):
            return clock.watermark_us  # a topic has not delivered yet and is not idle either: it holds everything
        if clock.released_s is None and not clock.expected <= clock.delivered:
            clock.released_s = clock.started_s + self.idle_timeout_s  # the hold ended by timeout
        active = [t for n, t in clock.topics.items() if now - self._heard_s(clock, n, t) < self.idle_timeout_s]
        if clock.topics:
            # every topic idle: none holds the events' progress back, the newest event time carries it
            times = [t.max_event_us for t in clock.topics.values()]
            newest = min(t.max_event_us for t in active) if active else max(times)
            progress = newest - self.out_of_orderness_us
            if clock.event_watermark_us is None or progress > clock.event_watermark_us:
                clock.event_watermark_us = progress
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

    def event_watermark(self, partition: int) -> int | None:
        """The watermark as input events carry it, never advanced by processing time (as of the last advance)."""
        clock = self._partitions.get(partition)
        return None if clock is None else clock.event_watermark_us

    def expiry_watermark(self, partition: int) -> int | None:
        """How far steps may expire: the event watermark, but never past the watermark, which must first report what
        a step's deadlines imply (its orphans, its windows). A resume's hold can leave the watermark behind the
        events: a reward for a step expired long ago would otherwise start a new step that expired before the held
        watermark reported it as an orphan."""
        clock = self._partitions.get(partition)
        if clock is None or clock.event_watermark_us is None or clock.watermark_us is None:
            return None
        return min(clock.event_watermark_us, clock.watermark_us)

    def partitions(self) -> list[int]:
        return sorted(self._partitions)

    def lag_s(self, partition: int) -> float | None:
        """Processing time minus the watermark: how far behind real time the partition's event time is."""
        watermark = self.watermark(partition)
        return None if watermark is None else self.clock() - watermark / 1_000_000
