"""`pepsi amqp`: users, vhosts and permissions from the command line."""

from __future__ import annotations

import contextlib
import getpass
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pepsi.admin.accounts import amqp_users
from pepsi.cli import main
from pepsi.errors import EX_NOUSER, EX_OK, EX_USAGE

PEPSI = Path(sys.executable).parent / "pepsi"
SECRET = "correct horse battery staple"


class Terminal(io.StringIO):
    """A standard input that says it is a terminal (for the getpass prompt)."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def db(dsn: str, isolated_env: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("PEPSI_DSN", dsn)
    return dsn


def run(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    *args: str,
    stdin: str = "",
) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(["amqp", *args])
    captured = capsys.readouterr()
    assert SECRET not in captured.out + captured.err
    return code, captured.out, captured.err


def test_user_lifecycle(
    db: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, _ = run(
        capsys,
        monkeypatch,
        "user",
        "add",
        "alice",
        "--tags",
        "administrator, monitoring",
        "--password-stdin",
        stdin=SECRET + "\n",
    )
    assert code == EX_OK
    assert "added AMQP user 'alice'" in out
    with psycopg.connect(db) as conn:
        assert amqp_users.check_credentials(conn, "alice", SECRET)  # newline stripped
    code, out, _ = run(capsys, monkeypatch, "user", "list")
    assert out == "alice\t[administrator, monitoring]\n"
    code, out, _ = run(capsys, monkeypatch, "user", "list", "--json")
    listed = json.loads(out)
    assert [(u["name"], u["tags"]) for u in listed] == [("alice", ["administrator", "monitoring"])]

    # On a terminal: asked twice with getpass.
    answers = iter(["new-pass", "new-pass"])
    monkeypatch.setattr(getpass, "getpass", lambda prompt="": next(answers))
    monkeypatch.setattr(sys, "stdin", Terminal())
    assert main(["amqp", "user", "passwd", "alice"]) == EX_OK
    assert "changed the password" in capsys.readouterr().out
    with psycopg.connect(db) as conn:
        assert amqp_users.check_credentials(conn, "alice", "new-pass")

    answers = iter(["one", "two"])
    assert main(["amqp", "user", "passwd", "alice"]) == EX_USAGE
    assert "passwords differ" in capsys.readouterr().err
    with psycopg.connect(db) as conn:
        assert amqp_users.check_credentials(conn, "alice", "new-pass")

    code, out, _ = run(capsys, monkeypatch, "user", "delete", "alice")
    assert (code, out) == (EX_OK, "deleted AMQP user 'alice'\n")
    assert run(capsys, monkeypatch, "user", "list")[1] == ""


def test_permissions_and_vhosts(
    db: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run(capsys, monkeypatch, "user", "add", "guest", "--password-stdin", stdin="guest")
    code, out, _ = run(capsys, monkeypatch, "permissions", "set", "guest", ".*", ".*", ".*")
    assert (code, out) == (EX_OK, "set permissions of AMQP user 'guest' in vhost '/'\n")
    assert run(capsys, monkeypatch, "vhost", "add", "shop")[0] == EX_OK
    code, _, _ = run(
        capsys, monkeypatch, "permissions", "set", "guest", "--vhost", "shop", "", "^$", "^shop-"
    )
    assert code == EX_OK
    code, out, _ = run(capsys, monkeypatch, "permissions", "list", "--json")
    assert json.loads(out) == [
        {"user": "guest", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"},
        {"user": "guest", "vhost": "shop", "configure": "", "write": "^$", "read": "^shop-"},
    ]
    code, out, _ = run(capsys, monkeypatch, "permissions", "list", "--vhost", "shop")
    assert out == "shop\tguest\t''\t'^$'\t'^shop-'\n"
    code, out, _ = run(capsys, monkeypatch, "vhost", "list")
    assert out == "/\t0 queues\nshop\t0 queues\n"
    assert [
        v["name"] for v in json.loads(run(capsys, monkeypatch, "vhost", "list", "--json")[1])
    ] == [
        "/",
        "shop",
    ]
    code, out, _ = run(capsys, monkeypatch, "permissions", "clear", "guest", "--vhost", "shop")
    assert "cleared the permissions" in out
    code, out, _ = run(capsys, monkeypatch, "permissions", "clear", "guest", "--vhost", "shop")
    assert (code, "had no permissions" in out) == (EX_OK, True)
    code, out, _ = run(capsys, monkeypatch, "vhost", "delete", "shop")
    assert out == "deleted AMQP vhost 'shop' (0 queues, 0 messages)\n"


@pytest.mark.parametrize(
    ("args", "stdin", "code", "message"),
    [
        (("user", "delete", "nobody"), "", EX_NOUSER, "no AMQP user 'nobody'"),
        (("user", "passwd", "nobody", "--password-stdin"), "x", EX_NOUSER, "no AMQP user"),
        (("user", "add", "bob"), "", EX_USAGE, "use --password-stdin"),  # not a terminal
        (("user", "add", "bob", "--password-stdin"), "\n", EX_USAGE, "empty password"),
        (("user", "add", "", "--password-stdin"), "pw", EX_USAGE, "user name is empty"),
        (("user", "add", "b", "--tags", "a b", "--password-stdin"), "pw", EX_USAGE, "bad tag"),
        (("permissions", "set", "nobody", ".*", ".*", ".*"), "", EX_NOUSER, "no AMQP user"),
        (
            ("permissions", "set", "alice", "--vhost", "prod", ".*", ".*", ".*"),
            "",
            EX_NOUSER,
            "no AMQP vhost 'prod'",
        ),
        (
            ("permissions", "set", "alice", "[", ".*", ".*"),
            "",
            EX_USAGE,
            "configure pattern: invalid regular expression '['",
        ),
        (("permissions", "set", "alice", ".*", ".*"), "", EX_USAGE, "required: READ"),
        (("vhost", "delete", "nope"), "", EX_NOUSER, "no AMQP vhost 'nope'"),
        (("vhost", "add", "/"), "", 1, "vhost '/' already exists"),
        (("user", "add", "alice", "--password-stdin"), SECRET, 1, "'alice' already exists"),
        (("user",), "", EX_USAGE, "required: ACTION"),
    ],
)
def test_mistakes_are_one_line(
    db: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[str, ...],
    stdin: str,
    code: int,
    message: str,
) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        amqp_users.add_user(conn, "alice", "pw")
    got, out, err = run(capsys, monkeypatch, *args, stdin=stdin)
    assert got == code
    assert out == ""
    assert err.startswith("pepsi: ")
    assert err.count("\n") == 1
    assert message in err
    assert "Traceback" not in err


def test_real_process_reads_the_password_from_a_pipe(db: str, isolated_env: Path) -> None:
    env: dict[str, Any] = {"PATH": "/usr/bin:/bin", "PEPSI_DSN": db, "HOME": str(isolated_env)}
    done = subprocess.run(
        [PEPSI, "amqp", "user", "add", "carol", "--password-stdin"],
        input=SECRET,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stdout + done.stderr
    with psycopg.connect(db) as conn:
        assert amqp_users.check_credentials(conn, "carol", SECRET)


words = st.sampled_from(
    [
        *("--vhost", "--user", "--json", "--tags", "--password-stdin", "/", "alice", "shop"),
        *(".*", "", "(", "^$", "\udcff", "é", "a\nb", "x" * 300, "-", "--", "-h", "user"),
    ]
)
commands = st.sampled_from(
    [
        *(["user", a] for a in ("add", "passwd", "delete", "list", "nope")),
        *(["permissions", a] for a in ("set", "clear", "list")),
        *(["vhost", a] for a in ("add", "delete", "list")),
        [],
    ]
)
argvs = st.tuples(commands, st.lists(words, max_size=5)).map(lambda t: [*t[0], *t[1]])


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(argvs, st.sampled_from(["", "pw\n", "\0", "\udcff"]))
def test_any_command_line_is_one_line_or_success(
    db: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    stdin: str,
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    with contextlib.suppress(SystemExit):  # -h prints the help and exits 0
        code = main(["amqp", *argv])
        err = capsys.readouterr().err
        assert code in {0, 1, 2, 67}, err
        assert "Traceback" not in err
        assert code == 0 or err.count("\n") == 1
