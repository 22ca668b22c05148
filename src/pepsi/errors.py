"""Domain errors and exit codes.

Every error Pepsi raises for a user to read derives from `PepsiError` and
renders as one line; the CLI prints it and exits with `exit_code`, never a
traceback.
"""

from __future__ import annotations

# Exit statuses (sysexits.h where one fits).
EX_OK = 0
EX_ERROR = 1
EX_USAGE = 2  # argparse's own status for a bad command line
EX_IOERR = 74  # worker: database connection lost while processing
EX_TEMPFAIL = 75  # worker: connection limit exhausted
EX_CONFIG = 78  # stage graph invalid, or database schema of another version


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


class DatabaseUnavailable(PepsiError):
    """The database could not be reached (server down, bad DSN, refused login)."""


class SchemaMismatch(PepsiError):
    """The database schema is missing or not the one this build expects."""

    exit_code = EX_CONFIG


_LOST_STATES = frozenset({"57P01", "57P02", "57P03"})  # admin/crash shutdown, cannot connect now
_EXHAUSTED_HINTS = ("too many clients", "too many connections", "connection slots are reserved")


def database_exit_code(exc: BaseException) -> int | None:
    """The one place database errors are classified (DESIGN.md §4).

    EX_IOERR (74) for a lost connection (SQLSTATE class 08, 57P01 to 57P03, an
    I/O or TLS failure without a server answer), EX_TEMPFAIL (75) when the
    connection limit is exhausted (53300, a pool acquire timeout), None for
    anything else: that is the stage's host failure, not the database's.
    """
    import psycopg  # noqa: PLC0415  # errors.py stays importable without the driver
    from psycopg_pool import PoolTimeout  # noqa: PLC0415

    if isinstance(exc, PoolTimeout):
        return EX_TEMPFAIL
    if not isinstance(exc, psycopg.Error):
        return None
    code = exc.sqlstate
    text = str(exc).lower()
    if code == "53300" or any(hint in text for hint in _EXHAUSTED_HINTS):
        return EX_TEMPFAIL
    if code is not None and (code.startswith("08") or code in _LOST_STATES):
        return EX_IOERR
    if code is None and isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return EX_IOERR
    return None
