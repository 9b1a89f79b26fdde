"""`treadle worker` as a background process: started detached, awaited until ready, stopped by group.

The demo, the tests (which kill -9 it like a crash would) and the benchmarks all run workers this way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from streams.runtime.processes import StackError
from streams.runtime.run_info import WorkerInfo
from topics.settings import Settings


class WorkerProcess:
    """One worker (and its sink child) in its own process group, logging to `log_path`."""

    def __init__(
        self,
        settings: Settings,
        log_path: Path | None = None,
        *,
        env: dict[str, str] | None = None,
        argv_prefix: list[str] | None = None,
        command: list[str] | None = None,
    ) -> None:
        self.settings = settings
        self.log_path = log_path or settings.logs_dir / "worker.log"
        self.env = env or {}
        self.argv_prefix = argv_prefix or []  # e.g. ["taskset", "-c", "1"]
        self.command = command or [sys.executable, "-m", "treadle.cli", "worker", "--loglevel", "info"]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "start() first"
        return self.proc.pid

    def start(self) -> WorkerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [*self.argv_prefix, *self.command],
                env={**os.environ, **self.settings.to_env(), **self.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Seconds until the worker announced itself (after recovery, with its sink serving SQL)."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise StackError(f"the worker exited with code {code}; see {self.log_path}\n{self.log_tail()}")
            info = WorkerInfo.read(self.settings)
            if info is not None and info.pid == self.proc.pid:
                return time.monotonic() - started
            time.sleep(0.2)
        raise StackError(f"the worker was not ready after {timeout:.0f} s; see {self.log_path}\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def kill(self) -> None:
        """SIGKILL to the whole group (worker and sink): no flush, no commit, like a crash."""
        self._signal(signal.SIGKILL, wait=10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s."""
        try:
            self._signal(signal.SIGTERM, wait=30)
        except subprocess.TimeoutExpired:
            self.kill()

    def _signal(self, sig: signal.Signals, wait: float) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(wait)
