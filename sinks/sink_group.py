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

The assignor sees only the members present: a newcomer that starts while the owner is down is alone, and would
take the group over into a database of its own. So the owner is also recorded where it outlives its process: each
commit carries a StoreOwner (which database its rows went to) as the offsets' metadata, and a sink reads the
group's committed metadata before it joins (check_store_owner). A group whose rows went to an embedded database
other than this sink's, or to any database when this sink's is embedded, refuses it. An embedded database is known
by an id kept inside its folder (store_id), so the same files under another host name (a container recreated on
its volume) stay the owner, and a new folder at the same path is not.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata
from aiokafka.errors import KafkaError

from topics.settings import Settings

STORE_ID_FILE = "treadle-store-id"
OWNER_CHECK_ATTEMPTS = 120  # retriable errors (no group coordinator yet) for about a minute


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


def store_id(settings: Settings) -> str:
    """The embedded database's own id, made once inside its folder (it moves and disappears with the files)."""
    path = settings.chdb_path / STORE_ID_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(uuid.uuid4().hex + "\n")
    return path.read_text().strip()


@dataclass(frozen=True)
class StoreOwner:
    """The database a sink group's rows went to, recorded with every commit (the offsets' metadata)."""

    embedded: bool
    store: str  # as SinkIdentity.store
    store_id: str  # store_id() of an embedded database; "" for a server
    host: str

    @classmethod
    def of(cls, settings: Settings) -> StoreOwner:
        identity = SinkIdentity.of(settings)
        embedded = identity.embedded
        return cls(embedded, identity.store, store_id(settings) if embedded else "", identity.host)

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, metadata: str) -> StoreOwner | None:
        try:
            return cls(**json.loads(metadata))
        except (ValueError, TypeError):
            return None  # no metadata: committed by an older sink, or by hand

    def same_database(self, other: StoreOwner) -> bool:
        return self.embedded == other.embedded and (
            self.store_id == other.store_id if self.embedded else self.store == other.store
        )

    def describe(self) -> str:
        kind = "embedded chDB" if self.embedded else "ClickHouse server"
        return f"{kind} {self.store} on {self.host}"


async def check_store_owner(settings: Settings, group_id: str, me: StoreOwner) -> None:
    """Raise SinkRefusedError when the group's committed offsets say its rows went to another database and one of
    the two is embedded: the rows would split (the owner may be down now, so the assignor cannot see it)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers, client_id="treadle-sink-owner")
    await admin.start()
    try:
        for attempt in itertools.count():
            try:
                committed = await admin.list_consumer_group_offsets(group_id)
                break
            except KafkaError as exc:  # a fresh cluster has no coordinator until the offsets topic exists
                if not exc.retriable or attempt >= OWNER_CHECK_ATTEMPTS:
                    raise
                await asyncio.sleep(0.5)
    finally:
        await admin.close()
    owners = {owner for meta in committed.values() if (owner := StoreOwner.decode(meta.metadata or "")) is not None}
    other = next((o for o in owners if not o.same_database(me) and (o.embedded or me.embedded)), None)
    if other is not None:
        raise SinkRefusedError(
            f"refused: the sink writing {other.describe()} already consumes this sink group (its rows are there; it "
            "may be down now), and a second sink here would split the rows between two databases; run one sink per "
            "deployment (TREADLE_SINK=off on the other workers), set CLICKHOUSE_URL to a ClickHouse server to run "
            f"several, or, to rebuild every table in {me.describe()} on "
            f"purpose, delete the group's offsets (kafka-consumer-groups.sh --delete --group {group_id})"
        )
