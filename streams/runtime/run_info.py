"""Small JSON files a running process leaves under <home>/worker so other processes can find it.

Each is written atomically when the process is ready, and read back only while its PID is alive
(a zombie counts as gone), so a crashed process's file is never mistaken for a live one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import ClassVar, Self

from streams.runtime.processes import pid_alive
from topics.settings import Settings


@dataclass(frozen=True)
class RunInfo:
    file_name: ClassVar[str]
    pid: int

    @classmethod
    def path(cls, settings: Settings):
        return settings.worker_dir / cls.file_name

    def write(self, settings: Settings) -> None:
        path = self.path(settings)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)

    @classmethod
    def read(cls, settings: Settings) -> Self | None:
        try:
            info = cls(**json.loads(cls.path(settings).read_text()))
        except (OSError, ValueError, TypeError):
            return None
        return info if pid_alive(info.pid) else None


@dataclass(frozen=True)
class WorkerInfo(RunInfo):
    """worker.json: written once a worker (and its sink child) is ready."""

    file_name: ClassVar[str] = "worker.json"
    web_port: int
    embedded_clickhouse: bool


@dataclass(frozen=True)
class FirstInput(RunInfo):
    """first-input.json: when a worker read its first input record (Unix time) and its process CPU seconds then.

    A benchmark of a backlog starts its clock and its CPU count here: a worker reads input before it is ready
    (while its sink starts), so timing from WorkerInfo would leave those records out."""

    file_name: ClassVar[str] = "first-input.json"
    read_at: float
    cpu_s: float


@dataclass(frozen=True)
class SqlEndpoint(RunInfo):
    """sql.json: written by the process that owns ClickHouse (the sink) while it serves SQL."""

    file_name: ClassVar[str] = "sql.json"
    port: int


@dataclass(frozen=True)
class SinkRefusal(RunInfo):
    """sink-refused.json: a sink its group refused (sinks.sink_group) leaves why, under its worker's pid, so that
    `treadle sql` on this home says where the rows are instead of waiting for a sink that will not come."""

    file_name: ClassVar[str] = "sink-refused.json"
    reason: str
