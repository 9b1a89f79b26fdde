"""Reward policies at runtime: versions on a compacted topic, published by `treadle policy push`.

Each record is keyed by the policy version and holds the policy as JSON. A version is immutable:
pushing other content under an existing version is refused. Workers read the topic at start and
every few seconds; a step uses the policy effective at its dispatch's event time (see
processors/steps/policy.py), so push a policy a little before it becomes effective.
"""

from __future__ import annotations

import json
import logging

from aiokafka import AIOKafkaProducer

from processors.steps.policy import PolicyBook, PolicyError, RewardPolicy
from topics.compacted import read_to_end

log = logging.getLogger(__name__)


class PolicyTopic:
    def __init__(self, bootstrap_servers: str, topic: str) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic

    async def load(self) -> list[RewardPolicy]:
        policies = []
        for key, value in await read_to_end(self.bootstrap_servers, self.topic):
            try:
                policies.append(RewardPolicy.model_validate_json(value))
            except ValueError as exc:
                log.error("skipping unreadable reward policy %r on %s: %s", key, self.topic, exc)
        return policies

    async def refresh(self, book: PolicyBook) -> list[str]:
        """Add the versions `book` does not know yet; returns them."""
        added = []
        for policy in await self.load():
            if policy.version in book:
                continue
            try:
                book.add(policy)
                added.append(policy.version)
            except PolicyError as exc:
                log.error("reward policy on %s refused: %s", self.topic, exc)
        if added:
            log.info("reward policies now known: %s (added %s)", ", ".join(book.versions), ", ".join(added))
        return added

    async def push(self, policy: RewardPolicy) -> bool:
        """Publish `policy`; False if that exact version is already there, PolicyError if it differs."""
        for known in await self.load():
            if known.version == policy.version:
                if known == policy:
                    return False
                raise PolicyError(f"reward policy version {policy.version} already exists with other content")
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap_servers, acks="all")
        await producer.start()
        try:
            value = json.dumps(policy.model_dump(mode="json"), sort_keys=True).encode()
            await producer.send_and_wait(self.topic, value, key=policy.version.encode())
        finally:
            await producer.stop()
        return True
