"""The embedded one-machine stack behind `treadle up` / `down` / `status`.

It manages only what the settings leave local: the Kafka broker (or the TREADLE_KAFKA_BROKERS=3 of a cluster)
unless TREADLE_LOCAL_KAFKA=0, the Valkey server unless REDIS_URL is set. chDB is not a service: the worker opens
it in-process.
"""

from __future__ import annotations

from dataclasses import dataclass

from streams.runtime.processes import ServiceStatus
from topics.settings import Settings
from treadle.devstack.kafka import LocalKafkaCluster
from treadle.devstack.valkey import LocalValkey


@dataclass(frozen=True)
class StackStatus:
    """Both services' status; external ones are reported with managed=False."""

    kafka: ServiceStatus
    valkey: ServiceStatus

    @property
    def services(self) -> tuple[ServiceStatus, ServiceStatus]:
        return (self.kafka, self.valkey)

    @property
    def running(self) -> bool:
        """True when every service treadle manages is running (external ones are not checked)."""
        return all(s.running for s in self.services if s.managed)


def _external(name: str, address: str, detail: str) -> ServiceStatus:
    return ServiceStatus(name=name, managed=False, running=False, address=address, detail=detail)


class LocalStack:
    """Start, stop and report the local services the settings ask for."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.kafka: LocalKafkaCluster | None = LocalKafkaCluster(settings) if settings.local_kafka else None
        self.valkey: LocalValkey | None = LocalValkey(settings) if settings.redis_url is None else None

    def _kafka_external(self) -> ServiceStatus:
        return _external("kafka", self.settings.kafka_bootstrap_servers, "external (TREADLE_LOCAL_KAFKA=0)")

    def _valkey_external(self) -> ServiceStatus:
        return _external("valkey", self.settings.redis_url or "", "external (REDIS_URL)")

    def up(self) -> StackStatus:
        """Start what is local and not yet running; Valkey first since it takes a fraction of a second."""
        if self.kafka:
            self.kafka.check_shape()  # before Valkey starts: a refused `up` leaves nothing running
        valkey = self.valkey.up() if self.valkey else self._valkey_external()
        kafka = self.kafka.up() if self.kafka else self._kafka_external()
        return StackStatus(kafka=kafka, valkey=valkey)

    def down(self) -> StackStatus:
        """Stop the local services treadle started; external ones and foreign PIDs are never touched."""
        kafka = self.kafka.down() if self.kafka else self._kafka_external()
        valkey = self.valkey.down() if self.valkey else self._valkey_external()
        return StackStatus(kafka=kafka, valkey=valkey)

    def status(self) -> StackStatus:
        return StackStatus(
            kafka=self.kafka.status() if self.kafka else self._kafka_external(),
            valkey=self.valkey.status() if self.valkey else self._valkey_external(),
        )
