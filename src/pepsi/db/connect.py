"""Which database Pepsi uses, and connecting to it with one-line errors.

`PEPSI_DSN` in the environment wins, then `[pepsi-postgres] DSN`; with
neither, the embedded server in DATA_DIR is started if needed and used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psycopg
from psycopg import conninfo

from pepsi.config import Config
from pepsi.db.embedded import EmbeddedServer
from pepsi.errors import DatabaseUnavailable

ENV_DSN = "PEPSI_DSN"


@dataclass(frozen=True)
class Target:
    dsn: str
    embedded: EmbeddedServer | None  # None: a server Pepsi does not manage

    @property
    def source(self) -> str:
        if self.embedded is not None:
            return f"embedded server in {self.embedded.data_dir}"
        return f"${ENV_DSN}" if os.environ.get(ENV_DSN) else "[pepsi-postgres] DSN"


def configured_dsn(config: Config) -> str | None:
    return os.environ.get(ENV_DSN) or config.postgres.dsn


def resolve(config: Config) -> Target:
    """The database to use, starting the embedded server when no DSN is configured."""
    dsn = configured_dsn(config)
    if dsn:
        return Target(dsn, None)
    server = EmbeddedServer(config.postgres.data_dir)
    return Target(server.start(), server)


def redact(dsn: str) -> str:
    """The DSN without its password, for messages and logs."""
    try:
        params = conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparsable DSN>"
    if "password" not in params:
        return dsn
    params["password"] = "***"
    return conninfo.make_conninfo(**params)  # type: ignore[arg-type]


def connect(
    dsn: str, *, autocommit: bool = True, timeout: float = 10.0, application_name: str = "pepsi"
) -> psycopg.Connection[tuple[object, ...]]:
    """Open a connection; DatabaseUnavailable with one clear line on failure."""
    try:
        return psycopg.connect(
            dsn,
            autocommit=autocommit,
            connect_timeout=max(1, round(timeout)),
            application_name=application_name,
        )
    except psycopg.ProgrammingError as exc:  # malformed DSN
        raise DatabaseUnavailable(f"invalid database DSN: {one_line(exc)}") from None
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(
            f"cannot connect to the database ({redact(dsn)}): {one_line(exc)}"
        ) from None


def one_line(exc: BaseException) -> str:
    """An exception's message folded onto one line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return "; ".join(lines) if lines else type(exc).__name__
