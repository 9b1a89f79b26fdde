"""Create or verify the catalog's topics, idempotently.

A topic that exists with a different partition count is an error, not a warning: the step
assembler's state is per partition, so co-partitioned topics that disagree would split a session.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import TopicAlreadyExistsError

from topics.catalog import TopicCatalog, TopicSpec
from topics.settings import KAFKA_MAX_MESSAGE_BYTES, KAFKA_MAX_REQUEST_BYTES, min_insync_replicas

log = logging.getLogger(__name__)


class TopicMismatchError(Exception):
    """An existing topic does not match the catalog in a way that would break joins."""


@dataclass(frozen=True)
class TopicState:
    spec: TopicSpec
    created: bool
    partitions: int


async def ensure_topics(catalog: TopicCatalog | Sequence[TopicSpec], bootstrap_servers: str) -> list[TopicState]:
    """Create missing topics and verify existing ones (the catalog's, or topics made on demand such as work topics);
    returns what was found or made."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers, client_id="treadle-admin")
    await admin.start()
    try:
        existing, _ = await _partition_counts(admin, [s.name for s in catalog])
        missing = [s for s in catalog if s.name not in existing]
        if missing:
            try:
                await admin.create_topics(
                    [NewTopic(s.name, s.partitions, s.replication_factor, topic_configs=_configs(s)) for s in missing]
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
        # topics made just now have the limit set above (and a fresh one may not show it yet)
        await _check_record_limits(admin, [s.name for s in catalog if s not in missing])
        return states
    finally:
        await admin.close()


async def _await_metadata(
    admin: AIOKafkaAdminClient, catalog: TopicCatalog | Sequence[TopicSpec], created: list[str], timeout: float = 15.0
) -> dict[str, int]:
    """Partition counts once every new partition has a leader.

    Right after CreateTopics the metadata may not list the topics yet, and a client that reads a
    partition before it has a leader logs NotLeaderForPartitionError at ERROR level.
    """
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        counts, led = await _partition_counts(admin, [s.name for s in catalog])
        ready = all(counts.get(name, 0) > 0 and led.get(name) == counts[name] for name in created)
        if ready or asyncio.get_running_loop().time() > deadline:
            return counts
        await asyncio.sleep(0.2)


async def _partition_counts(admin: AIOKafkaAdminClient, names: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """(partitions per topic, partitions with a leader per topic) for the topics that exist."""
    present = set(await admin.list_topics())
    wanted = [n for n in names if n in present]
    if not wanted:
        return {}, {}
    described = [d for d in await admin.describe_topics(wanted) if d["error_code"] == 0]
    counts = {d["topic"]: len(d["partitions"]) for d in described}
    led = {d["topic"]: sum(1 for p in d["partitions"] if p["leader"] >= 0) for d in described}
    return counts, led


def _configs(spec: TopicSpec) -> dict[str, str]:
    """The spec's topic configs, with the record limit every treadle producer is set to (topics/settings.py), so a
    cluster whose default is lower refuses nothing a worker or the SDK sends, and the in-sync replicas an acks=all
    write needs (2 of 3: one broker may be down; min_insync_replicas)."""
    return {
        "max.message.bytes": str(KAFKA_MAX_MESSAGE_BYTES),
        "min.insync.replicas": str(min_insync_replicas(spec.replication_factor)),
        **spec.config,
    }


async def _check_record_limits(admin: AIOKafkaAdminClient, names: list[str]) -> None:
    """An existing topic that takes smaller records than treadle's producers send would refuse an output the worker
    made, and the worker would meet the same refusal after every restart: refuse to start instead, saying what to
    change."""
    if not names:
        return
    try:
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, name, {"max.message.bytes": None}) for name in names]
        )
    except Exception as exc:  # e.g. no DescribeConfigs permission: the limits cannot be checked, only trusted
        log.warning("could not read the topics' max.message.bytes (%r); assuming they take %d-byte records",
                    exc, KAFKA_MAX_REQUEST_BYTES)  # fmt: skip
        return
    small = {}
    for response in responses:
        for error_code, _, _, name, entries in (r[:5] for r in response.resources):
            for entry in entries if error_code == 0 else ():
                if entry[0] == "max.message.bytes" and int(entry[1]) < KAFKA_MAX_REQUEST_BYTES:
                    small[name] = int(entry[1])
    if small:
        listed = ", ".join(f"{name} ({limit:,})" for name, limit in sorted(small.items()))
        raise TopicMismatchError(
            f"topics take records up to fewer bytes than treadle's producers send ({KAFKA_MAX_REQUEST_BYTES:,}): "
            f"{listed}; raise their max.message.bytes to {KAFKA_MAX_MESSAGE_BYTES} (kafka-configs --alter "
            "--entity-type topics --add-config max.message.bytes=...)"
        )
