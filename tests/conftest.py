"""Shared fixtures: one real Kafka broker and Valkey server per test session, and worker processes.

Everything binds 127.0.0.1 on ports away from the defaults, lives under a temporary TREADLE_HOME,
and is stopped at the end. Kafka's jars are cached in the repository's .treadle/cache (ignored).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from streams.settings import REPO_ROOT, Settings

_COUNTER = itertools.count()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """A running local stack (Kafka + Valkey); yields the base settings pointing at it."""
    from streams.local.stack import LocalStack

    home = tmp_path_factory.mktemp("stack-home")
    base = Settings(
        home=home,
        kafka_bootstrap_servers=os.environ.get("TREADLE_TEST_KAFKA", "127.0.0.1:49092"),
        kafka_controller_port=49093,
        valkey_port=46379,
        cache=REPO_ROOT / ".treadle" / "cache",
        partitions=3,
    )
    local = LocalStack(base)
    local.up()
    try:
        yield base
    finally:
        local.down()


@pytest.fixture
def deployment(stack: Settings, tmp_path: Path) -> Settings:
    """Settings for one isolated deployment: its own topic prefix, app id, home and web port."""
    from streams.worker import prepare_cluster

    n = next(_COUNTER)
    name = f"t{os.getpid()}x{n}"
    settings = stack.model_copy(
        update={
            "home": tmp_path / "home",
            "topic_prefix": name,
            "app_id": name,
            "web_port": 47000 + (os.getpid() % 500) * 2 + n % 2,
            "sql_port": 48000 + (os.getpid() % 500) * 2 + n % 2,
            "sink_flush_seconds": 0.2,
        }
    )
    asyncio.run(prepare_cluster(settings))
    return settings


class WorkerProcess:
    """`treadle worker` in a subprocess, so tests can kill -9 it like a crash would."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = settings.home / "worker.log"

    def start(self) -> WorkerProcess:
        self.settings.home.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.settings.to_env()}
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "streams.cli", "worker", "--loglevel", "info"],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def wait_ready(self, timeout: float = 90.0) -> None:
        from streams.run_info import WorkerInfo

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited with {self.proc.returncode}:\n{self.log_tail()}")
            info = WorkerInfo.read(self.settings)
            if info is not None and info.pid == self.proc.pid:
                return
            time.sleep(0.2)
        raise AssertionError(f"worker not ready after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def kill(self) -> None:
        """SIGKILL: no flush, no commit, no goodbye."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def worker_factory(deployment: Settings) -> Iterator[type[WorkerProcess]]:
    started: list[WorkerProcess] = []

    class _Factory(WorkerProcess):
        def __init__(self, settings: Settings = deployment) -> None:
            super().__init__(settings)
            started.append(self)

    yield _Factory
    for worker in started:
        worker.stop()
