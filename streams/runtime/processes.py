"""Process plumbing shared by the local services: PID files, liveness, ports, logs.

The services are started detached (their own session) so they outlive `treadle up`; every later
command finds them again through a PID file, and only ever signals a PID whose command line is
still ours, so a recycled PID or someone else's broker on the same port is never touched.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

LOG_TAIL_LINES = 25
# The exit status of a sink its group refused (another sink consumes next to an embedded database): the worker does
# not restart such a child, since it would be refused again. 78 is sysexits' EX_CONFIG: fix the deployment.
SINK_REFUSED_EXIT = 78


class StackError(RuntimeError):
    """A local service could not be started or stopped; the message says what to do about it."""


@dataclass(frozen=True)
class ServiceStatus:
    """What `treadle status` shows for one service.

    `managed` is False when the service is external (REDIS_URL, TREADLE_LOCAL_KAFKA=0): then
    treadle neither starts nor stops it and `running` says nothing about it.
    """

    name: str
    managed: bool
    running: bool
    address: str
    pid: int | None = None
    log_path: Path | None = None
    data_dir: Path | None = None
    detail: str = ""


def proc_cmdline(pid: int) -> list[str] | None:
    """argv of a live process, or None when it is gone or unreadable."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def proc_cwd(pid: int) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return None


def describe_pid(pid: int, width: int = 80) -> str:
    """A short human label for a process, e.g. 'java … kafka.Kafka …/server.properties'."""
    argv = proc_cmdline(pid)
    if not argv:
        return "unknown process"
    text = " ".join(" ".join([Path(argv[0]).name, *argv[1:]]).split())  # one line, even for `python -c`
    return text if len(text) <= width else text[: width - 1] + "…"


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie; reaps it when it is our own child."""
    with contextlib.suppress(ChildProcessError, OSError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): os.kill is all we can know
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


@dataclass(frozen=True)
class PidFile:
    """A PID file plus the test that the PID in it is still the process we started."""

    path: Path
    is_ours: Callable[[int], bool]

    def read(self) -> int | None:
        try:
            return int(self.path.read_text().strip())
        except (OSError, ValueError):
            return None

    def write(self, pid: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{pid}\n")
        tmp.replace(self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def live_pid(self) -> int | None:
        """The PID when our process is running; a stale file (dead or recycled PID) is removed."""
        pid = self.read()
        if pid is None:
            if self.path.exists():
                self.remove()
            return None
        if pid_alive(pid) and self.is_ours(pid):
            return pid
        self.remove()
        return None


def spawn_detached(argv: list[str], log_path: Path) -> int:
    """Start a process in its own session with stdout+stderr appended to `log_path`; returns its PID.

    posix_spawn rather than Popen: nothing in this process should own the child (a Popen object
    would warn and try to reap a server that is meant to outlive us). Paths in argv must be absolute
    since the child keeps the caller's working directory.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, str(log_path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    try:
        return os.posix_spawn(argv[0], argv, dict(os.environ), file_actions=actions, setsid=True)
    except OSError as exc:
        raise StackError(f"could not start {argv[0]}: {exc}") from exc


def stop_pid(pid: int, timeout: float) -> bool:
    """SIGTERM, wait up to `timeout`, then SIGKILL; returns False when it had to kill."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return False


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on host:port now (TIME_WAIT leftovers do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def port_accepts(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on host:port (cheap pre-check before a client call)."""
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def listening_pid(port: int) -> int | None:
    """Best effort: the PID listening on a TCP port, from /proc/net/tcp{,6} and /proc/*/fd (Linux)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return int(proc.name)
        except OSError:
            continue
    return None


def port_taken_message(port: int, service: str, hint: str) -> str:
    pid = listening_pid(port)
    who = f"PID {pid} ({describe_pid(pid, 60)})" if pid is not None else "another process"
    return f"{service}: port {port} on 127.0.0.1 is already in use by {who}; {hint}"


def tail(path: Path, lines: int = LOG_TAIL_LINES, start: int = 0) -> str:
    """The last lines of a log, only from byte `start` on (from 0 when the log was rotated since)."""
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            start = 0 if start > size else start
            handle.seek(max(start, size - 64 * 1024))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip("\n").splitlines()[-lines:])


def log_size(path: Path) -> int:
    """Where this start's part of a log begins."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def failure(message: str, log: Path, start: int = 0, extra: tuple[Path, int] | None = None) -> StackError:
    """A StackError that names the log and quotes what this start wrote to it.

    `extra` is a second file (e.g. the JVM's stdout) quoted only when this start wrote to it.
    """
    text = tail(log, start=start)
    parts = [message, f"log: {log}" + (f"\n--- last lines of {log.name} ---\n{text}" if text else " (nothing new)")]
    if extra is not None and (more := tail(extra[0], start=extra[1])):
        parts.append(f"--- last lines of {extra[0]} ---\n{more}")
    return StackError("\n".join(parts))
