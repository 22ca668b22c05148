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
