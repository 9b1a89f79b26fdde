"""A batch of Avro records as one ClickHouse Native block, made by `treadle_native.NativeBlockWriter`.

Why: for the tables whose columns are a record's fields (sinks.rows.AVRO_TABLES) the sink used to hand ClickHouse the
Avro itself (sinks.avro_container), and ClickHouse reads Avro row by row, at about half the speed it inserts columns.
The native writer reads the records' bytes straight into one buffer per column (a Nested column per field of an array
of records, as the Python mappers make them) and ClickHouse inserts the block as it is (FORMAT Native). Without the
module, with TREADLE_NATIVE=0, or for a table or schema the writer does not cover, the sink keeps the Avro container;
a batch the writer refuses goes the Python way (ClickHouseSink decodes and maps it), so nothing depends on it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from sinks.clickhouse import ClickHouseStore, checked_identifier
from topics import native_codec
from topics.codec import single_object_header
from topics.schemas import AvroSchema

log = logging.getLogger(__name__)

FORMAT = "Native"


class NativeBlocks:
    """One NativeBlockWriter per (table, writer schema), made on first use from the table's column types."""

    def __init__(self, store: ClickHouseStore, enabled: bool = False) -> None:
        self.store = store
        self.enabled = enabled  # Settings.sink_native_blocks
        self._writers: dict[tuple[str, int], Any | None] = {}

    @staticmethod
    def built() -> bool:
        """treadle_native is installed with the writer, and TREADLE_NATIVE is not 0."""
        return native_codec.enabled() and hasattr(native_codec.treadle_native, "NativeBlockWriter")

    def available(self) -> bool:
        """Asked for (TREADLE_SINK_NATIVE_BLOCKS, on by default) and built."""
        return self.enabled and self.built()

    async def writer(self, table: str, schema: AvroSchema, names: tuple[str, ...]) -> Any | None:
        """The writer of `schema`'s records into `names` of `table`, or None where it does not cover them."""
        key = (table, schema.fingerprint)
        if key in self._writers:
            return self._writers[key]
        writer = None
        if self.available():
            described = await self.store.query(f"DESCRIBE TABLE {self.store.database}.{checked_identifier(table)}")
            types = {row[0]: row[1] for row in described.result_rows}
            prefix = single_object_header(schema)
            try:
                columns = [(name, types[name]) for name in names]
                writer = native_codec.treadle_native.NativeBlockWriter(json.dumps(schema.json), columns, prefix)
            except (KeyError, ValueError) as exc:
                log.info("%s records go to %s as Avro, not as Native blocks: %s", schema.name, table, exc)
        self._writers[key] = writer
        return writer
