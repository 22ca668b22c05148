"""`pepsi ingress` / `pepsi-ingress` / `pepsi publish`: the command-line producer."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

CONF = """
[stage-inbound]
HANDLER = tests.stages:noop
[stage-small]
HANDLER = tests.stages:noop
MAX_LENGTH = 1
"""


def ingress(
    conf: Path, dsn: str, *args: str, stdin: bytes = b"", script: str = "pepsi"
) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / script
    head = ["-c", str(conf)] + ([] if script != "pepsi" else ["ingress"])
    env = {"PEPSI_DSN": dsn, "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [exe, *head, *args], input=stdin.decode(), env=env, capture_output=True, text=True,
        check=False,
    )  # fmt: skip


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF)
    return path


def rows(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT w.workqueue_id, stage, sender, recipients, message_id, properties, b.body"
            " FROM pepsi.workqueue w LEFT JOIN pepsi.workqueue_body b USING (body_id)"
            " ORDER BY workqueue_id"
        ).fetchall()


def test_stdin_message_with_envelope(conf: Path, dsn: str) -> None:
    done = ingress(
        conf, dsn, "--stage", "inbound", "--sender", "a@x.org", "--recipient", "b@y.org",
        "--recipient", "c@y.org", "--message-id", "m1", "--property", "k=v", "--count", "3",
        stdin=b"hello", script="pepsi-ingress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    ids = [int(x) for x in done.stdout.split()]
    assert len(ids) == 3
    assert [r[0] for r in rows(dsn)] == ids
    assert rows(dsn)[0][1:] == (
        "inbound",
        "a@x.org",
        ["b@y.org", "c@y.org"],
        "m1",
        {"k": "v"},
        b"hello",
    )


def test_one_message_per_file_and_publish_alias(conf: Path, dsn: str, tmp_path: Path) -> None:
    files = []
    for i in range(3):
        path = tmp_path / f"m{i}.eml"
        path.write_bytes(f"body {i}".encode())
        files.append(str(path))
    exe = Path(sys.executable).parent / "pepsi"
    done = subprocess.run(
        [exe, "-c", str(conf), "publish", "--stage", "inbound", *files],
        env={"PEPSI_DSN": dsn}, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [r[6] for r in rows(dsn)] == [b"body 0", b"body 1", b"body 2"]


def test_json_lines_stream(conf: Path, dsn: str) -> None:
    lines = [
        {"body": "plain text", "sender": "a@x.org", "recipients": ["b@y.org"]},
        {"body_base64": base64.b64encode(b"\x00\x01bin").decode(), "stage": "inbound"},
        {"body": "deduped", "message_id": "d1", "dedup": True},
        {"body": "deduped again", "message_id": "d1", "dedup": True},
    ]
    stream = "\n".join(json.dumps(x) for x in lines) + "\n\n"
    done = ingress(conf, dsn, "--format", "jsonl", "--stage", "inbound", stdin=stream.encode())
    assert done.returncode == 0, done.stderr
    ids = [int(x) for x in done.stdout.split()]
    assert len(ids) == 4
    assert ids[2] == ids[3]
    assert [r[6] for r in rows(dsn)] == [b"plain text", b"\x00\x01bin", b"deduped"]


@pytest.mark.parametrize(
    ("args", "stdin", "code", "message"),
    [
        (["--stage", "nowhere"], b"x", 67, "no stage named 'nowhere'"),
        (["--stage", "inbound", "--sender", "bad"], b"x", 65, "sender is not an address"),
        (["--stage", "inbound", "--peer", "nope"], b"x", 65, "peer is not an IP address"),
        (["--stage", "small", "--count", "2"], b"x", 75, "stage small is full"),
        (["--format", "jsonl"], b'{"body": "no stage"}\n', 65, "line 1: no stage"),
        (
            ["--format", "jsonl", "--stage", "inbound"],
            b'{"bogus": 1}\n',
            65,
            "unknown field(s) bogus",
        ),
        (["--format", "jsonl", "--stage", "inbound"], b"{not json\n", 65, "line 1: not JSON"),
        (["--stage", "inbound", "--property", "novalue"], b"x", 2, "NAME=VALUE"),
        (["--stage", "inbound", "--expires", "soon"], b"x", 2, "--expires"),
        (["--stage", "inbound", "--priority", "256"], b"x", 65, "priority must be an integer"),
        ([], b"x", 2, "--stage is required"),
    ],
)
def test_refusals_exit_non_zero_with_one_line(
    conf: Path, dsn: str, args: list[str], stdin: bytes, code: int, message: str
) -> None:
    done = ingress(conf, dsn, *args, stdin=stdin)
    assert done.returncode == code, done.stderr
    assert done.stderr.count("\n") == 1
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert rows(dsn) == []


def test_load_generator(conf: Path, dsn: str) -> None:
    done = ingress(
        conf, dsn, "--stage", "inbound", "--count", "300", "--batch", "100", "--rate", "2000",
        "--quiet", stdin=b"x" * 1024,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert "published 300 messages" in done.stderr
    assert len(rows(dsn)) == 300


def test_priority(conf: Path, dsn: str) -> None:
    """Issue 33: `--priority N` (0 to 255, higher first)."""
    done = ingress(conf, dsn, "--stage", "inbound", "--priority", "7", stdin=b"x")
    assert done.returncode == 0, done.stderr
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT priority FROM pepsi.workqueue").fetchone()
    assert row == (7,)
