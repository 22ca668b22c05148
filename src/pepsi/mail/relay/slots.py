"""A relay's connections per destination, counted across the machine's workers.

Apart from the SMTP client so that a relay's options can check the folder
when a worker starts without loading smtplib and the delivery code.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from pathlib import Path

from pepsi.db.socketdir import make_private


class Slots:
    """At most `limit` connections per destination across this machine's workers.

    A slot is an exclusive lock (flock) on one of `limit` files of the
    destination; the kernel drops it when the process goes.
    """

    def __init__(self, limit: int, folder: Path | None = None) -> None:
        """RuntimeError if the folder exists and is not this user's alone (0700)."""
        self.limit = limit
        self.folder = folder or Path(tempfile.gettempdir()) / f"pepsi-relay-{os.getuid()}"
        # another user's folder could hold every slot: refused, as the socket folder is
        make_private(self.folder, os.getuid(), os.getgid(), "relay's slot directory")

    def take(self, destination: str) -> int | None:
        """A held slot (a file descriptor), or None if all `limit` are taken."""
        digest = hashlib.sha256(destination.lower().encode()).hexdigest()[:24]
        for slot in range(self.limit):
            fd = os.open(self.folder / f"{digest}.{slot}", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return fd
        return None

    @staticmethod
    def give_back(fd: int) -> None:
        os.close(fd)  # closing drops the lock
