"""The mail built-ins that need no network, in a real worker's runner: SRS, the bounce's
report, and a relay refusing to start without its secret."""

from __future__ import annotations

import email
from collections.abc import Callable
from datetime import timedelta
from email import policy
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pepsi.config import Config, load_config
from pepsi.errors import WorkerRefused
from pepsi.worker.handlers import load_handler
from pepsi.worker.runner import StageRunner
from tests.rows import NOW, running

Conn = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def config(tmp_path: Path) -> Config:
    secret = tmp_path / "srs.secret"
    secret.write_text("forwarder secret\n")
    path = tmp_path / "pepsi.conf"
    path.write_text(f"""
[stage-srs]
PROGRAM = pepsi-stage-srs
DOMAIN = fwd.example
SECRET_FILE = {secret}
NEXT = out
[stage-out]
HANDLER = tests.stages:noop
[stage-bounce]
PROGRAM = pepsi-stage-bounce
DSN_STAGE = out
HOSTNAME = mx.pepsi.test
[stage-relay]
PROGRAM = pepsi-stage-relay-to-smarthost
HOST = smarthost.example
AUTH_USER = pepsi
AUTH_SECRET_FILE = {tmp_path}/missing.secret
[stage-plain]
PROGRAM = pepsi-stage-relay-to-smarthost
HOST = 127.0.0.1
PORT = 9
TLS = none
""")
    return load_config(path)


def run(make_runner: Callable[..., StageRunner], config: Config, stage: str, wid: int) -> None:
    make_runner(load_handler(config.stages[stage]), stage).run_batch([wid])


def envelope(conn: Conn, wid: int) -> tuple[str, str, str, list[str]]:
    row = conn.execute(
        "SELECT stage, status::text, sender, recipients FROM pepsi.workqueue WHERE workqueue_id = %s",
        (wid,),
    ).fetchone()
    assert row is not None
    return row[0], row[1], row[2], row[3]


def test_srs_rewrites_a_forwarded_sender_and_takes_its_bounces_back(
    conn: Conn, make_runner: Callable[..., StageRunner], config: Config
) -> None:
    forwarded = running(conn, "srs", sender="alice@sender.org", recipients=["bob@elsewhere.org"])
    run(make_runner, config, "srs", forwarded)
    stage, status, sender, recipients = envelope(conn, forwarded)
    assert (stage, status, recipients) == ("out", "pending", ["bob@elsewhere.org"])
    assert sender.startswith("SRS0=")
    assert sender.endswith("=sender.org=alice@fwd.example")
    bounce = running(conn, "srs", sender="", recipients=[sender])  # the bounce comes back
    run(make_runner, config, "srs", bounce)
    assert envelope(conn, bounce)[2:] == ("", ["alice@sender.org"])
    own = running(conn, "srs", sender="carol@fwd.example", recipients=["x@y.org"])
    run(make_runner, config, "srs", own)
    assert envelope(conn, own)[2] == "carol@fwd.example"  # our own senders stay


def test_the_bounce_stage_reports_a_mail_message_after_its_retries(
    conn: Conn, make_runner: Callable[..., StageRunner], config: Config
) -> None:
    wid = running(
        conn, "bounce", sender="alice@sender.org", recipients=["bob@x.org", "carol@x.org"],
        body=b"the text\r\n", header="Subject: hello\r\n",
        state={"failure_class": "retries-exhausted", "last_error": "mx.x.org: timed out"},
        properties={"smtp": {"rcpt": {"carol@x.org": {"notify": ["NEVER"]}}}},
        arrived=NOW - timedelta(days=5),
    )  # fmt: skip
    run(make_runner, config, "bounce", wid)
    assert conn.execute("SELECT count(*) FROM pepsi.workqueue WHERE workqueue_id = %s", (wid,)
                        ).fetchone() == (0,)  # fmt: skip
    report = conn.execute(
        "SELECT w.stage, w.sender, w.recipients, b.header, b.body FROM pepsi.workqueue w"
        " JOIN pepsi.workqueue_body b USING (body_id) WHERE w.workqueue_id > %s", (wid,)
    ).fetchone()  # fmt: skip
    assert report is not None
    stage, sender, recipients, header, body = report
    assert (stage, sender, recipients) == ("out", "", ["alice@sender.org"])
    parsed = email.message_from_bytes(bytes(header) + b"\r\n" + bytes(body), policy=policy.default)
    text = bytes(body).decode()
    assert "Final-Recipient: rfc822; bob@x.org" in text
    assert "carol@x.org" not in text  # NOTIFY=NEVER
    assert "Status: 4.4.7" in text
    assert "timed out" not in text  # generic: the error stays in the state
    assert parsed.get_content_type() == "multipart/report"


def test_a_null_sender_is_never_reported_to(
    conn: Conn, make_runner: Callable[..., StageRunner], config: Config
) -> None:
    wid = running(conn, "bounce", sender="", recipients=["bob@x.org"], body=b"x")
    run(make_runner, config, "bounce", wid)
    stage, status, _, _ = envelope(conn, wid)
    assert (stage, status) == ("bounce", "failed")  # kept for the failure bouncer
    assert conn.execute("SELECT count(*) FROM pepsi.workqueue").fetchone() == (1,)


def test_a_relay_without_its_secret_refuses_to_start(config: Config, tmp_path: Path) -> None:
    with pytest.raises(WorkerRefused, match=r"\[stage-relay\] AUTH_SECRET_FILE: cannot read"):
        load_handler(config.stages["relay"])
    (tmp_path / "missing.secret").write_bytes(b"\xff\xfe not text")
    with pytest.raises(WorkerRefused, match=r"AUTH_SECRET_FILE: .*missing.secret is not UTF-8"):
        load_handler(config.stages["relay"])


def test_a_message_without_recipients_fails_at_a_relay(
    conn: Conn, make_runner: Callable[..., StageRunner], config: Config
) -> None:
    wid = running(conn, "plain", sender="alice@sender.org", body=b"x")
    run(make_runner, config, "plain", wid)
    assert envelope(conn, wid)[:2] == ("plain", "failed")
