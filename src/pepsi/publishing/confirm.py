"""What makes a publish a confirm (R-1, Q-2): the commit, and a standby's, when required.

With synchronous replication the commit waits for a standby. If that wait is
cancelled (`pg_cancel_backend`, a statement cancel), PostgreSQL commits
locally and says so only in a WARNING: the statement succeeds, yet no
standby is known to hold the rows. A publisher must not report that as a
confirm.

A publisher-side deadline (`confirm_timeout=`) must therefore never cancel
the statement. It shuts the connection's socket down instead: the blocked
read fails at once, the backend keeps waiting and its rows stay invisible
until a standby confirms them (or for good, if it never does) — an outcome
unknown, not a local commit passed off as a confirm.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from typing import Any

import psycopg

from pepsi.errors import NotConfirmed

SAFE_AGAIN = (
    "the outcome is unknown: publish again with the same message_id and dedup=True "
    "(or use retry=) to have it exactly once"
)


class SyncRepWatch:
    """A publish's commit whose wait for a synchronous standby was cancelled.

    PostgreSQL then commits locally and says so only in a WARNING: the
    statement succeeds, but no standby is known to hold the rows. That is no
    confirm (R-1, Q-2): the publisher raises NotConfirmed (publish again with
    `dedup=True` to be sure), never the ids.
    """

    # A cancel says "canceling wait for …"; pg_terminate_backend says "canceling
    # the wait for … and terminating connection" (then the connection ends).
    PREFIXES = (
        "canceling wait for synchronous replication",
        "canceling the wait for synchronous replication",
    )

    def __init__(self) -> None:
        self.warning: str | None = None

    def __call__(self, diag: psycopg.errors.Diagnostic) -> None:
        text = diag.message_primary or ""
        if text.startswith(self.PREFIXES):
            self.warning = text

    def check(self) -> None:
        if self.warning is not None:
            raise NotConfirmed(
                f"the commit was not confirmed by a synchronous standby ({self.warning}); "
                f"it may exist on this server only: {SAFE_AGAIN}"
            )


def shut_down(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """End `conn`'s wait without telling the server: its socket is shut down, not cancelled.

    psycopg blocks in a read on the socket; shutting down a duplicate of the
    descriptor makes that read fail (EOF) in whichever thread waits, and
    leaves the descriptor itself to psycopg to close.
    """
    try:
        fd = conn.pgconn.socket
    except psycopg.OperationalError:  # already closed: nothing waits on it
        return
    with socket.socket(fileno=os.dup(fd)) as dup, contextlib.suppress(OSError):
        dup.shutdown(socket.SHUT_RDWR)  # OSError: already shut (the server went first)


class ConfirmDeadline:
    """`confirm_timeout=`: after `seconds`, `fire()` shuts the connection down.

    `fire()` runs on a timer thread (sync) or the event loop (async); `finish()`
    marks the answer as arrived, after which `fire()` does nothing. `fired`
    says whether the connection was shut down (then it must be discarded).
    """

    def __init__(self, conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.done = False
        self.fired = False

    def fire(self) -> None:
        with self.lock:
            if self.done:
                return
            self.fired = True
            shut_down(self.conn)

    def finish(self) -> None:
        with self.lock:
            self.done = True

    @staticmethod
    def error(seconds: float) -> NotConfirmed:
        return NotConfirmed(
            f"no confirm within confirm_timeout={seconds:g}s (the commit may still be waiting "
            f"for a synchronous standby; the connection was closed, not cancelled): {SAFE_AGAIN}"
        )
