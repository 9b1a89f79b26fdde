"""A session's state graph as ClickHouse holds its history: the graph at a version or time, and diffs."""
