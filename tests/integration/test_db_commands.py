"""`pepsi setup schema` and `pepsi db …` against real servers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from pepsi.cli import main
from pepsi.db.embedded import EmbeddedServer


def test_setup_schema_with_a_dsn(
    empty_dsn: str,
    isolated_env: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("PEPSI_DSN", empty_dsn)
    assert main(["setup", "schema"]) == 0
    assert "installed schema version" in capsys.readouterr().out
    assert main(["setup", "schema"], command=None) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert main(["schema"], command="setup") == 0  # the pepsi-setup alias
    assert main(["db", "url"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == empty_dsn
    assert main(["db", "status"]) == 0
    out = capsys.readouterr().out
    assert "$PEPSI_DSN" in out
    assert "(current)" in out
    assert "queue: empty" in out


def test_status_shows_the_queue(
    dsn: str,
    isolated_env: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pepsi.workqueue (stage, status) VALUES"
            " ('inbound', 'pending'), ('inbound', 'pending'), ('deliver', 'failed')"
        )
    monkeypatch.setenv("PEPSI_DSN", dsn)
    assert main(["db", "status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    inbound = next(line for line in lines if "inbound" in line).split()
    assert inbound == ["inbound", "2", "0", "0", "0", "0"]


def test_schema_mismatch_is_reported(
    dsn: str,
    isolated_env: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE pepsi.schema_version SET version = version + 1")
    monkeypatch.setenv("PEPSI_DSN", dsn)
    assert main(["setup", "schema"]) == 78
    assert "newer than this build's" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("bad_dsn", "message"),
    [
        (
            "postgresql://nobody@127.0.0.1:1/none?connect_timeout=2",
            "cannot connect to the database",
        ),
        ("host=/nonexistent/socket dbname=x", "cannot connect to the database"),
        ("this is = not a dsn", "invalid database DSN"),
    ],
)
def test_connection_failure_is_one_line(
    bad_dsn: str, message: str, isolated_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PEPSI_DSN", bad_dsn)
    pepsi = Path(sys.executable).parent / "pepsi"
    done = subprocess.run([pepsi, "setup", "schema"], capture_output=True, text=True, check=False)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"pepsi: {message}")


def test_embedded_server_lifecycle(isolated_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data_dir = isolated_env / "pgdata"
    conf = isolated_env / "pepsi.conf"
    conf.write_text(f"[pepsi-postgres]\nDATA_DIR = {data_dir}\n")
    try:
        assert main(["db", "status"]) == 0  # ./pepsi.conf is found by default
        assert "(stopped)" in capsys.readouterr().out
        assert main(["db", "start"]) == 0
        assert f"embedded PostgreSQL running in {data_dir}" in capsys.readouterr().out
        assert main(["db", "url"]) == 0
        url = capsys.readouterr().out.strip()
        assert str(data_dir) in url
        # a working DSN that names the secret's file without showing the secret
        password = (data_dir / "pepsi.pgpass").read_text().strip().rsplit(":", 1)[-1]
        assert f"passfile={data_dir}/pepsi.pgpass" in url
        assert password not in url
        assert main(["setup", "schema"]) == 0
        assert "installed" in capsys.readouterr().out
        assert main(["db", "status"]) == 0
        out = capsys.readouterr().out
        assert "running, pid" in out
        assert "(current)" in out
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT current_database()").fetchone() == ("pepsi",)
    finally:
        assert main(["db", "stop"]) == 0
    assert "stopped" in capsys.readouterr().out
    assert main(["db", "stop"]) == 0
    assert "was not running" in capsys.readouterr().out


def test_embedded_commands_refuse_when_a_dsn_is_set(
    isolated_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PEPSI_DSN", "postgresql://u@db.invalid/x")
    assert main(["db", "start"]) == 1
    assert "a DSN is configured ($PEPSI_DSN)" in capsys.readouterr().err


def _pepsi(*args: str) -> subprocess.CompletedProcess[str]:
    pepsi = Path(sys.executable).parent / "pepsi"
    return subprocess.run(
        [pepsi, *args],
        input="a message\n",
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


@pytest.fixture
def stopped_cluster(isolated_env: Path) -> Path:
    """An initialised, stopped embedded cluster, named by ./pepsi.conf."""
    data_dir = isolated_env / "pgdata"
    (isolated_env / "pepsi.conf").write_text(f"[pepsi-postgres]\nDATA_DIR = {data_dir}\n")
    server = EmbeddedServer(data_dir)
    server.start()
    assert server.stop()
    return data_dir


COMMANDS = [["db", "url"], ["queue", "status"], ["publish", "--stage", "inbound"]]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_an_embedded_server_that_cannot_start_is_one_line(
    stopped_cluster: Path, command: list[str]
) -> None:
    with (stopped_cluster / "postgresql.conf").open("a") as conf:
        conf.write("no_such_setting = on\n")  # the server refuses to start
    done = _pepsi(*command)
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(
        f"pepsi: cannot start the embedded PostgreSQL in {stopped_cluster}: pg_ctl exited"
    )
    assert 'postgresql.conf" contains errors' in done.stderr  # the log's FATAL line
    assert f"(server log: {stopped_cluster}/log)" in done.stderr


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_an_embedded_socket_that_refuses_is_one_line(
    stopped_cluster: Path, command: list[str]
) -> None:
    # postmaster.pid left behind, naming a live process that is no server
    # (this test's): Pepsi takes the server for running, and nothing answers.
    lines = [str(os.getpid()), str(stopped_cluster), "1700000000", "5432"]
    lines += [str(stopped_cluster), "", "0 0", "ready"]
    (stopped_cluster / "postmaster.pid").write_text("\n".join(lines) + "\n")
    done = _pepsi(*command)
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(
        f"pepsi: cannot start the embedded PostgreSQL in {stopped_cluster}"
    )
    assert "No such file or directory" in done.stderr
    assert "Traceback" not in done.stderr
