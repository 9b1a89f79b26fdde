"""`python -m bench.traced_worker`: `treadle worker` with tracemalloc on, to find what a soak's RSS growth is made of.

Every TREADLE_TRACE_EVERY_S (default 60) it appends to TREADLE_TRACE_OUT the Python heap traced so far and the 25
allocation sites that grew most since the first snapshot (taken after TREADLE_TRACE_WARMUP_S, default 60). RSS
growth that the traced total does not show is native: RocksDB, the allocator, C extensions. tracemalloc slows
allocation a lot, so compare CPU numbers only with runs without it (`python -m bench.weaving_bench --only soak
--trace-memory FILE`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import tracemalloc
from pathlib import Path

from treadle.cli import main


def _report(out: Path, every_s: float, warmup_s: float) -> None:
    time.sleep(warmup_s)
    first = tracemalloc.take_snapshot()
    started = time.monotonic()
    while True:
        time.sleep(every_s)
        snapshot = tracemalloc.take_snapshot()
        traced, peak = tracemalloc.get_traced_memory()
        lines = [f"--- {time.monotonic() - started:.0f}s after the first snapshot: traced {traced / 2**20:.1f} MiB "
                 f"(peak {peak / 2**20:.1f} MiB)"]  # fmt: skip
        for stat in snapshot.compare_to(first, "lineno")[:25]:
            lines.append(f"{stat.size_diff / 2**20:+8.2f} MiB {stat.count_diff:+9d} blocks  {stat.traceback}")
        with out.open("a") as file:
            file.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    tracemalloc.start()
    out = Path(os.environ.get("TREADLE_TRACE_OUT", "tracemalloc.txt"))
    every = float(os.environ.get("TREADLE_TRACE_EVERY_S", "60"))
    warmup = float(os.environ.get("TREADLE_TRACE_WARMUP_S", "60"))
    threading.Thread(target=_report, args=(out, every, warmup), daemon=True, name="tracemalloc-report").start()
    sys.argv = ["treadle", "worker", "--loglevel", "info"]
    main()
