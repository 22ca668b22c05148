"""The embedded server is reachable by its own user only (issue 13, defect 3).

Another local user (`nobody`) is refused whatever the data directory's path;
only SCRAM passwords are accepted; an old `trust` cluster is upgraded in
place; the server bounds idle-in-transaction sessions.
"""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo

from pepsi.db import secret
from pepsi.db.embedded import (
    IDLE_IN_TRANSACTION_TIMEOUT,
    SERVER_USER_AS_ROOT,
    EmbeddedServer,
    _module,
)
from pepsi.errors import DatabaseUnavailable

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="running a client as another user (nobody) needs root"
)

# Run as nobody: connect, and print why it failed.
_CLIENT = """
import sys, psycopg
try:
    psycopg.connect(sys.argv[1], connect_timeout=5).close()
except psycopg.OperationalError as exc:
    print(exc)
    sys.exit(3)
print("connected")
"""


def _as_nobody(dsn: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", "nobody", "--", sys.executable, "-c", _CLIENT, dsn],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent"},
    )


def _server_uid() -> int:
    return pwd.getpwnam(SERVER_USER_AS_ROOT).pw_uid if os.geteuid() == 0 else os.geteuid()


def _socket_dir(server: EmbeddedServer) -> Path:
    status = server.status()
    assert status.running
    assert status.socket_dir is not None
    return status.socket_dir


def _without_password(server: EmbeddedServer) -> str:
    """The server's socket as `postgres`, with no password from anywhere."""
    return conninfo.make_conninfo(
        host=str(_socket_dir(server)), user="postgres", dbname="postgres", passfile="/nonexistent"
    )


def _assert_private(directory: Path) -> None:
    found = directory.lstat()
    assert stat.S_ISDIR(found.st_mode)
    assert stat.S_IMODE(found.st_mode) == 0o700, oct(found.st_mode)
    assert found.st_uid == _server_uid()


def _assert_refuses_other_users(server: EmbeddedServer, dsn: str) -> None:
    for attempt in (_without_password(server), dsn):
        done = _as_nobody(attempt)
        assert done.returncode == 3, done.stdout + done.stderr
        assert "Permission denied" in done.stdout, done.stdout


def _assert_password_required(server: EmbeddedServer) -> None:
    # root passes the socket directory's permissions: the password still stops it
    with pytest.raises(psycopg.OperationalError, match="no password supplied"):
        psycopg.connect(_without_password(server), connect_timeout=5)
    wrong = conninfo.make_conninfo(_without_password(server), password="guess")
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(wrong, connect_timeout=5)


def _assert_scram_only(server: EmbeddedServer) -> None:
    rules = [
        line.split()
        for line in (server.data_dir / "pg_hba.conf").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert rules
    assert {rule[-1] for rule in rules} == {"scram-sha-256"}


@pytest.fixture
def long_data_dir(tmp_path: Path) -> Path:
    path = tmp_path / ("d" * 60) / ("e" * 60) / "data"
    assert len(str(path)) >= 140
    return path


@pytest.fixture
def own_server(long_data_dir: Path) -> Iterator[EmbeddedServer]:
    server = EmbeddedServer(long_data_dir)
    yield server
    server.stop()


@needs_root
def test_another_user_is_refused(pg_server: EmbeddedServer) -> None:
    dsn = pg_server.start()
    assert _socket_dir(pg_server) == pg_server.data_dir  # short path: the socket is inside
    _assert_private(pg_server.data_dir)
    _assert_refuses_other_users(pg_server, dsn)


def test_only_scram_passwords_are_accepted(pg_server: EmbeddedServer) -> None:
    dsn = pg_server.start()
    _assert_scram_only(pg_server)
    _assert_password_required(pg_server)
    with psycopg.connect(dsn, connect_timeout=5) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("postgres",)
        listen = conn.execute("SHOW listen_addresses").fetchone()
    assert listen == ("",)  # no TCP at all


def test_the_dsn_names_the_secret_without_showing_it(pg_server: EmbeddedServer) -> None:
    dsn = pg_server.start()
    params = conninfo.conninfo_to_dict(dsn)
    assert "password" not in params
    assert params["passfile"] == str(pg_server.passfile)
    password = secret.read_secret(pg_server.passfile)
    assert password is not None
    assert len(password) >= 40
    assert password not in dsn
    found = pg_server.passfile.stat()
    assert stat.S_IMODE(found.st_mode) == 0o600
    assert found.st_uid == os.geteuid()
    assert pg_server.uri() == dsn


@needs_root
def test_a_long_data_dir_gets_a_private_socket_directory(own_server: EmbeddedServer) -> None:
    dsn = own_server.start()
    socket_dir = _socket_dir(own_server)
    assert socket_dir != own_server.data_dir
    assert len(str(socket_dir / ".s.PGSQL.5432")) <= 107  # fits a Unix socket address
    _assert_private(socket_dir)
    _assert_refuses_other_users(own_server, dsn)
    _assert_password_required(own_server)
    with psycopg.connect(dsn, connect_timeout=5) as conn:
        assert conn.execute("SELECT current_database()").fetchone() == ("pepsi",)
    assert own_server.stop()
    assert not socket_dir.exists()  # the empty directory goes with the server


def test_a_socket_directory_someone_else_made_is_refused(own_server: EmbeddedServer) -> None:
    # Start once to learn the short directory's name, then plant an open one there.
    own_server.start()
    socket_dir = _socket_dir(own_server)
    assert own_server.stop()
    socket_dir.mkdir(mode=0o777)
    socket_dir.chmod(0o777)
    try:
        with pytest.raises(DatabaseUnavailable, match=r"socket directory .* is not private"):
            own_server.start()
        assert not own_server.status().running
    finally:
        socket_dir.rmdir()


def _old_trust_cluster(data_dir: Path) -> str:
    """A cluster as Pepsi made it before: the wheel's initdb with trust, started."""
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    server = _module().get_server(data_dir, cleanup_mode=None)
    uri: str = server.get_uri("postgres")
    with psycopg.connect(uri, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (v text)")
        conn.execute("INSERT INTO kept VALUES ('before the upgrade')")
    assert "trust" in (data_dir / "pg_hba.conf").read_text()
    return uri


@pytest.mark.parametrize("long_path", [False, True], ids=["short", "long"])
@pytest.mark.parametrize("running", [True, False], ids=["running", "stopped"])
def test_an_old_trust_cluster_is_upgraded_in_place(
    tmp_path: Path, long_data_dir: Path, running: bool, long_path: bool
) -> None:
    server = EmbeddedServer(long_data_dir if long_path else tmp_path / "old")
    _old_trust_cluster(server.data_dir)
    try:
        if long_path and running:  # the case: the wheel's socket directory, 0777
            assert stat.S_IMODE(_socket_dir(server).stat().st_mode) & 0o077
        if not running:
            assert server.stop()
        assert not server.passfile.exists()
        dsn = server.start()
        assert server.passfile.exists()
        _assert_private(_socket_dir(server))
        _assert_scram_only(server)
        _assert_password_required(server)
        with psycopg.connect(conninfo.make_conninfo(dsn, dbname="postgres")) as conn:
            assert conn.execute("SELECT v FROM kept").fetchall() == [("before the upgrade",)]
        if os.geteuid() == 0:
            _assert_refuses_other_users(server, dsn)
        assert server.start() == dsn  # secured once; the next start changes nothing
    finally:
        server.stop()


def test_idle_in_transaction_sessions_are_ended(pg_server: EmbeddedServer) -> None:
    with psycopg.connect(pg_server.start()) as conn:
        found = conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()
    assert found == (IDLE_IN_TRANSACTION_TIMEOUT,)


def test_concurrent_first_starts_make_one_secured_server(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "data")
    code = "import sys; from pathlib import Path; from pepsi.db.embedded import EmbeddedServer\n"
    code += "print(EmbeddedServer(Path(sys.argv[1])).start())"
    starts = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(server.data_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        results = [start.communicate(timeout=120) for start in starts]
        assert [start.returncode for start in starts] == [0, 0, 0], results
        assert {out.strip() for out, _ in results} == {server.uri()}  # one server, one secret
        _assert_scram_only(server)
        _assert_password_required(server)
    finally:
        server.stop()
