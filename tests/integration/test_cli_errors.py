"""The CLI's boundary: a database that is down, lost, read-only or refusing is one line
on stderr and a documented exit status, never a traceback (DESIGN.md §4)."""

from __future__ import annotations

import io
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo, sql

from pepsi.cli import main
from pepsi.db.connect import connect, connect_async
from pepsi.errors import DatabaseLost, DatabaseReadOnly, DatabaseUnavailable

PEPSI = Path(sys.executable).parent / "pepsi"
# CONNECT_TIMEOUT: the publisher's pool retries a refused connection until it expires.
CONF = (
    "[pepsi-postgres]\nCONNECT_TIMEOUT = 1s\n"
    "[stage-a]\nHANDLER = tests.stages:noop\n[stage-b]\nHANDLER = tests.stages:noop\n"
)
CLOSED_PORT = "postgresql://127.0.0.1:1/nowhere"
NO_SOCKET = "host=/nonexistent/socket dbname=x"


@pytest.fixture
def workdir(isolated_env: Path) -> Path:
    (isolated_env / "pepsi.conf").write_text(CONF)
    return isolated_env


def pepsi(dsn: str, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """`pepsi ARGS` as a real process against `dsn` (cwd: the test's pepsi.conf)."""
    return subprocess.run(
        [PEPSI, *args],
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PEPSI_DSN": dsn, "HOME": str(Path.cwd())},
    )


@pytest.mark.parametrize("dsn", [CLOSED_PORT, NO_SOCKET])
@pytest.mark.parametrize(
    "args",
    [
        ("queue", "status"),
        ("queue", "list"),
        ("queue", "show", "1"),
        ("queue", "retry", "1"),
        ("db", "status"),
        ("setup", "schema"),
        ("top", "--count", "1"),
        ("failure-bouncer", "--once"),
        ("publish", "--stage", "a"),
    ],
)
def test_a_database_that_is_down_is_one_line_exit_1(
    workdir: Path, dsn: str, args: tuple[str, ...]
) -> None:
    done = pepsi(dsn, *args, stdin="body")
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("pepsi: cannot connect to the database")
    assert done.stdout == ""


def test_db_url_with_a_dsn_does_not_connect(workdir: Path) -> None:
    done = pepsi(CLOSED_PORT, "db", "url")
    assert (done.returncode, done.stdout, done.stderr) == (0, CLOSED_PORT + "\n", "")


def _with_options(dsn: str, options: str) -> str:
    return conninfo.make_conninfo(dsn, options=options)


def test_a_read_only_server_is_74(
    dsn: str, empty_dsn: str, workdir: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """A standby (or a primary demoted under us) refuses writes: reconnect, exit 74."""
    read_only = "-c default_transaction_read_only=on"
    monkeypatch.setenv("PEPSI_DSN", _with_options(empty_dsn, read_only))
    assert main(["setup", "schema"]) == 74
    err = capsys.readouterr().err
    assert err.startswith("pepsi: database is read-only (not the primary): ")
    assert err.count("\n") == 1
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pepsi.workqueue (workqueue_id, stage, status, state)"
            " VALUES (1, 'a', 'failed', '{\"failed_stage\": \"a\"}')"
        )
    monkeypatch.setenv("PEPSI_DSN", _with_options(dsn, read_only))
    assert main(["queue", "retry", "1"]) == 74
    assert "read-only" in capsys.readouterr().err
    assert main(["queue", "status", "--json"]) == 0  # reads still work on a standby
    capsys.readouterr()


def test_a_connection_lost_mid_command_is_74(
    dsn: str, workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The server ends an idle session between two refreshes of `pepsi top` (57P05)."""
    monkeypatch.setenv("PEPSI_DSN", _with_options(dsn, "-c idle_session_timeout=100"))
    code = main(["top", "--json", "--count", "2", "--interval", "1s"])
    err = capsys.readouterr().err
    assert code == 74, err
    assert err.startswith("pepsi: reading the queue failed: ")
    assert err.count("\n") == 1


@pytest.fixture
def locked_out(admin_dsn: str, dsn: str) -> Iterator[str]:
    """A login role with no rights on the pepsi schema."""
    role = f"r_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD 'x'").format(sql.Identifier(role)))
    yield conninfo.make_conninfo(dsn, user=role, password="x")
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_a_statement_the_server_refuses_is_one_line_with_its_sqlstate(
    locked_out: str, workdir: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv("PEPSI_DSN", locked_out)
    assert main(["queue", "status"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pepsi: database error (SQLSTATE 42501): permission denied")
    assert err.count("\n") == 1


def test_the_one_connect_names_the_program_and_applies_settings(dsn: str) -> None:
    with connect(
        dsn, application_name="pepsi-test", timeout=3, settings={"work_mem": "7MB"}
    ) as conn:
        row = conn.execute(
            "SELECT current_setting('application_name'), current_setting('work_mem')"
        ).fetchone()
        assert row == ("pepsi-test", "7MB")
        assert conn.autocommit
        assert conn.info.get_parameters()["connect_timeout"] == "3"


def test_settings_keep_the_dsn_options(dsn: str) -> None:
    given = _with_options(dsn, "-c lock_timeout=5s")
    with connect(given, settings={"statement_timeout": "9s"}) as conn:
        row = conn.execute(
            "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')"
        ).fetchone()
        assert row == ("5s", "9s")


async def _async_round_trip(dsn: str) -> tuple[object, ...] | None:
    conn = await connect_async(dsn, application_name="pepsi-async", timeout=2)
    async with conn:
        cur = await conn.execute("SELECT current_setting('application_name')")
        return await cur.fetchone()


def test_the_async_connect_is_the_same(dsn: str) -> None:
    import asyncio  # noqa: PLC0415

    assert asyncio.run(_async_round_trip(dsn)) == ("pepsi-async",)
    with pytest.raises(DatabaseUnavailable, match="cannot connect to the database") as info:
        asyncio.run(_async_round_trip(CLOSED_PORT))
    assert type(info.value) is DatabaseUnavailable
    assert info.value.exit_code == 1
    with pytest.raises(DatabaseUnavailable, match="invalid database DSN"):
        asyncio.run(_async_round_trip("this is = not a dsn"))


def test_the_worker_answers_74_when_it_cannot_connect() -> None:
    from pepsi.worker.runtime import connect_worker  # noqa: PLC0415

    with pytest.raises(DatabaseLost) as info:
        connect_worker(CLOSED_PORT, "a", synchronous_commit=True, timeout=1)
    assert info.value.exit_code == 74
    assert not isinstance(info.value, DatabaseReadOnly)


def test_the_worker_connection_turns_synchronous_commit_off(dsn: str) -> None:
    from pepsi.worker.runtime import connect_worker  # noqa: PLC0415

    with connect_worker(dsn, "a", synchronous_commit=False) as conn:
        row = conn.execute(
            "SELECT current_setting('synchronous_commit'), current_setting('application_name')"
        ).fetchone()
        assert row == ("off", "pepsi-worker:a")


NOT_UTF8 = b"\xff".decode("utf-8", "surrogateescape")  # `$'\xff'` on a UTF-8 command line


@pytest.mark.parametrize(
    "args",
    [
        ("queue", "list", "--stage", NOT_UTF8),
        ("queue", "list", "--sender-key", NOT_UTF8),
        ("queue", "retry", "--stage", "a", "--failure-class", NOT_UTF8),
        ("publish", "--stage", "a", "--subject", NOT_UTF8),
        ("publish", "--stage", NOT_UTF8),
    ],
)
def test_bytes_that_are_not_utf8_reaching_the_database_are_one_line(
    dsn: str, workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    args: tuple[str, ...],
) -> None:  # fmt: skip
    monkeypatch.setenv("PEPSI_DSN", dsn)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"body")))
    code = main(list(args))
    err = capsys.readouterr().err
    assert code in (1, 2, 65, 67), err
    assert err.count("\n") == 1, err
    assert "\\udcff" in err or "UTF-8" in err or "utf-8" in err, err


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (("web", "--listen", "0.0.0.0:0"), "--listen: a console listening on 0.0.0.0 needs a"),
        (("web", "--listen", "nowhere"), "--listen: expected HOST:PORT"),
        (("web", "password"), "no terminal to ask for the password on"),
    ],
)
def test_web_console_mistakes_are_one_line(
    dsn: str, workdir: Path, args: tuple[str, ...], problem: str
) -> None:
    done = pepsi(dsn, *args)
    assert done.returncode == 2
    assert problem in done.stderr
    assert "Traceback" not in done.stderr
