"""treadle as a stranger installs it: a wheel in a fresh venv outside the checkout.

The base install must give the SDK alone (no Faust, chDB, RocksDB, matplotlib or NVML), with the schemas as package
data; the full install must run the one-machine stack, the demo and SQL with no file of the checkout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.conftest import PORT_BASE
from tests.paths import KAFKA_CACHE, REPO_ROOT

pytestmark = pytest.mark.integration

HEAVY = ("faust", "chdb", "rocksdict", "matplotlib", "pynvml")
SDK_ONLY = """
import importlib.util, json
from treadle import AgentStream, AgentStreamSync, RewardEmitter, StepRef, Settings
from topics.codec import AvroCodec
from topics.ids import uuid7
env = {"event_id": uuid7(), "session_id": "s", "agent_id": "a", "episode_id": "e", "logical_event_id": "l",
       "seq": 0, "event_time": 1, "policy_version": "", "attributes": {}}
codec = AvroCodec()  # the .avsc files, from package data
record = {"envelope": env, "source": "judge", "name": "r", "value": 1.0, "confidence": 1.0, "annotator": "CODE",
          "evidence": None}
name, decoded = codec.decode(codec.encode("treadle.events.RewardSignal", record))
print(json.dumps({"heavy": [m for m in %r if importlib.util.find_spec(m)], "decoded": decoded["value"],
                  "sync": AgentStreamSync.dispatch.__doc__ == AgentStream.dispatch.__doc__}))
"""


def _venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return path / "bin"


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO_ROOT)], cwd=out)
    (built,) = out.glob("treadle-*.whl")
    return built


def test_the_base_install_is_the_sdk_alone(wheel: Path, tmp_path: Path) -> None:
    bin_ = _venv(tmp_path / "venv")
    _run([str(bin_ / "pip"), "install", "-q", str(wheel)], cwd=tmp_path)
    result = json.loads(_run([str(bin_ / "python"), "-c", SDK_ONLY % (HEAVY,)], cwd=tmp_path))
    assert result == {"heavy": [], "decoded": 1.0, "sync": True}
    cli = subprocess.run([str(bin_ / "treadle"), "status"], cwd=tmp_path, capture_output=True, text=True)
    assert cli.returncode == 1
    assert cli.stderr.startswith("error: the treadle command needs the cli extra"), cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1


def test_the_full_install_runs_up_demo_and_sql_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    bin_ = _venv(tmp_path / "venv")
    _run([str(bin_ / "pip"), "install", "-q", f"{wheel}[all]"], cwd=tmp_path, timeout=900)
    base = PORT_BASE + 700  # clear of the session stack's ports
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("TREADLE_", "KAFKA_", "PYTHON"))},
        "KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{base}",
        "TREADLE_KAFKA_CONTROLLER_PORT": str(base + 1),
        "TREADLE_VALKEY_PORT": str(base + 2),
        "TREADLE_WEB_PORT": str(base + 3),
        "TREADLE_SQL_PORT": str(base + 4),
        "TREADLE_CACHE": str(KAFKA_CACHE),  # Kafka's jars, downloaded once per checkout
        "TREADLE_PARTITIONS": "2",
    }
    treadle = str(bin_ / "treadle")
    try:
        _run([treadle, "up"], cwd=tmp_path, env=env)
        assert (tmp_path / ".treadle").is_dir()  # TREADLE_HOME defaults to the current directory's .treadle
        _run([treadle, "demo", "--sessions", "3", "--steps", "3"], cwd=tmp_path, env=env)
        out = _run([treadle, "sql", "--json", "SELECT count() AS n FROM transitions_latest"], cwd=tmp_path,
                   env=env)  # fmt: skip
        assert json.loads(out.strip().splitlines()[-1])["n"] == 9
    finally:
        subprocess.run([treadle, "down"], cwd=tmp_path, env=env, capture_output=True, timeout=120)
