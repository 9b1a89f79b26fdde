"""Contracts on their compacted topic (`_<prefix>.contracts`, keys `contract/<name>/<version>`), like node types.

Registering checks the contract (topics.contracts.registration_problems: it compiles, names only registered node
types, and does not narrow the previous version) and publishes it as the next version of its name. Versions are
immutable; a step uses, per contract name, the newest version effective at its dispatch's event time, so a replay
checks a step against the contracts the first run used. Register a contract a little before it is effective
(`effective_from_us`, `treadle contracts register --effective-from`).
"""

from __future__ import annotations

import logging

from aiokafka import AIOKafkaProducer

from topics.compacted import read_to_end
from topics.contracts import Contract, ContractError, registration_problems
from topics.node_types import NodeTypeRegistry

log = logging.getLogger(__name__)

_KEY_PREFIX = b"contract/"


class ContractRegistry:
    """Every registered contract version, read from (and published to) the contracts topic."""

    def __init__(self, bootstrap_servers: str, topic: str, node_types_topic: str) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.node_types_topic = node_types_topic

    async def load(self) -> list[Contract]:
        """Every version, sorted by (name, version); an unreadable record is logged and skipped."""
        contracts = []
        for key, value in await read_to_end(self.bootstrap_servers, self.topic):
            if not (key or b"").startswith(_KEY_PREFIX):
                continue
            try:
                contracts.append(Contract.model_validate_json(value))
            except ValueError as exc:
                log.error("skipping unreadable contract %r on %s: %s", key, self.topic, exc)
        return sorted(contracts, key=lambda c: (c.name, c.version))

    async def register(self, contract: Contract) -> Contract | None:
        """Publish `contract` as the next version of its name: None when it equals the latest version (apart from
        version and effective time); ContractError with every reason when it is refused."""
        known = [c for c in await self.load() if c.name == contract.name]
        latest = known[-1] if known else None
        if latest is not None and _same(latest, contract):
            return None
        node_types = await NodeTypeRegistry(self.bootstrap_servers, self.node_types_topic).load()
        reasons = registration_problems(contract, node_types.types(), latest)
        if reasons:
            raise ContractError(contract.name, reasons)
        record = contract.model_copy(update={"version": (latest.version + 1) if latest else 1})
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap_servers, acks="all")
        await producer.start()
        try:
            key = _KEY_PREFIX + f"{record.name}/{record.version}".encode()
            await producer.send_and_wait(self.topic, record.to_json(), key=key)
        finally:
            await producer.stop()
        return record


def _same(a: Contract, b: Contract) -> bool:
    ignore = {"version", "effective_from_us"}
    return a.model_dump(exclude=ignore) == b.model_dump(exclude=ignore)
