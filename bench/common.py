"""What every bench section shares: results, the private local stack, CPU pinning, subprocess helpers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from topics.settings import Settings, env_var

REPO_ROOT = Path(__file__).resolve().parents[1]

# TREADLE_BENCH_PORT_SHIFT (default 0) moves every port below, so two benchmarks can run on one machine.
_SHIFT = int(os.environ.get("TREADLE_BENCH_PORT_SHIFT", "0"))
# All below Linux's ephemeral range (32768-60999): a listener there can find its port taken by some client's socket
# (the worker's web port did: "address already in use" on 56066), and a broker port can self-connect.
BENCH_KAFKA_PORT = 29492 + _SHIFT
BENCH_CONTROLLER_PORT = 29493 + _SHIFT
BENCH_VALKEY_PORT = 29479 + _SHIFT
BENCH_WEB_PORT = 29466 + _SHIFT
BENCH_SQL_PORT = 29467 + _SHIFT  # the sink's SQL endpoint; the default (16067) is the user's own worker's
WORKER_CORE = 1


@dataclass
class Measurement:
    """One timed run: `n` items of `unit` in `elapsed_s`; `baseline` names the measurement it is compared to."""

    section: str
    name: str
    command: str
    n: int
    unit: str
    elapsed_s: float
    baseline: str | None = None
    target: float | None = None  # minimum ratio to the baseline, or minimum rate when target_is_rate
    target_is_rate: bool = False
    complete: bool = True
    notes: list[str] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)  # elapsed of every repeat, when repeated
    failed_checks: list[str] = field(default_factory=list)  # row checks that did not hold (wrong output, not slow)

    @property
    def rate(self) -> float:
        return self.n / self.elapsed_s if self.elapsed_s > 0 else float("nan")

    def to_json(self) -> dict:
        return {**asdict(self), "rate": self.rate}

    @classmethod
    def from_json(cls, doc: dict) -> Measurement:
        doc = {k: v for k, v in doc.items() if k != "rate"}
        return cls(**doc)


def median_run(section: str, name: str, command: str, n: int, unit: str, samples: list[float], **kw) -> Measurement:
    """A Measurement whose elapsed is the median of repeated runs of the same n."""
    ordered = sorted(samples)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return Measurement(section, name, command, n, unit, median, samples=list(samples), **kw)


# Settings of the bench's own stack (set by bench_settings) and connections (it starts and measures its own embedded
# chDB and Valkey): the environment does not change these; every other TREADLE_* variable reaches the worker under test.
STACK_FIELDS = (
    "home", "kafka_bootstrap_servers", "kafka_controller_port", "valkey_port", "web_port", "sql_port", "cache",
    "partitions", "topic_prefix", "app_id", "clickhouse_url", "redis_url",
)  # fmt: skip


def bench_settings(home: Path, run_id: str, partitions: int) -> Settings:
    """The private stack's settings: non-default ports, a temporary home, the repository's Kafka jar cache; the
    rest from the environment, so a tuning variable (TREADLE_PROCESS_BATCH_SIZE=16000 python -m bench...) is what the
    worker runs with. A worker's environment is rebuilt from these settings (Settings.to_env), so a variable left out
    here would be overridden by its default."""
    own: dict[str, object] = dict(
        home=home,
        kafka_bootstrap_servers=f"127.0.0.1:{BENCH_KAFKA_PORT}",
        kafka_controller_port=BENCH_CONTROLLER_PORT,
        valkey_port=BENCH_VALKEY_PORT,
        web_port=BENCH_WEB_PORT,
        sql_port=BENCH_SQL_PORT,
        cache=REPO_ROOT / ".treadle" / "cache",
        partitions=partitions,
        topic_prefix=run_id,
        app_id=run_id,
    )
    ignored = {env_var(name) for name in STACK_FIELDS}
    return Settings.from_env({k: v for k, v in os.environ.items() if k not in ignored}, **own)


def tuned_by_environment(settings: Settings) -> list[str]:
    """`VAR=value` for each setting the environment changed from its default (for the bench's header)."""
    defaults = Settings()
    tunable = [name for name in Settings.model_fields if name not in STACK_FIELDS and env_var(name) in os.environ]
    return [f"{env_var(n)}={os.environ[env_var(n)]}" for n in tunable if getattr(settings, n) != getattr(defaults, n)]


@contextmanager
def local_stack(settings: Settings) -> Iterator[float]:
    """Start Kafka + Valkey for the run (yields the start-up seconds) and always stop them."""
    from treadle.devstack.stack import LocalStack

    stack = LocalStack(settings)
    started = time.perf_counter()
    try:
        stack.up()
        yield time.perf_counter() - started
    finally:
        stack.down()


def machine_facts() -> str:
    """What moves the numbers, printed first by every bench: CPU, load, Python, the codec, library versions."""
    import platform
    from importlib import metadata

    from topics import native_codec

    cpu = "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))  # fmt: skip
    except (OSError, StopIteration):
        pass
    versions = []
    for dist in ("faust-streaming", "aiokafka", "fastavro", "chdb", "clickhouse-connect", "rocksdict"):
        try:
            versions.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{dist} missing")
    return (
        f"machine: {cpu}, {os.cpu_count()} cores, load avg {loadavg()}; {platform.python_implementation()} "
        f"{platform.python_version()}; codec: {native_codec.describe()}; {', '.join(versions)}"
    )


def loadavg() -> str:
    """The 1, 5 and 15-minute load averages, to print beside a result (other work on the machine skews it)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


# --- CPU pinning ------------------------------------------------------------------------------------------


def taskset_available() -> bool:
    return shutil.which("taskset") is not None and (os.cpu_count() or 1) > WORKER_CORE


def pinned(argv: list[str], pin: bool) -> list[str]:
    """argv on WORKER_CORE only when `pin`, else on every core (this process may be pinned off one, and children
    inherit that); taskset execs the command, so the pid is the command's own."""
    if pin:
        return ["taskset", "-c", str(WORKER_CORE), *argv]
    if taskset_available():
        return ["taskset", "-c", f"0-{(os.cpu_count() or 1) - 1}", *argv]
    return argv


def keep_off_worker_core(pin: bool) -> None:
    """Move this (bench) process off the worker's core, so it never competes with what it measures.

    Kafka and Valkey, started by this process afterwards, inherit this and stay off the worker's core too.
    """
    if pin and hasattr(os, "sched_setaffinity"):
        others = set(range(os.cpu_count() or 1)) - {WORKER_CORE}
        if others:
            os.sched_setaffinity(0, others)


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process (all its threads), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """{tid: (thread name, cpu seconds)} of every thread of a process, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            name, rest = task.joinpath("stat").read_text().rsplit(")", 1)
        except OSError:
            continue
        fields = rest.split()
        out[int(task.name)] = (name.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / tick)
    return out


def busiest_threads(
    pid: int, before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], top: int = 5
) -> str:
    """'main 8.1s, python 1.2s…': CPU used between two thread_cpu snapshots; the main thread, then by name."""
    used: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        label = "main thread" if tid == pid else f"{name} threads"
        used[label] = used.get(label, 0.0) + cpu - before.get(tid, (name, 0.0))[1]
    ranked = sorted(used.items(), key=lambda item: -item[1])[:top]
    return ", ".join(f"{name} {cpu:.1f}s" for name, cpu in ranked if cpu >= 0.05)


# --- subprocess sections -----------------------------------------------------------------------------------


def run_module(module: str, args: list[str], *, pin: bool, timeout: float, log: Path) -> list[Measurement]:
    """Run `python -m module args --out FILE` and read the Measurements it wrote; its output goes to `log`."""
    out = log.with_suffix(".json")
    argv = pinned([sys.executable, "-m", module, *args, "--out", str(out)], pin)
    with log.open("wb") as sink:
        proc = subprocess.run(argv, cwd=REPO_ROOT, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{module} exited with {proc.returncode}:\n{tail}")
    return [Measurement.from_json(doc) for doc in json.loads(out.read_text())]


def write_measurements(path: str, measurements: list[Measurement]) -> None:
    Path(path).write_text(json.dumps([m.to_json() for m in measurements]))
