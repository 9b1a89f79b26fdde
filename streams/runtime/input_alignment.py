"""Which input partitions the next fetch may read: co-partitioned input topics are read in step, by record time.

A step's dispatch, tool results and rewards come on different topics, co-partitioned by session. Faust hands out
whatever each fetch returned, one partition after the other, and a fetch takes up to 1 MiB per partition. With
a backlog (a worker catching up after downtime or a rebalance) one input topic's partition ran more than 10 s of
event time ahead of the others (weaving bench, throughput run): every step's dispatch was folded long before its
tool result and rewards, so steps published an extra revision, were written to their table more often, and
dropped out of the parsed-state cache before their rewards came; the watermark, the minimum over the topics,
waited for the slowest one meanwhile.

Kafka Streams reads the partitions of a task in timestamp order for the same reason (KIP-353). Here an input
partition is left out of the next getmany while its last record read is more than `max_skew_s` (record
timestamps) ahead of a co-partitioned input partition that has records left to read, or that has records and
none read yet. What it fetched waits in aiokafka's buffer, and aiokafka fetches it no further meanwhile, so the
held-back data is bounded by one fetch. A partition with records left that delivers none (its fetches fail, or
are slow) holds the others back for at most `max_wait_s` of fetching without progress, then everything is read as
fetched (Kafka Streams' max.task.idle.ms and "enforced processing"). The clock (`now` of `readable`) is the time
spent fetching, not wall time: the time a worker spends folding a batch between fetches is no fetch failing.

Record timestamps are the producers' clocks (treadle's SDK leaves them to Kafka), which follow event time for
live producers; for a backlog, they are its send order.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Set
from dataclasses import dataclass, field
from typing import Any

TopicPartition = Any  # faust's TP or aiokafka's TopicPartition: a (topic, partition) named tuple
MAX_SKEW_S = 1.0  # TREADLE_INPUT_MAX_SKEW_S's default


@dataclass
class InputAlignment:
    """Per-partition read positions in record time of the `topics` (co-partitioned), and what may be read next."""

    topics: frozenset[str]
    max_skew_s: float = MAX_SKEW_S
    max_wait_s: float = 2.0
    _heads: dict[TopicPartition, float] = field(default_factory=dict)  # timestamp (s) of the last record read
    _held: dict[int, tuple[float, float]] = field(default_factory=dict)  # partition -> (its limit, held since)

    def read(self, tp: TopicPartition, timestamp_s: float) -> None:
        """A record of `tp` with this timestamp was handed out (in offset order)."""
        self._heads[tp] = timestamp_s

    def reset(self) -> None:
        """Forget every position: the assignment changed, or partitions were seeked."""
        self._heads.clear()
        self._held.clear()

    def readable(
        self, active: Set[TopicPartition], has_more: Callable[[TopicPartition], bool], now: float
    ) -> Set[TopicPartition]:
        """The partitions of `active` the next getmany may read; `has_more(tp)`: records past those read exist.

        Partitions of other topics are always readable; so is every partition when alignment is off (inf).
        """
        if math.isinf(self.max_skew_s):
            return active
        groups: dict[int, list[TopicPartition]] = defaultdict(list)
        for tp in active:
            if tp.topic in self.topics:
                groups[tp.partition].append(tp)
        held: set[TopicPartition] = set()
        for partition, tps in groups.items():
            floor = self._floor(tps, has_more)
            limit = math.inf if floor is None else floor + self.max_skew_s
            ahead = [tp for tp in tps if self._heads.get(tp, -math.inf) > limit]
            if not ahead:
                self._held.pop(partition, None)
                continue
            before = self._held.get(partition)
            if before is None or limit > before[0]:  # (first held, or) the laggard made progress: wait anew
                before = self._held[partition] = (limit, now)
            if now - before[1] <= self.max_wait_s:
                held.update(ahead)
        return active - held if held else active

    def _floor(self, tps: list[TopicPartition], has_more: Callable[[TopicPartition], bool]) -> float | None:
        """Where the partition's slowest input with records left stands (-inf: one has none read yet); None when
        no input has records left."""
        behind = [self._heads.get(tp, -math.inf) for tp in tps if has_more(tp)]
        return min(behind) if behind else None


def records_left(consumer: Any, tp: TopicPartition) -> bool:
    """Whether `tp` has records past those aiokafka handed out: its consumed position is below the last highwater
    a fetch reported. False while either is unknown (not assigned, not fetched yet, `consumer` None)."""
    return (records_behind(consumer, tp) or 0) > 0


def records_behind(consumer: Any, tp: TopicPartition) -> int | None:
    """How many records `tp` has past those aiokafka handed out (last highwater - consumed position); 0 when it is
    not assigned; None while unknown: no fetch has reported its highwater yet (every successful fetch response does,
    records or not), or `consumer` is None."""
    if consumer is None:
        return None
    state = _fetch_state(consumer, tp)
    if state is None:
        return 0
    if state.highwater is None or not state.has_valid_position:
        return None
    return max(0, state.highwater - state.position)


def fetch_offsets(consumer: Any, tp: TopicPartition) -> tuple[int | None, int | None]:
    """`tp`'s (consumed position, last highwater a fetch reported), each None while unknown (not assigned, not
    fetched yet, `consumer` None)."""
    state = _fetch_state(consumer, tp) if consumer is not None else None
    if state is None:
        return None, None
    return (state.position if state.has_valid_position else None), state.highwater


def _fetch_state(consumer: Any, tp: TopicPartition) -> Any:
    """aiokafka's TopicPartitionState of `tp`; None when it is not assigned."""
    subscription = consumer._subscription.subscription
    return subscription.assignment.state_value(tp) if subscription is not None else None
