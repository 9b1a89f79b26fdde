"""The versioned state graph: the pure fold, its RocksDB store, the Redis copy of the latest state, the processor."""
