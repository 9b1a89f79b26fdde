"""Shared fixtures: one real Kafka broker and Valkey server per test session, and worker processes.

Everything binds 127.0.0.1 on ports away from the defaults, lives under a temporary TREADLE_HOME,
and is stopped at the end. Kafka's jars are cached in the repository's .treadle/cache (ignored).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.factories import isolated_deployment
from tests.paths import REPO_ROOT
from topics.settings import Settings
from treadle.devstack.worker_process import WorkerProcess

_COUNTER = itertools.count()
# Two pytest sessions on one machine (a helper's and CI's, say) need different ports: set this to e.g. 21000.
PORT_BASE = int(os.environ.get("TREADLE_TEST_PORT_BASE", "31000"))


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """A running local stack (Kafka + Valkey); yields the base settings pointing at it."""
    from treadle.devstack.stack import LocalStack

    home = tmp_path_factory.mktemp("stack-home")
    base = Settings(
        home=home,
        # Below Linux's ephemeral range (32768-60999): a client retrying a stopped broker can otherwise
        # self-connect from the broker's own port and leave a TIME_WAIT that blocks the next bind.
        kafka_bootstrap_servers=os.environ.get("TREADLE_TEST_KAFKA", f"127.0.0.1:{PORT_BASE + 92}"),
        kafka_controller_port=PORT_BASE + 93,
        valkey_port=PORT_BASE + 379,
        cache=REPO_ROOT / ".treadle" / "cache",
        partitions=3,
    )
    local = LocalStack(base)
    try:
        local.up()
        yield base
    finally:
        local.down()  # also when up() failed halfway: Valkey may be running already


@pytest.fixture
def deployment(stack: Settings, tmp_path: Path) -> Settings:
    """Settings for one isolated deployment: its own topic prefix, app id, home and web port."""
    n = next(_COUNTER)
    # Both port ranges sit below PORT_BASE, clear of the broker's and Valkey's ports above it.
    slot = (os.getpid() % 200) * 2 + n % 2
    return isolated_deployment(
        stack, tmp_path / "home", f"t{os.getpid()}x{n}", PORT_BASE - 1000 + slot, PORT_BASE - 500 + slot
    )


@pytest.fixture
def worker_factory(deployment: Settings) -> Iterator[type[WorkerProcess]]:
    started: list[WorkerProcess] = []

    class _Factory(WorkerProcess):
        def __init__(self, settings: Settings = deployment) -> None:
            super().__init__(settings, settings.home / "worker.log")
            started.append(self)

    yield _Factory
    for worker in started:
        worker.stop()
