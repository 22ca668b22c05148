"""Which database Pepsi uses, and the one way every program connects to it.

`PEPSI_DSN` in the environment wins, then `[pepsi-postgres] DSN`; with
neither, the embedded server in DATA_DIR is started if needed and used.

`connect()` and `connect_async()` are the only places a connection is
opened (dispatcher, worker, publishers, bouncer, CLI): both apply
CONNECT_TIMEOUT, the program's application name and its session settings
(sent in the startup packet, so they cost no round trip), and turn a
refusal into one domain error with one clear line (`pepsi.errors.classify`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import conninfo

from pepsi.config import Config, PostgresOptions
from pepsi.errors import DatabaseBusy, DatabaseUnavailable, classify, one_line

ENV_DSN = "PEPSI_DSN"
# CONNECT_TIMEOUT's default (the config model is its one source), for callers without a config
DEFAULT_TIMEOUT = PostgresOptions.connect_timeout

# TCP keepalives unless the DSN sets its own: a primary whose host vanished
# without closing its connections (power loss, a partition) is noticed after
# about IDLE + INTERVAL * COUNT = 11 s of silence, before a failover manager
# even promotes a standby (Patroni's ttl is 20 s at least), instead of the
# kernel's retransmission timeout (minutes). Ignored on Unix sockets.
KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
}

# The send buffer asked for on a Unix socket (the embedded server's): a statement of
# up to about this size goes to the kernel in one write. With the default (~208 KB)
# an AMQP publish batch of 500 KB went in three, each after a turn of the dispatcher's
# event loop, while PostgreSQL, which starts a statement only once all of it is in,
# waited (docs/performance.md). The kernel caps the value at net.core.wmem_max (then
# doubles it); it is a ceiling, not an allocation.
SEND_BUFFER_BYTES = 4 * 1024 * 1024

if TYPE_CHECKING:  # a worker is given its DSN: it never imports the embedded server
    from pepsi.db.embedded import EmbeddedServer

Conn = psycopg.Connection[tuple[object, ...]]
AsyncConn = psycopg.AsyncConnection[tuple[object, ...]]


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
    from pepsi.db.embedded import EmbeddedServer  # noqa: PLC0415  # only when there is no DSN

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


def connect_params(
    dsn: str,
    *,
    application_name: str,
    timeout: float,
    settings: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The keyword arguments both connects give psycopg (and a pool's `kwargs`).

    `settings` are run-time parameters (`synchronous_commit=off`) appended to
    any `options` the DSN already has; TCP keepalives unless the DSN sets any.
    ProgrammingError for a malformed DSN.
    """
    given_params = conninfo.conninfo_to_dict(dsn)
    params: dict[str, Any] = {
        "connect_timeout": max(1, round(timeout)),  # libpq takes whole seconds, 0 = forever
        "application_name": application_name,
    }
    if not any(name in given_params for name in KEEPALIVES):
        params.update(KEEPALIVES)
    if settings:
        given = given_params.get("options")
        extra = " ".join(f"-c {name}={_escape(str(value))}" for name, value in settings.items())
        params["options"] = f"{given} {extra}" if given else extra
    return params


def _escape(value: str) -> str:
    # libpq's options: a backslash escapes a space or a backslash.
    return value.replace("\\", "\\\\").replace(" ", "\\ ")


def connect(
    dsn: str,
    *,
    application_name: str = "pepsi",
    timeout: float = DEFAULT_TIMEOUT,
    autocommit: bool = True,
    settings: Mapping[str, str] | None = None,
) -> Conn:
    """Open a connection; DatabaseUnavailable (exit 1) or DatabaseBusy (75) on failure."""
    try:
        params = connect_params(
            dsn, application_name=application_name, timeout=timeout, settings=settings
        )
        conn = psycopg.connect(dsn, autocommit=autocommit, **params)
    except psycopg.Error as exc:
        raise connect_error(exc, dsn) from None
    widen_send_buffer(conn.fileno())
    return conn


async def connect_async(
    dsn: str,
    *,
    application_name: str = "pepsi",
    timeout: float = DEFAULT_TIMEOUT,
    autocommit: bool = True,
    settings: Mapping[str, str] | None = None,
) -> AsyncConn:
    """`connect()` for asyncio: the same parameters, the same errors."""
    try:
        params = connect_params(
            dsn, application_name=application_name, timeout=timeout, settings=settings
        )
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit, **params)
    except psycopg.Error as exc:
        raise connect_error(exc, dsn) from None
    widen_send_buffer(conn.fileno())
    return conn


def widen_send_buffer(fd: int, size: int = SEND_BUFFER_BYTES) -> int | None:
    """Ask for a send buffer of `size` on the Unix socket `fd`; its new size, or None
    when `fd` is not a Unix socket (TCP tunes its own buffers: a fixed size would stop
    that) or the system refused (the connection works as before)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # not a socket
        return None
    try:
        if sock.family != socket.AF_UNIX:
            return None
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < size:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    except OSError:
        return None
    finally:
        sock.detach()  # the caller's descriptor: it stays open


def connect_error(exc: psycopg.Error, dsn: str) -> DatabaseUnavailable:
    """A failed connect as one line: DatabaseBusy at the connection limit, else unavailable."""
    if isinstance(exc, psycopg.ProgrammingError):  # malformed DSN, unknown keyword
        return DatabaseUnavailable(f"invalid database DSN: {one_line(exc)}")
    text = f"cannot connect to the database ({redact(dsn)}): {one_line(exc)}"
    if isinstance(classify(exc), DatabaseBusy):
        return DatabaseBusy(text, sqlstate=exc.sqlstate)
    return DatabaseUnavailable(text, sqlstate=exc.sqlstate)


__all__ = [
    "ENV_DSN",
    "AsyncConn",
    "Conn",
    "Target",
    "configured_dsn",
    "connect",
    "connect_async",
    "connect_error",
    "connect_params",
    "one_line",
    "redact",
    "resolve",
]
