"""One RocksDB memory budget for all the tables and partitions of a worker (Kafka Streams' bounded-memory setup).

Faust opens one RocksDB per table partition, each with a block cache and memtables of its own, so a worker's
memory grew with its partitions and tables, and kept growing for many minutes while every cache filled: in the
weaving soak RocksDB held 100-120 MB after 10 minutes of a 256 MB bound, still rising by ~2.5 MB/min, most of the
worker's RSS growth. Here every database shares one LRU block cache, and a write buffer manager charges their
memtables to that same cache, so RocksDB stays near TREADLE_TABLE_MEMORY_MB whatever the number of partitions,
and reaches it early (the same soak: 55-62 MB from minute 2 on, RSS +1.3 MB/min instead of +3.4). See Kafka
Streams' "RocksDB: bounded memory usage" (docs/streams/developer-guide/memory-mgmt) and RocksDB's wiki page
"Write Buffer Manager".

The tables write no RocksDB write-ahead log, as Kafka Streams' stores do not: the changelog topic is the source of
truth. A worker killed mid-write loses its unflushed memtables, and RocksDB reopens at its last flush (one column
family: a prefix of the writes, the persisted changelog offset included), from where Faust's recovery replays the
changelog. The WAL cost ~7 us of every put of a ~2.7 KB step: 9.8 us per put with it, 2.9 without (40,000 puts in
a loop, rocksdict 0.3.29).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import rocksdict
from faust.stores.rocksdb import RocksDBOptions

MIB = 1024 * 1024


class RocksDBMemory:
    """The shared block cache and write buffer manager of one worker; `total_bytes` bounds both together."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.cache = rocksdict.Cache(total_bytes)
        # Memtables may take half the budget before RocksDB flushes the largest; no stall (allow_stall=False).
        self.write_buffers = rocksdict.WriteBufferManager.new_write_buffer_manager_with_cache(
            total_bytes // 2, False, self.cache
        )

    def options(self) -> RocksDBOptions:
        """Faust's RocksDB options for one table, drawing on this budget."""
        return _SharedMemoryOptions(self)

    def usage_bytes(self) -> int:
        """What the cache holds now: data blocks, and the memtables charged to it."""
        return self.cache.get_usage()


_WITHOUT_WAL = rocksdict.WriteOptions()
_WITHOUT_WAL.disable_wal = True


class _SharedMemoryOptions(RocksDBOptions):
    def __init__(self, memory: RocksDBMemory) -> None:
        # A memtable is switched at write_buffer_size; the write buffer manager bounds all of them together.
        super().__init__(
            write_buffer_size=max(MIB, memory.total_bytes // 16), max_write_buffer_number=2, use_rocksdict=True
        )
        self.memory = memory

    def open(self, path: Path, *, read_only: bool = False) -> Any:
        """Faust's open, then no write-ahead log for this database's writes (see the module docstring)."""
        db = super().open(path, read_only=read_only)
        if not read_only:
            db.set_write_options(_WITHOUT_WAL)
        return db

    def as_options(self) -> Any:
        """Faust's options for the rocksdict driver, with the shared cache and write buffer manager."""
        options = rocksdict.Options(raw_mode=True)
        options.create_if_missing(True)
        options.set_max_open_files(self.max_open_files)
        options.set_write_buffer_size(self.write_buffer_size)
        options.set_target_file_size_base(self.target_file_size_base)
        options.set_max_write_buffer_number(self.max_write_buffer_number)
        table = rocksdict.BlockBasedOptions()
        table.set_bloom_filter(self.bloom_filter_size, True)
        table.set_block_cache(self.memory.cache)
        # Index and filter blocks stay with the table readers (a few hundred KB per worker, as the per-partition
        # caches had them): in a small shared cache they would be evicted, and every lookup of a new step (a
        # miss, answered by the bloom filter) would read and parse them again.
        table.set_cache_index_and_filter_blocks(False)
        table.set_index_type(rocksdict.BlockBasedIndexType.binary_search())
        options.set_block_based_table_factory(table)
        options.set_write_buffer_manager(self.memory.write_buffers)
        return options
