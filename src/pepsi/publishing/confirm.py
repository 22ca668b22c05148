"""What makes a publish a confirm (R-1, Q-2): the commit, and a standby's, when required.

With synchronous replication the commit waits for a standby. If that wait is
cancelled (`pg_cancel_backend`, a statement cancel), PostgreSQL commits
locally and says so only in a WARNING: the statement succeeds, yet no
standby is known to hold the rows. A publisher must not report that as a
confirm.
"""

from __future__ import annotations

import psycopg

from pepsi.errors import NotConfirmed


class SyncRepWatch:
    """A publish's commit whose wait for a synchronous standby was cancelled.

    PostgreSQL then commits locally and says so only in a WARNING: the
    statement succeeds, but no standby is known to hold the rows. That is no
    confirm (R-1, Q-2): the publisher raises NotConfirmed (publish again with
    `dedup=True` to be sure), never the ids.
    """

    PREFIX = "canceling wait for synchronous replication"

    def __init__(self) -> None:
        self.warning: str | None = None

    def __call__(self, diag: psycopg.errors.Diagnostic) -> None:
        text = diag.message_primary or ""
        if text.startswith(self.PREFIX):
            self.warning = text

    def check(self) -> None:
        if self.warning is not None:
            raise NotConfirmed(
                f"the commit was not confirmed by a synchronous standby ({self.warning}); "
                "it may exist on this server only: publish again with dedup=True"
            )
