"""Create or verify the catalog's topics, idempotently.

A topic that exists with a different partition count is an error, not a warning: the step
assembler's state is per partition, so co-partitioned topics that disagree would split a session.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from topics.catalog import TopicCatalog, TopicSpec

log = logging.getLogger(__name__)


class TopicMismatchError(Exception):
    """An existing topic does not match the catalog in a way that would break joins."""


@dataclass(frozen=True)
class TopicState:
    spec: TopicSpec
    created: bool
    partitions: int


async def ensure_topics(catalog: TopicCatalog, bootstrap_servers: str) -> list[TopicState]:
    """Create missing topics and verify existing ones; returns what was found or made."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers, client_id="treadle-admin")
    await admin.start()
    try:
        existing = await _partition_counts(admin, [s.name for s in catalog])
        missing = [s for s in catalog if s.name not in existing]
        if missing:
            try:
                await admin.create_topics(
                    [NewTopic(s.name, s.partitions, s.replication_factor, topic_configs=s.config) for s in missing]
                )
            except TopicAlreadyExistsError:  # another worker won the race; verified below
                pass
            for spec in missing:
                log.info("created topic %s (%d partitions)", spec.name, spec.partitions)
            existing = await _await_metadata(admin, catalog, [s.name for s in missing])
        states = []
        for spec in catalog:
            found = existing.get(spec.name, 0)
            if found != spec.partitions:
                raise TopicMismatchError(
                    f"topic {spec.name} has {found} partitions but the catalog wants {spec.partitions}; "
                    f"co-partitioned topics must agree: set TREADLE_PARTITIONS={found} or recreate the topic"
                )
            states.append(TopicState(spec=spec, created=spec in missing, partitions=found))
        return states
    finally:
        await admin.close()


async def _await_metadata(
    admin: AIOKafkaAdminClient, catalog: TopicCatalog, created: list[str], timeout: float = 15.0
) -> dict[str, int]:
    """Partition counts once the new topics show up in metadata (right after creation they may not yet)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        counts = await _partition_counts(admin, [s.name for s in catalog])
        if all(counts.get(name, 0) > 0 for name in created) or asyncio.get_running_loop().time() > deadline:
            return counts
        await asyncio.sleep(0.2)


async def _partition_counts(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, int]:
    present = set(await admin.list_topics())
    wanted = [n for n in names if n in present]
    if not wanted:
        return {}
    described = await admin.describe_topics(wanted)
    return {d["topic"]: len(d["partitions"]) for d in described if d["error_code"] == 0}
