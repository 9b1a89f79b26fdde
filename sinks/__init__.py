"""Where treadle's data lands and is read back: ClickHouse (embedded chDB or a server) and the read-only SQL service."""
