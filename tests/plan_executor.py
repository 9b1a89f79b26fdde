"""A `treadle.Executor` for the integration tests, run as its own process so a test can kill it with -9.

The handler is driven by the work's params: `seconds` to run, `fail_attempts` (attempts up to that number raise
InjectedFailure) and `always_fail`. Each start and end is logged as a JSON line, for the test to see what runs where.
Settings come from the environment (TREADLE_*), as for any executor.

    python -m tests.plan_executor EXECUTOR_ID CLASS GPU_MB GPUS CPU LOG_PATH
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from topics.settings import Settings
from treadle import Executor
from treadle.executor import AttemptContext, SubgoalWork


class InjectedFailure(Exception):
    """What a handler raises when the test's params tell it to fail."""


def logger(path: Path, executor_id: str):
    def log(**fields: Any) -> None:
        with path.open("a") as out:
            out.write(json.dumps({"executor": executor_id, "t": time.time(), **fields}) + "\n")

    return log


async def main(executor_id: str, resource_class: str, gpu_mb: int, gpus: int, cpu: int, log_path: Path) -> None:
    log = logger(log_path, executor_id)

    async def handle(work: SubgoalWork, ctx: AttemptContext) -> str:
        seconds = float(work.params.get("seconds", 0.3))
        log(event="start", key=work.attempt_key, seconds=seconds)
        await asyncio.sleep(seconds)
        failed = bool(work.params.get("always_fail")) or work.attempt <= int(work.params.get("fail_attempts", 0))
        log(event="end", key=work.attempt_key, failed=failed)
        if failed:
            raise InjectedFailure(f"attempt {work.attempt} fails on purpose")
        return f"test://{work.attempt_key}"

    executor = Executor(
        resource_class, handle, Settings.from_env(), executor_id=executor_id, gpu_memory_mb=gpu_mb, gpus=gpus,
        cpu=cpu, heartbeat_interval_s=0.5, valid_for_s=3.0, gpu_free_mb=lambda: None,  # the budget, not this host's GPU
    )  # fmt: skip
    async with executor:
        log(event="ready")
        await asyncio.Event().wait()  # until killed


if __name__ == "__main__":
    executor_id, cls, gpu_mb, gpus, cpu, log_path = sys.argv[1:7]
    asyncio.run(main(executor_id, cls, int(gpu_mb), int(gpus), int(cpu), Path(log_path)))
