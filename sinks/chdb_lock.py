"""Say who holds an embedded chDB data path, since chDB's own error does not.

chDB runs one embedded ClickHouse server per data path. On open it writes `<path>/status`
("PID: …", "Started at: …") and takes an exclusive flock on it; a second process fails with the
opaque "Error initializing EmbeddedServer" while the real cause ("Cannot lock file …/status")
only reaches stderr. `explain_locked_path` checks that lock and names the holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from pathlib import Path

from streams.runtime.processes import describe_pid, pid_alive, proc_cmdline

STATUS_FILE = "status"


def _lock_holders(status: Path) -> list[int] | None:
    """PIDs with a lock on `status` per /proc/locks; None when /proc/locks cannot be read."""
    try:
        st = status.stat()
        locks = Path("/proc/locks").read_text()
    except OSError:
        return None
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    holders = []
    for line in locks.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 3836 fe:00:9986797 0 EOF"; blocked waiters are "1: -> FLOCK …"
        if len(fields) >= 6 and fields[1] != "->" and fields[5] == dev and fields[4].isdigit():
            holders.append(int(fields[4]))
    return holders


def _is_locked(status: Path) -> bool:
    """Probe chDB's flock; released at once. Works on every filesystem, unlike matching /proc/locks."""
    try:
        fd = os.open(status, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _status_pid(status: Path) -> int | None:
    with contextlib.suppress(OSError):
        match = re.search(r"^PID:\s*(\d+)", status.read_text(errors="replace"), re.MULTILINE)
        if match:
            return int(match.group(1))
    return None


def _label(pid: int) -> str:
    """'treadle worker' for our own commands, 'this process' for the caller, else its command line."""
    if pid == os.getpid():
        return "this process"
    argv = proc_cmdline(pid) or []
    text = " ".join(argv)
    if "treadle" in text or "streams." in text:
        role = next((arg for arg in argv[1:] if arg in {"worker", "sql", "up", "sink", "replay"}), None)
        return f"treadle {role}" if role else "treadle"
    return describe_pid(pid, 60)


def explain_locked_path(path: str | os.PathLike[str]) -> str | None:
    """A one-line explanation when another live process holds the chDB data at `path`, else None.

    Call it after opening chDB failed: a message means "it is locked, by this PID"; None means the
    failure has another cause and the original error should be shown.
    """
    root = Path(path)
    status = root / STATUS_FILE
    if not status.is_file():
        return None
    if not _is_locked(status):
        return None
    holders = _lock_holders(status) or []
    written = _status_pid(status)
    live = [pid for pid in holders if pid_alive(pid)]
    if written is not None and (written in live or (not live and pid_alive(written))):
        pid: int | None = written
    else:
        pid = live[0] if live else None
    who = f"PID {pid} ({_label(pid)})" if pid is not None else "another process"
    return (
        f"chDB data at {root} is in use by {who}; chDB allows one process per data path: stop it with "
        "`treadle down` or query through it with `treadle sql`"
    )
