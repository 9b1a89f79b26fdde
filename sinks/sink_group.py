"""One sink per embedded database: the sink group's partition assignor refuses a second member next to one.

Sinks share a consumer group, so two sinks split the partitions. With a ClickHouse server that is scaling: both
write the same database. With embedded chDB each sink writes its own files, so each database would hold part of
the rows and `treadle sql` would silently answer from one part. So whenever a member of the group writes an
embedded database, the group may have only one member that consumes.

Why the assignor decides, and not a check of the group's members or an owner record: Kafka's group coordinator
already elects one member, the leader, to compute every member's partitions from the full member list of a
generation, and it keeps the first member that joined as leader while that member stays (a newcomer never takes
over). Deciding there is atomic (two sinks starting at once cannot both win, as they could after each listing
the members), it needs no lease of its own to expire (a dead owner leaves the group after the session timeout,
as its partitions would), and it runs on every rebalance. Each member puts a SinkIdentity (host, store, pid) in
its join metadata; when one of them is embedded the leader keeps every partition and gives every other member
none, with the reason in its assignment, which SinkGroupAssignor.refusal exposes and the sink raises as
SinkRefusedError. With servers only it assigns round robin, as aiokafka's default would. Every sink of a group
must run this assignor: the broker refuses a member that offers another one (INCONSISTENT_GROUP_PROTOCOL).
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata

from topics.settings import Settings


class SinkRefusedError(Exception):
    """This sink may not consume: its group already has a sink and one of them writes an embedded database."""


@dataclass(frozen=True)
class SinkIdentity:
    """What a sink tells its group about itself: where it runs and what it writes (never a password)."""

    instance: str  # unique per process start, so the leader finds itself among the members
    host: str
    pid: int
    embedded: bool
    store: str  # the chDB path, or the server's host:port/database

    @classmethod
    def of(cls, settings: Settings) -> SinkIdentity:
        if settings.clickhouse_url is None:
            store = str(settings.chdb_path.resolve())
        else:
            url = urlsplit(settings.clickhouse_url)
            store = f"{url.hostname}:{url.port or 8123}{url.path}"
        return cls(uuid.uuid4().hex, socket.gethostname(), os.getpid(), settings.embedded_clickhouse, store)

    def describe(self) -> str:
        kind = "embedded chDB" if self.embedded else "ClickHouse server"
        return f"the sink on {self.host} (pid {self.pid}) writing {kind} {self.store}"

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> SinkIdentity | None:
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError):
            return None  # not a treadle sink of this version


class SinkGroupAssignor(AbstractPartitionAssignor):
    """The sink group's assignor (one instance per consumer): see the module docstring for the rule."""

    name = "treadle-sink"
    version = 0

    def __init__(self, identity: SinkIdentity) -> None:
        self.identity = identity
        self.refusal: str | None = None

    def metadata(self, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:  # type: ignore[override]
        return ConsumerProtocolMemberMetadata(self.version, sorted(topics), self.identity.encode())

    def assign(  # type: ignore[override]
        self, cluster: ClusterMetadata, members: Mapping[str, ConsumerProtocolMemberMetadata]
    ) -> dict[str, ConsumerProtocolMemberAssignment]:
        """Run on the group leader only (Kafka elects it): the whole group's partitions, by member id."""
        identities = {member: SinkIdentity.decode(meta.user_data) for member, meta in members.items()}
        if len(members) < 2 or not any(i is None or i.embedded for i in identities.values()):
            return RoundRobinPartitionAssignor.assign(cluster, members)
        me = next((m for m, i in identities.items() if i is not None and i.instance == self.identity.instance), None)
        owner = me if me is not None else min(members)
        everything = RoundRobinPartitionAssignor.assign(cluster, {owner: members[owner]})[owner]
        reason = refusal_reason(self.identity if me is not None else identities[owner])
        return {
            member: everything
            if member == owner
            else ConsumerProtocolMemberAssignment(self.version, [], reason.encode())
            for member in members
        }

    def on_assignment(self, assignment: ConsumerProtocolMemberAssignment) -> None:  # type: ignore[override]
        self.refusal = assignment.user_data.decode(errors="replace") if assignment.user_data else None


def refusal_reason(owner: SinkIdentity | None) -> str:
    """The one line a refused sink reports: who owns the group, and how to scale instead."""
    who = owner.describe() if owner is not None else "another sink"
    return (
        f"refused: {who} already consumes this sink group, and a second sink next to an embedded database would "
        "split the rows between two databases; run one sink per deployment (TREADLE_SINK=off on the other "
        "workers), or set CLICKHOUSE_URL to a ClickHouse server to run several"
    )
