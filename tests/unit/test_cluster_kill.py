"""The cluster harness's "host is gone": every process of the tree dies, including the
children it keeps forking (a backend forked while the tree was being killed survived
and kept a killed primary's data directory from starting again)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from pepsi.cluster.processes import kill_tree
from tests.scenarios.conftest import wait_until

# A parent that forks a short-lived child every millisecond, as a postmaster under load
# forks backends; every process carries the marker in its command line.
FORKER = """
import os, sys, time
while True:
    if os.fork() == 0:
        time.sleep(30)
        os._exit(0)
    time.sleep(0.001)
"""


def survivors(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    status = (entry / "status").read_text()
                    if "State:\tZ" not in status:  # a zombie is dead already
                        found.append(int(entry.name))
            except OSError:
                pass
    return found


def kill_a_forking_tree() -> None:
    marker = f"pepsi-kill-test-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-c", FORKER, marker])
    try:
        wait_until(lambda: len(survivors(marker)) >= 20, timeout=10, what="20 children")
        kill_tree(proc.pid)
        # SIGKILL takes effect in a moment; a child that escaped would sleep on for 30 s
        wait_until(lambda: not survivors(marker), timeout=5, what="the whole tree to die")
    finally:
        for pid in survivors(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_a_forking_tree_is_killed_whole() -> None:
    for _ in range(5):  # the race it guards against is a matter of timing
        kill_a_forking_tree()
