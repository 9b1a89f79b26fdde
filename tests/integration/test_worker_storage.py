"""What a worker writes, and how: its RocksDB tables skip the write-ahead log (the changelog is the source of truth,
streams/runtime/rocksdb_memory.py), and its producer compresses record batches (TREADLE_OUTPUT_COMPRESSION).

Recovery from the changelog after a kill -9 is tested end to end in tests/test_pipeline.py and
tests/test_weaving_pipeline.py, which run with these defaults.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from faust.stores.rocksdb import RocksDBOptions

from streams.runtime.app import build_pipeline
from streams.runtime.rocksdb_memory import MIB, RocksDBMemory
from tests.paths import REPO_ROOT
from topics.settings import Settings

WRITE_THEN_DIE = """
import os, sys
from pathlib import Path
from tests.integration.test_worker_storage import options

db = options(sys.argv[2]).open(Path(sys.argv[1]))
db.put(b"flushed", b"1")
db.flush()
db.put(b"unflushed", b"2")
os._exit(0)  # no close, no flush: what a kill -9 leaves
"""


def options(kind: str) -> RocksDBOptions:
    """The worker's table options ("shared": one memory budget, no WAL), or Faust's own."""
    return RocksDBMemory(8 * MIB).options() if kind == "shared" else RocksDBOptions(use_rocksdict=True)


def _after_a_hard_exit(path: Path, kind: str) -> tuple[bytes | None, bytes | None]:
    subprocess.run([sys.executable, "-c", WRITE_THEN_DIE, str(path), kind], check=True, timeout=60, cwd=REPO_ROOT)
    reopened = options(kind).open(path)
    try:
        return reopened.get(b"flushed"), reopened.get(b"unflushed")
    finally:
        reopened.close()


def test_the_worker_tables_write_no_wal_so_a_hard_exit_keeps_only_flushed_writes(tmp_path: Path) -> None:
    assert _after_a_hard_exit(tmp_path / "ours", "shared") == (b"1", None)
    # Faust's own options keep a WAL, which replays the unflushed write: the check above can tell the difference.
    assert _after_a_hard_exit(tmp_path / "fausts", "faust") == (b"1", b"2")


@pytest.mark.parametrize(("setting", "codec"), [("zstd", "zstd"), ("lz4", "lz4"), ("none", None)])
def test_the_worker_producer_compresses_as_configured(tmp_path: Path, setting: str, codec: str | None) -> None:
    settings = Settings(home=tmp_path, output_compression=setting)  # type: ignore[arg-type]
    assert build_pipeline(settings, processors=[]).app.conf.producer_compression_type == codec


@pytest.mark.parametrize("fetch_min_bytes", [1, 16_384])
def test_the_worker_consumer_fetches_with_the_configured_minimum(tmp_path: Path, fetch_min_bytes: int) -> None:
    app = build_pipeline(Settings(home=tmp_path, worker_fetch_min_bytes=fetch_min_bytes), processors=[]).app

    async def made() -> int:  # the aiokafka consumer the worker's consumer thread builds (not started)
        return app.consumer._thread._create_worker_consumer(app.transport)._fetch_min_bytes

    assert asyncio.run(made()) == fetch_min_bytes


def test_zstd_is_the_default_and_its_codec_is_installed() -> None:
    from aiokafka.codec import has_zstd

    assert Settings().output_compression == "zstd"
    assert has_zstd()
