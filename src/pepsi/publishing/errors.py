"""Why a publish was refused. Nothing is written when one of these is raised."""

from __future__ import annotations

from pepsi.errors import PepsiError


class NoRoute(PepsiError):
    """No such stage (RabbitMQ's `mandatory` / 312 NO_ROUTE)."""

    exit_code = 67  # EX_NOUSER: addressee unknown


class Rejected(PepsiError):
    """The stage is full and refuses publishes (MAX_LENGTH, reject-publish: a nack)."""

    exit_code = 75  # EX_TEMPFAIL: try again later

    def __init__(self, message: str, stage: str | None = None) -> None:
        super().__init__(message)
        self.stage = stage


class InvalidMessage(PepsiError):
    """A message that cannot be published as given (bad address, size, encoding …)."""

    exit_code = 65  # EX_DATAERR


class NotConfirmed(PepsiError):
    """The connection was lost before the commit was confirmed.

    The batch may or may not have been committed: publishing it again is
    safe with `dedup=True`, and may otherwise create duplicates (R-1, R-6).
    """

    exit_code = 74  # EX_IOERR
