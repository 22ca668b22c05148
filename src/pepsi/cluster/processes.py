"""The development cluster's processes: their pid files, whether they live, how they end.

A process this one started is kept in STARTED until reaped. `terminate`
asks (SIGTERM) and waits; `kill_tree` is the loss of a host: the process
and all its descendants SIGKILLed at once. A PostgreSQL whose pid file
outlived it, or whose pid went to another program, is not touched
(`postmaster_pid` checks the process is still a postgres).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

POLL = 0.2  # seconds between looks at the cluster's state
STOP_TIMEOUT = 30.0  # seconds Patroni gets to stop its PostgreSQL


# The processes this one started: kept so they are reaped (no zombies, and no
# "still running" warning when a Popen is collected while its server runs on).
STARTED: dict[int, subprocess.Popen[bytes]] = {}


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text(encoding="utf-8").split()[0])
    except (OSError, ValueError, IndexError):
        return None


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def postmaster_pid(data_dir: Path) -> int | None:
    """The pid in postmaster.pid if that process is still a postgres (pids get reused)."""
    pid = read_pid(data_dir / "postmaster.pid")
    try:
        return pid if b"postgres" in Path(f"/proc/{pid}/cmdline").read_bytes() else None
    except OSError:
        return None


def _children(pid: int) -> Iterator[int]:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            yield int(entry.name)


def kill_tree(pid: int | None) -> None:
    """SIGKILL a process and its descendants.

    Stopped first, it forks nothing between the listing of its descendants and the
    kill: a backend the postmaster forked in that moment survived, waited forever on a
    lock a killed process held, and kept the data directory from starting again (a
    killed primary that never rejoined).
    """
    if pid is None:
        return
    if alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        _wait_stopped(pid)
        family = [pid]
        index = 0
        while index < len(family):
            family.extend(_children(family[index]))
            index += 1
        for member in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(member, signal.SIGKILL)
    _reap(pid)


def _wait_stopped(pid: int, timeout: float = 2.0) -> None:
    """Until `pid` is stopped (a signal takes effect at its next entry to the kernel)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return  # gone
        if state in ("T", "t", "Z", "X"):
            return
        time.sleep(0.001)


def terminate(pid: int | None, timeout: float) -> None:
    if pid is None:
        return
    if alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(POLL)
        if alive(pid):
            kill_tree(pid)
    _reap(pid)


def _reap(pid: int) -> None:
    """Collect our own child's exit status, so it is not left a zombie."""
    process = STARTED.pop(pid, None)
    if process is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_TIMEOUT)


def stop_orphan_postmaster(data_dir: Path) -> None:
    """A PostgreSQL left running without its Patroni (killed Patroni): stop it hard."""
    kill_tree(postmaster_pid(data_dir))
