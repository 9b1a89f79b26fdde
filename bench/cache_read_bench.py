"""Latest-state read benchmark: `python -m bench.cache_read_bench [--nodes 1000,10000,100000] [--runs 15]`.

One session of N nodes (a tenth with a TTL) and N edges, written to the bundled Valkey (on its own port, under a
temporary home) by StateCache.write_snapshot, as the worker rebuilds a session. p50 and p99 of StateCache.read
(what `await stream.state()` runs), beside, same run, same data:

- floor: the read's Redis round trip alone (the three HGETALLs and the expiring set, in one MULTI): what Redis and
  redis-py's reply parser cost before any node is looked at;
- every node and edge touched: the read, then each node and edge built (what the reader before 2026-12-03 did up
  front, and what a caller that walks the whole graph still pays).

The first line says whether redis-py parses replies with hiredis (a worker and sink dependency; without it the
floor is ~8x slower here).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench.common import BENCH_VALKEY_PORT, bench_settings, loadavg, machine_facts
from bench.weaving_report import percentile
from processors.state.cache import StateCache, _keys, connect
from processors.state.graph import EdgeRec, NodeRec

SESSION = "bench-cache"


def _session(n: int, now_us: int) -> tuple[dict[str, Any], list[tuple[str, NodeRec]], list[tuple[Any, EdgeRec]]]:
    nodes = [
        (f"file:{i}", NodeRec("file", f'{{"path":"src/f{i}.py","hash":"h{i}","size":{i}}}', i, now_us,
                              now_us + 3_600_000_000 if i % 10 == 0 else None, "write_file"))
        for i in range(n)
    ]  # fmt: skip
    edges = [((f"action:{i // 5}", f"file:{i}", "causes"), EdgeRec("{}", i, now_us)) for i in range(n)]
    meta = {"ordinal": n, "version_id": f"{SESSION}.{n}.x", "time": now_us, "node_count": n, "edge_count": n}
    return meta, nodes, edges


async def _timed(run: Callable[[], Awaitable[Any]], runs: int) -> tuple[float, float]:
    await run()  # warm: the connection, the script cache
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        await run()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), percentile(times, 99)


def _reads(cache: StateCache, n: int, now_us: int) -> list[tuple[str, Callable[[], Awaitable[Any]]]]:
    """The three ways of reading the session of `n` nodes, labelled."""
    meta_key, nodes_key, edges_key, expiring_key = _keys(cache.prefix, SESSION)

    async def read() -> None:
        graph = await cache.read(SESSION)
        assert graph is not None and len(graph.nodes) == n and len(graph.edges) == n

    async def floor() -> None:
        pipe = cache.client.pipeline(transaction=True)
        pipe.hgetall(meta_key)
        pipe.hgetall(nodes_key)
        pipe.hgetall(edges_key)
        pipe.zrangebyscore(expiring_key, "-inf", now_us)
        await pipe.execute()

    async def touch_all() -> None:
        graph = await cache.read(SESSION)
        assert graph is not None
        assert sum(1 for _ in graph.nodes.values()) == n and sum(1 for _ in graph.edges) == n

    return [("StateCache.read (stream.state())", read), ("  floor: the Redis round trip alone", floor),
            ("  read, every node and edge touched", touch_all)]  # fmt: skip


async def _measure(cache: StateCache, sizes: list[int], runs: int) -> list[str]:
    lines = []
    for n in sizes:
        now_us = int(time.time() * 1_000_000)
        await cache.write_snapshot(SESSION, *_session(n, now_us))
        lines.append(f"{n:>9,} nodes + {n:,} edges:")
        p50s = []
        for label, run in _reads(cache, n, now_us):
            p50, p99 = await _timed(run, runs)
            p50s.append(p50)
            lines.append(f"  {label:<40} p50 {p50:8.1f} ms  p99 {p99:8.1f} ms")
        lines.append(f"  read / floor {p50s[0] / p50s[1]:.2f}x at p50")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", default="1000,10000,100000", help="session sizes, comma-separated")
    parser.add_argument("--runs", type=int, default=15, help="timed runs per read; p50 and p99 shown (15)")
    args = parser.parse_args()
    from redis.utils import HIREDIS_AVAILABLE

    from treadle.devstack.valkey import LocalValkey

    print(machine_facts())
    print(f"redis-py reply parser: {'hiredis' if HIREDIS_AVAILABLE else 'pure Python (hiredis not installed)'}; "
          f"load {loadavg()}")  # fmt: skip
    with tempfile.TemporaryDirectory() as home:
        settings = bench_settings(Path(home), f"cachebench{int(time.time())}", 1)
        settings = settings.model_copy(update={"valkey_port": BENCH_VALKEY_PORT, "redis_url": None})
        valkey = LocalValkey(settings)
        valkey.up()
        try:

            async def run() -> list[str]:
                client = connect(settings)
                try:
                    return await _measure(StateCache(client, settings.topic_prefix), sizes, args.runs)
                finally:
                    await client.aclose()

            sizes = [int(s) for s in args.nodes.split(",")]
            for line in asyncio.run(run()):
                print(line)
        finally:
            valkey.down()


if __name__ == "__main__":
    main()
