"""Record batches to a file, one format each: Parquet (the default), Arrow IPC or JSON lines.

Each writer takes tables (pages) of one fixed schema, writes them as they come and keeps none, so an export's
memory is a page whatever its size.
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


class PageWriter(Protocol):
    def write(self, page: pa.Table) -> None: ...

    def close(self) -> None: ...


class ParquetPageWriter:
    """zstd-compressed Parquet, a row group per page (what trainers' readers split work by).

    Dictionary encoding only for `dictionary_columns` (ClickHouse's LowCardinality ones): on high-cardinality
    columns such as ids it doubled the write time and made the file larger than zstd alone.
    """

    def __init__(self, path: Path, schema: pa.Schema, dictionary_columns: list[str]) -> None:
        self._writer = pq.ParquetWriter(path, schema, compression="zstd", use_dictionary=dictionary_columns)

    def write(self, page: pa.Table) -> None:
        self._writer.write_table(page, row_group_size=max(1, page.num_rows))

    def close(self) -> None:
        self._writer.close()


class ArrowPageWriter:
    def __init__(self, path: Path, schema: pa.Schema, dictionary_columns: list[str]) -> None:
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_file(self._sink, schema)

    def write(self, page: pa.Table) -> None:
        self._writer.write_table(page)

    def close(self) -> None:
        self._writer.close()
        self._sink.close()


class JsonLinesWriter:
    """One JSON object per row; timestamps as ISO 8601 UTC, binary values as base64."""

    def __init__(self, path: Path, schema: pa.Schema, dictionary_columns: list[str]) -> None:
        self._file = path.open("wb")

    def write(self, page: pa.Table) -> None:
        for batch in page.to_batches(max_chunksize=10_000):
            rows = batch.to_pylist()
            lines = [orjson.dumps(row, default=_json_default, option=orjson.OPT_NAIVE_UTC) for row in rows]
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
    ExportFormat.PARQUET: ParquetPageWriter,
    ExportFormat.ARROW: ArrowPageWriter,
    ExportFormat.JSONL: JsonLinesWriter,
}


def open_writer(fmt: ExportFormat, path: Path, schema: pa.Schema, dictionary_columns: list[str]) -> PageWriter:
    """A writer of `fmt` to `path`; `dictionary_columns` are worth dictionary-encoding (few distinct values)."""
    return _WRITERS[ExportFormat(fmt)](path, schema, dictionary_columns)
