"""Faust's Kafka transport with one fix: input partitions with no committed offset restart at their beginning.

After recovering its tables, Faust positions every input partition with aiokafka's
`seek_to_committed()`, which seeks only where the committed offset is a positive number
(aiokafka/consumer/consumer.py: `if offset and offset > 0`). Meanwhile, during recovery, Faust's
`Consumer.getmany()` drops records fetched for partitions that are not active yet
(faust/transport/consumer.py; faust-streaming/faust#596 describes the same window). A partition
without a commit (a worker killed before its first commit, every 2.8 s) therefore kept the position
the fetcher had reached, and the records before it were never processed: a restart right after a
crash sat idle with a full input topic. Seen in this project's kill -9 test about one run in ten.

The fix is where the positioning happens: after aiokafka's seek, partitions it left alone seek to
their earliest offset, before any record of the new assignment is processed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import faust
from faust.transport.drivers import aiokafka as faust_aiokafka


class ResumingConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    async def seek_to_committed(self) -> Mapping[Any, int]:
        committed = await super().seek_to_committed()
        skipped = [tp for tp, offset in committed.items() if offset is None or offset <= 0]
        if skipped:
            await self.call_thread(self._ensure_consumer().seek_to_beginning, *skipped)
        return committed


class ResumingConsumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> ResumingConsumerThread:
        return ResumingConsumerThread(self, loop=self.loop, beacon=self.beacon)


class ResumingTransport(faust_aiokafka.Transport):
    Consumer = ResumingConsumer


class ResumingApp(faust.App):
    """faust.App whose consumers use ResumingTransport (the broker URLs must be kafka://)."""

    def _new_transport(self) -> ResumingTransport:
        return ResumingTransport(self.conf.broker_consumer, self)
