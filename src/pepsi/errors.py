"""Domain errors, exit codes, and the one classifier of database errors.

Every error Pepsi raises for a user to read derives from `PepsiError` and
renders as one line; the CLI prints it and exits with `exit_code`, never a
traceback. A psycopg error is turned into a domain error here, by SQLSTATE
(DESIGN.md §4), and nowhere else: `classify()`.

This module stays importable without the driver: it reads `.sqlstate` and
imports psycopg only inside `classify()`.
"""

from __future__ import annotations

# Exit statuses (sysexits.h where one fits).
EX_OK = 0
EX_ERROR = 1
EX_USAGE = 2  # argparse's own status for a bad command line
EX_DATAERR = 65  # a message that cannot be published as given
EX_NOUSER = 67  # no such stage
EX_IOERR = 74  # database connection lost (worker: while processing)
EX_TEMPFAIL = 75  # connection limit exhausted, or a stage full: try again later
EX_CONFIG = 78  # stage graph invalid, or database schema of another version
EX_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)


class PepsiError(Exception):
    """Root of every error Pepsi reports to a user."""

    exit_code: int = EX_ERROR


class UsageError(PepsiError):
    """A command line that cannot be run as given (argparse's own status, 2)."""

    exit_code = EX_USAGE


class ConfigError(PepsiError):
    """A configuration file, section or key that cannot be used.

    Renders as `FILE: [SECTION] KEY: problem`, naming as much of the location
    as is known.
    """

    def __init__(
        self,
        problem: str,
        *,
        file: str | None = None,
        section: str | None = None,
        key: str | None = None,
    ) -> None:
        self.problem = problem
        self.file = file
        self.section = section
        self.key = key
        super().__init__(str(self))

    def __str__(self) -> str:
        where = []
        if self.file:
            where.append(f"{self.file}:")
        if self.section:
            where.append(f"[{self.section}]")
        if self.key:
            where.append(f"{self.key}:")
        return " ".join([*where, self.problem])


# -- the database ------------------------------------------------------------------------


class DatabaseUnavailable(PepsiError):
    """The database could not be reached (server down, bad DSN, refused login): exit 1.

    The subclasses say what happened to a session that was working: lost (74),
    busy (75), read-only (74, reconnect to find the primary).
    """

    def __init__(self, message: str, *, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class DatabaseLost(DatabaseUnavailable):
    """The connection went: SQLSTATE class 08, 57P01-57P05, an I/O failure (exit 74)."""

    exit_code = EX_IOERR


class DatabaseBusy(DatabaseUnavailable):
    """The connection limit is exhausted (53300) or a pool had none to give (exit 75)."""

    exit_code = EX_TEMPFAIL


class DatabaseReadOnly(DatabaseLost):
    """Connected to a node that no longer takes writes (a standby, recovery): reconnect."""


class SchemaMismatch(PepsiError):
    """The database schema is missing or not the one this build expects."""

    exit_code = EX_CONFIG


# -- operating the queue (pepsi.admin) -------------------------------------------------


class QueueError(PepsiError):
    """A request about the queue that cannot be done as asked; nothing was changed."""


class NoSuchMessage(QueueError):
    """The message asked for is not in the queue."""


class RepairRefused(QueueError):
    """A repair that cannot be done as asked; nothing was changed."""


class UnknownStage(RepairRefused):
    """A repair names a stage the configuration does not have."""


class NotEmbedded(PepsiError):
    """An action on the embedded server while a DSN names another one."""


# -- publishing (pepsi.publishing); nothing is written when one is raised ----------------


class NoRoute(PepsiError):
    """No such stage (RabbitMQ's `mandatory` / 312 NO_ROUTE)."""

    exit_code = EX_NOUSER


class Rejected(PepsiError):
    """The stage is full and refuses publishes (MAX_LENGTH, reject-publish: a nack)."""

    exit_code = EX_TEMPFAIL

    def __init__(self, message: str, stage: str | None = None) -> None:
        super().__init__(message)
        self.stage = stage


class InvalidMessage(PepsiError):
    """A message that cannot be published as given (bad address, size, encoding …)."""

    exit_code = EX_DATAERR


class NotConfirmed(DatabaseLost):
    """The connection was lost before the commit was confirmed.

    The batch may or may not have been committed: publishing it again is
    safe with `dedup=True`, and may otherwise create duplicates (R-1, R-6).
    """


class PublishFailed(PepsiError):
    """The database refused the publish for a reason of its own (not full, not lost).

    For example a statement timeout, or a caller's transaction already
    aborted (`connection=`). `sqlstate` says which; nothing was published.
    """

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class NotOpen(PepsiError):
    """A publisher used before `open()` (or a with block), or after `close()`."""


# -- the dispatcher and the worker ------------------------------------------------------


class AlreadyRunning(PepsiError):
    """Another dispatcher holds the singleton lock (P-1)."""


class WorkerRefused(ConfigError):
    """The worker cannot run this stage as configured: exit 78 before ready (W-7)."""

    exit_code = EX_CONFIG


# -- the classifier ------------------------------------------------------------------------

# The server ended the session: admin/crash shutdown, cannot connect now, database
# dropped, idle session timeout, idle-in-transaction timeout.
_LOST_STATES = frozenset({"57P01", "57P02", "57P03", "57P04", "57P05", "25P03"})
_READ_ONLY_STATES = frozenset({"25006"})  # read_only_sql_transaction: a standby, or recovery
_READ_ONLY_HINTS = (
    "recovery is in progress",
    "during recovery",
    "conflict with recovery",
    "in recovery mode",  # at connect time, no SQLSTATE: a standby without hot_standby
)
_BUSY_STATES = frozenset({"53300"})  # too_many_connections
# A refusal at connect time carries no SQLSTATE (libpq gives only the text).
_BUSY_HINTS = ("too many clients", "too many connections", "connection slots are reserved")


def one_line(exc: BaseException) -> str:
    """An exception's message folded onto one line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return "; ".join(lines) if lines else type(exc).__name__


def classify(exc: BaseException) -> DatabaseUnavailable | None:
    """The domain error a database error stands for; None for anything else.

    DatabaseBusy for 53300 or a pool timeout, DatabaseReadOnly for 25006 and
    hot-standby refusals, DatabaseLost for class 08, 57P01-57P05, 25P03 and an
    OperationalError/InterfaceError without SQLSTATE (an I/O or TLS failure,
    no server answer). None: not the database's fault (a constraint, a
    syntax error, a cancelled statement …) — the caller's host failure or bug.
    A DatabaseUnavailable is returned as it is.
    """
    if isinstance(exc, DatabaseUnavailable):
        return exc
    if _is_pool_timeout(exc):
        return DatabaseBusy(f"no database connection available: {one_line(exc)}")
    kind = _kind(exc)
    if kind is None:
        return None
    error, what = kind
    return error(f"{what}: {one_line(exc)}", sqlstate=getattr(exc, "sqlstate", None))


def _kind(exc: BaseException) -> tuple[type[DatabaseUnavailable], str] | None:
    try:
        import psycopg  # noqa: PLC0415  # errors.py stays importable without the driver
    except ImportError:  # pragma: no cover - the driver is a dependency
        return None
    if not isinstance(exc, psycopg.Error):
        return None
    code = exc.sqlstate
    text = str(exc).lower()
    if code in _BUSY_STATES or any(hint in text for hint in _BUSY_HINTS):
        return DatabaseBusy, "database connection limit reached"
    if code in _READ_ONLY_STATES or any(hint in text for hint in _READ_ONLY_HINTS):
        return DatabaseReadOnly, "database is read-only (not the primary)"
    if code is None:  # no server answer: an I/O or TLS failure, or a client-side mistake
        lost = isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
    else:
        lost = code.startswith("08") or code in _LOST_STATES
    return (DatabaseLost, "database connection lost") if lost else None


def _is_pool_timeout(exc: BaseException) -> bool:
    try:
        from psycopg_pool import PoolTimeout  # noqa: PLC0415  # optional until publishing
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, PoolTimeout)


def is_reconnect(exc: BaseException) -> bool:
    """Whether the cure is a new connection (after a delay): lost, busy, read-only, refused.

    False for everything else, including a database error that a new
    connection would only repeat (a constraint, a syntax error).
    """
    return classify(exc) is not None


def is_unwritten(exc: BaseException) -> bool:
    """Whether the failed work surely wrote nothing: trying it again cannot duplicate it.

    True for no connection at all (refused, busy, a pool timeout) and a
    read-only node (25006, recovery): the statement never ran on a primary.
    False for a connection lost while the statement ran (its commit may have
    happened: `NotConfirmed`) and for everything not the database's fault.
    """
    error = classify(exc)
    if error is None or isinstance(error, NotConfirmed):
        return False
    return isinstance(error, DatabaseReadOnly) or not isinstance(error, DatabaseLost)


def database_exit_code(exc: BaseException) -> int | None:
    """A worker's status for `exc`: 74 (lost, read-only), 75 (busy), None (host failure).

    A plain DatabaseUnavailable (could not connect) counts as lost.
    """
    error = classify(exc)
    if error is None:
        return None
    return error.exit_code if isinstance(error, DatabaseLost | DatabaseBusy) else EX_IOERR


__all__ = [
    "EX_CONFIG",
    "EX_DATAERR",
    "EX_ERROR",
    "EX_INTERRUPTED",
    "EX_IOERR",
    "EX_NOUSER",
    "EX_OK",
    "EX_TEMPFAIL",
    "EX_USAGE",
    "AlreadyRunning",
    "ConfigError",
    "DatabaseBusy",
    "DatabaseLost",
    "DatabaseReadOnly",
    "DatabaseUnavailable",
    "InvalidMessage",
    "NoRoute",
    "NoSuchMessage",
    "NotConfirmed",
    "NotEmbedded",
    "NotOpen",
    "PepsiError",
    "PublishFailed",
    "QueueError",
    "Rejected",
    "RepairRefused",
    "SchemaMismatch",
    "UnknownStage",
    "UsageError",
    "WorkerRefused",
    "classify",
    "database_exit_code",
    "is_reconnect",
    "is_unwritten",
    "one_line",
]
