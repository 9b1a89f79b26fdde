"""The state graph's GraphStore over a Faust table, one session at a time, with writes staged per batch.

All of a session's graph lives in one RocksDB table (`state-graph`), in the partition its session hashes
to, under keys that start with the session id, so a session's keys are contiguous:

    session \\0 n \\0 node_id                   -> NodeRec (orjson)
    session \\0 e \\0 src \\0 dst \\0 type          -> EdgeRec
    session \\0 v \\0 ordinal (8 bytes, big end)  -> StateVersion record (the undo window for rollbacks)
    session \\0 x                               -> TTL heap [[expires_at, node_id], ...]

Reads go straight to the partition's RocksDB (no Faust key index); writes stay in `writes` until
`materialize`, which the processor calls only after the session's commit record is acked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from processors.state.graph import EdgeKey, EdgeRec, Expiries, NodeRec
from streams.runtime import table_writes
from streams.runtime.processor import ProcessingContext

_MISSING = object()


def node_key(session: str, node_id: str) -> bytes:
    return f"{session}\0n\0{node_id}".encode()


def edge_key(session: str, key: EdgeKey) -> bytes:
    return f"{session}\0e\0{key[0]}\0{key[1]}\0{key[2]}".encode()


def version_key(session: str, ordinal: int) -> bytes:
    return f"{session}\0v\0".encode() + ordinal.to_bytes(8, "big")


def expiries_key(session: str) -> bytes:
    return f"{session}\0x".encode()


def partition_db(table: Any, partition: int) -> Any:
    """The rocksdict of one partition of a Faust RocksDB table (Faust opens it on first use)."""
    return table.data._db_for_partition(partition)


class TableGraphStore:
    """GraphStore for the sessions of one partition; decoded values are cached for the batch."""

    def __init__(self, table: Any, partition: int) -> None:
        self.table = table
        self.partition = partition
        self._db = partition_db(table, partition)
        self.writes: dict[bytes, Any] = {}  # key -> value object (None: delete), encoded at materialize
        self._cache: dict[bytes, Any] = {}

    def _get(self, key: bytes) -> Any:
        if key in self.writes:
            return self.writes[key]
        value = self._cache.get(key, _MISSING)
        if value is _MISSING:
            raw = self._db.get(key)
            value = self._cache[key] = None if raw is None else orjson.loads(raw)
        return value

    def _put(self, key: bytes, value: Any) -> None:
        self.writes[key] = value

    def get_node(self, session: str, node_id: str) -> NodeRec | None:
        value = self._get(node_key(session, node_id))
        if value is None or isinstance(value, NodeRec):
            return value
        return NodeRec.from_dict(value)

    def put_node(self, session: str, node_id: str, rec: NodeRec | None) -> None:
        self._put(node_key(session, node_id), rec)

    def get_edge(self, session: str, key: EdgeKey) -> EdgeRec | None:
        value = self._get(edge_key(session, key))
        if value is None or isinstance(value, EdgeRec):
            return value
        return EdgeRec.from_dict(value)

    def put_edge(self, session: str, key: EdgeKey, rec: EdgeRec | None) -> None:
        self._put(edge_key(session, key), rec)

    def get_version(self, session: str, ordinal: int) -> dict[str, Any] | None:
        return self._get(version_key(session, ordinal))

    def put_version(self, session: str, ordinal: int, version: dict[str, Any] | None) -> None:
        self._put(version_key(session, ordinal), version)

    def get_expiries(self, session: str) -> Expiries:
        key = expiries_key(session)
        heap = self._get(key)
        if heap is None:
            heap = []
        elif heap and not isinstance(heap[0], tuple):
            heap = [(int(t), str(n)) for t, n in heap]
        self.writes[key] = heap  # the fold mutates it in place; written back at materialize
        return heap

    def put_expiries(self, session: str, heap: Expiries) -> None:
        self._put(expiries_key(session), heap)

    async def materialize(self, ctx: ProcessingContext, *, versions_only: bool = False) -> int:
        """Write the staged changes (or only the version keys) to RocksDB and the changelog; returns how many."""
        if versions_only:
            writes = {k: v for k, v in self.writes.items() if k[k.index(0) + 1 : k.index(0) + 3] == b"v\0"}
            self.writes = {k: v for k, v in self.writes.items() if k not in writes}
        else:
            writes, self.writes = self.writes, {}
        for key, value in writes.items():
            self._cache[key] = value
            if value is None:
                await table_writes.delete_in_partition(self.table, key, self.partition, ctx)
            else:
                await table_writes.put_in_partition(self.table, key, _encode(value), self.partition, ctx)
        return len(writes)


def _encode(value: Any) -> bytes:
    if isinstance(value, NodeRec | EdgeRec):
        return orjson.dumps(value.to_dict())
    return orjson.dumps(value)


def session_keys(table: Any, partition: int, session: str) -> list[bytes]:
    """Every key of one session (nodes, edges, versions, TTL heap): what ending the session deletes."""
    prefix = f"{session}\0".encode()
    keys = []
    for key in partition_db(table, partition).keys(from_key=prefix):
        if not key.startswith(prefix):
            break
        keys.append(key)
    return keys


def session_items(table: Any, partition: int, session: str, kind: str) -> Iterator[tuple[str, bytes]]:
    """(key suffix, raw value) of one session's keys of one kind (n, e, v), in key order."""
    prefix = f"{session}\0{kind}\0".encode()
    for key, value in partition_db(table, partition).items(from_key=prefix):
        if not key.startswith(prefix):
            break
        if key != b"__faust\0offset__":
            yield key[len(prefix) :].decode(), value
