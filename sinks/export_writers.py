"""Record batches to a file, one format each: Parquet (the default), Arrow IPC or JSON lines.

Each writer takes batches of one fixed schema, writes them as they come and keeps none, so an export's memory is
one batch whatever its size.
"""

from __future__ import annotations

import base64
import datetime as dt
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import orjson
import pyarrow as pa
import pyarrow.parquet as pq


class ExportFormat(StrEnum):
    PARQUET = "parquet"
    ARROW = "arrow"  # Arrow IPC file format (Feather v2)
    JSONL = "jsonl"


class BatchWriter(Protocol):
    def write(self, batch: pa.RecordBatch) -> None: ...

    def close(self) -> None: ...


class ParquetBatchWriter:
    """zstd-compressed Parquet, a row group per batch (what trainers' readers split work by)."""

    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self._writer = pq.ParquetWriter(path, schema, compression="zstd")

    def write(self, batch: pa.RecordBatch) -> None:
        self._writer.write_batch(batch)

    def close(self) -> None:
        self._writer.close()


class ArrowBatchWriter:
    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_file(self._sink, schema)

    def write(self, batch: pa.RecordBatch) -> None:
        self._writer.write_batch(batch)

    def close(self) -> None:
        self._writer.close()
        self._sink.close()


class JsonLinesWriter:
    """One JSON object per row; timestamps as ISO 8601 UTC, binary values as base64."""

    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self._file = path.open("wb")

    def write(self, batch: pa.RecordBatch) -> None:
        lines = [orjson.dumps(row, default=_json_default, option=orjson.OPT_NAIVE_UTC) for row in batch.to_pylist()]
        if lines:
            self._file.write(b"\n".join(lines) + b"\n")

    def close(self) -> None:
        self._file.close()


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


_WRITERS = {
    ExportFormat.PARQUET: ParquetBatchWriter,
    ExportFormat.ARROW: ArrowBatchWriter,
    ExportFormat.JSONL: JsonLinesWriter,
}


def open_writer(fmt: ExportFormat, path: Path, schema: pa.Schema) -> BatchWriter:
    return _WRITERS[ExportFormat(fmt)](path, schema)
