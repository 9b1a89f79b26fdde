"""Step expiry: a step's state is deleted once the watermark is TREADLE_STEP_RETENTION_S past its horizon.

The horizon (StepAssembler.horizon_us) is the event time after which no reward can be woven into the step; the
retention after it keeps the step for rewards that arrive behind the watermark, and for late rewards that still
need its dispatch to report their lateness. A reward that comes after the step expired starts a new step with no
dispatch, so it is reported as an orphan: never dropped silently.

The index is a table of its own keyed by (expiry time, logical_event_id), so each partition's RocksDB keeps it in
expiry order: a tick reads only the entries that are due, and the worker's memory does not grow with the steps it
stores. The key follows from the state, so writing it again is harmless; a step whose horizon moved (a dispatch
came for an orphan) gets a second entry, and the earlier one, when due, finds the step not expired yet.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import faust

from streams.runtime import table_writes
from streams.runtime.processor import ProcessingContext
from topics.settings import Settings

_TIME = struct.Struct(">Q")  # big-endian, so byte order is time order


def index_key(expires_us: int, logical_event_id: str) -> bytes:
    return _TIME.pack(max(0, expires_us)) + logical_event_id.encode()


@dataclass(frozen=True)
class DueStep:
    key: bytes  # the index entry
    expires_us: int
    logical_event_id: str

    @classmethod
    def parse(cls, key: bytes) -> DueStep:
        return cls(key, _TIME.unpack_from(key)[0], key[_TIME.size :].decode())


class StepExpiry:
    """The expiry index of one step table, and when its steps expire."""

    def __init__(self, retention_s: float = 3600.0) -> None:
        self.retention_us = round(retention_s * 1_000_000)
        self.table: Any = None  # faust.Table[bytes, bytes]

    def setup(self, app: faust.App, settings: Settings, steps_table: str) -> None:
        self.retention_us = round(settings.step_retention_s * 1_000_000)
        self.table = table_writes.bytes_table(
            app, f"{steps_table}-expiry", settings, help=f"(expiry time, logical_event_id) of every {steps_table} key."
        )

    def expires_us(self, horizon_us: int) -> int:
        return horizon_us + self.retention_us

    def is_indexed(self, expires_us: int, logical_event_id: str, partition: int) -> bool:
        key = index_key(expires_us, logical_event_id)
        return table_writes.get_in_partition(self.table, key, partition) is not None

    async def index(self, expires_us: int, logical_event_id: str, partition: int, ctx: ProcessingContext) -> None:
        key = index_key(expires_us, logical_event_id)
        await table_writes.put_in_partition(self.table, key, b"", partition, ctx)

    async def unindex(self, due: DueStep, partition: int, ctx: ProcessingContext) -> None:
        await table_writes.delete_in_partition(self.table, due.key, partition, ctx)

    def due(self, partition: int, watermark_us: int, limit: int) -> list[DueStep]:
        """The partition's entries due at the watermark, oldest first, at most `limit`."""
        found: list[DueStep] = []
        for key in self._keys(partition):
            due = DueStep.parse(key)
            if due.expires_us > watermark_us or len(found) >= limit:
                break
            found.append(due)
        return found

    def _keys(self, partition: int) -> Iterator[bytes]:
        return table_writes.keys_in_order(self.table, partition)
