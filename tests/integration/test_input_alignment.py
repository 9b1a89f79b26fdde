"""Co-partitioned input topics are read in step by record time (streams/runtime/input_alignment.py)."""

from __future__ import annotations

import asyncio
import math
import os
from typing import NamedTuple

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from hypothesis import given
from hypothesis import strategies as st

from streams.runtime.input_alignment import InputAlignment, fetch_offsets, records_behind, records_left
from topics.settings import Settings

ACTIONS, RESULTS, REWARDS, CHANGELOG = "actions", "tool_results", "rewards", "steps-changelog"
INPUTS = frozenset({ACTIONS, RESULTS, REWARDS})


class TP(NamedTuple):
    topic: str
    partition: int


def alignment(**heads: float) -> InputAlignment:
    """Heads given as topic_partition=seconds, e.g. actions_0=12.0."""
    aligned = InputAlignment(INPUTS, max_skew_s=1.0, max_wait_s=2.0)
    for name, at in heads.items():
        topic, _, partition = name.rpartition("_")
        aligned.read(TP(topic, int(partition)), at)
    return aligned


def every(*partitions: int) -> set[TP]:
    return {TP(topic, p) for topic in (ACTIONS, RESULTS, REWARDS) for p in partitions}


def left(*tps: TP):
    return lambda tp: tp in tps


def test_inputs_in_step_are_all_readable() -> None:
    aligned = alignment(actions_0=10.0, tool_results_0=10.5, rewards_0=9.8)
    active = every(0)
    assert aligned.readable(active, lambda tp: True, now=0.0) == active


def test_an_input_ahead_of_one_with_records_left_waits_for_it() -> None:
    aligned = alignment(
        actions_0=20.0, tool_results_0=10.0, rewards_0=10.5, actions_1=20.0, tool_results_1=10.0, rewards_1=10.2
    )
    active = every(0, 1)
    readable = aligned.readable(active, lambda tp: True, now=0.0)
    assert readable == active - {TP(ACTIONS, 0), TP(ACTIONS, 1)}  # partition by partition


def test_an_input_with_nothing_left_to_read_holds_nobody_back() -> None:
    aligned = alignment(actions_0=20.0, tool_results_0=10.0, rewards_0=19.5)
    active = every(0)
    assert aligned.readable(active, left(TP(ACTIONS, 0), TP(REWARDS, 0)), now=0.0) == active


def test_an_input_with_records_and_none_read_yet_holds_back_those_read() -> None:
    aligned = alignment(actions_0=20.0)
    active = every(0)
    assert aligned.readable(active, lambda tp: True, now=0.0) == active - {TP(ACTIONS, 0)}
    # unknown to aiokafka yet (no highwater): it holds nobody back
    assert aligned.readable(active, left(TP(ACTIONS, 0)), now=0.0) == active


def test_a_laggard_that_delivers_nothing_holds_the_others_back_for_max_wait_only() -> None:
    aligned = alignment(actions_0=20.0, tool_results_0=10.0)
    active = {TP(ACTIONS, 0), TP(RESULTS, 0)}
    assert aligned.readable(active, lambda tp: True, now=100.0) == {TP(RESULTS, 0)}
    assert aligned.readable(active, lambda tp: True, now=102.0) == {TP(RESULTS, 0)}
    assert aligned.readable(active, lambda tp: True, now=102.1) == active  # enforced: read as fetched
    aligned.read(TP(RESULTS, 0), 11.0)  # progress: it waits anew
    assert aligned.readable(active, lambda tp: True, now=102.2) == {TP(RESULTS, 0)}
    assert aligned.readable(active, lambda tp: True, now=104.3) == active


def test_other_topics_are_never_held_and_inf_turns_alignment_off() -> None:
    aligned = alignment(actions_0=20.0, tool_results_0=10.0)
    active = {TP(ACTIONS, 0), TP(RESULTS, 0), TP(CHANGELOG, 0)}
    aligned.read(TP(CHANGELOG, 0), 50.0)
    assert aligned.readable(active, lambda tp: True, now=0.0) == {TP(RESULTS, 0), TP(CHANGELOG, 0)}
    off = InputAlignment(INPUTS, max_skew_s=math.inf)
    off.read(TP(ACTIONS, 0), 20.0)
    off.read(TP(RESULTS, 0), 10.0)
    assert off.readable(active, lambda tp: True, now=0.0) == active


def test_reset_forgets_every_position() -> None:
    aligned = alignment(actions_0=20.0, tool_results_0=10.0)
    aligned.reset()
    active = {TP(ACTIONS, 0), TP(RESULTS, 0)}
    assert aligned.readable(active, lambda tp: True, now=0.0) == active


heads = st.dictionaries(
    st.builds(TP, st.sampled_from(sorted(INPUTS)), st.integers(0, 2)), st.floats(0, 100), max_size=9
)


@given(heads, st.sets(st.builds(TP, st.sampled_from(sorted(INPUTS)), st.integers(0, 2))), st.floats(0, 5))
def test_what_is_held_is_exactly_what_reads_ahead_of_a_laggard(read: dict, with_left: set, skew: float) -> None:
    aligned = InputAlignment(INPUTS, max_skew_s=skew, max_wait_s=10.0)
    for tp, at in read.items():
        aligned.read(tp, at)
    active = every(0, 1, 2)
    readable = aligned.readable(active, lambda tp: tp in with_left, now=0.0)
    assert readable <= active
    for partition in range(3):
        group = {tp for tp in active if tp.partition == partition}
        behind = [read.get(tp, -math.inf) for tp in group if tp in with_left]
        for tp in group:
            ahead = bool(behind) and tp in read and read[tp] > min(behind) + skew
            assert (tp not in readable) == ahead, (tp, read, with_left)
        if behind:  # the slowest input with records left is always read: nothing waits forever
            slowest = min((tp for tp in group if tp in with_left), key=lambda tp: read.get(tp, -math.inf))
            assert slowest in readable


def test_records_left_behind_and_fetch_offsets_follow_aiokafka_position_and_highwater(stack: Settings) -> None:
    asyncio.run(_records_left(stack))


async def _records_left(settings: Settings) -> None:
    topic = f"alignment-{os.getpid()}"
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap_servers)
    await producer.start()
    try:
        for n in range(10):
            await producer.send_and_wait(topic, str(n).encode())
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TP(topic, 0)  # Faust's own TP type: aiokafka's state is looked up by (topic, partition)
        assigned = TopicPartition(topic, 0)
        assert not records_left(consumer, tp) and records_behind(consumer, tp) == 0  # not assigned
        assert fetch_offsets(consumer, tp) == (None, None)
        consumer.assign([assigned])
        await consumer.seek_to_beginning(assigned)
        assert not records_left(consumer, tp) and records_behind(consumer, tp) is None  # no fetch yet: no highwater
        first = await consumer.getmany(assigned, timeout_ms=5000, max_records=4)
        assert len(first[assigned]) == 4
        assert records_left(consumer, tp) and records_behind(consumer, tp) == 6  # buffered or not
        assert fetch_offsets(consumer, tp) == (4, 10)
        read = 4
        while read < 10:
            batch = await consumer.getmany(assigned, timeout_ms=5000)
            read += len(batch.get(assigned, []))
        assert not records_left(consumer, tp) and records_behind(consumer, tp) == 0
        assert fetch_offsets(consumer, tp) == (10, 10)
    finally:
        await consumer.stop()
    assert not records_left(None, tp) and records_behind(None, tp) is None and fetch_offsets(None, tp) == (None, None)
