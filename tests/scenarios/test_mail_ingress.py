"""`pepsi ingress --serve` (SPEC M-1 to M-3): a real server process, real SMTP clients.

Each test starts the server on a fresh database and talks to it with Python's
smtplib, a raw socket where a client would not misbehave on purpose, or swaks.
A `250` is checked against the database at once: its row is already there.
"""

from __future__ import annotations

import base64
import getpass
import shutil
import smtplib
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.mail_server import (
    IngressProcess,
    Line,
    add_user,
    make_certificate,
    message,
    outside_address,
    queued_id,
)  # fmt: skip
from tests.scenarios.conftest import REPO, wait_until

SWAKS = shutil.which("swaks")
Row = dict[str, Any]


def row(conn: psycopg.Connection[Any], wid: int) -> Row:
    found = conn.execute(
        "SELECT w.stage, w.status::text AS status, w.sender, w.recipients, w.origin_user,"
        " host(w.origin_peer) AS origin_peer, w.sender_key, w.message_id, w.header_from,"
        " w.subject, w.properties, b.header, b.body"
        " FROM pepsi.workqueue w LEFT JOIN pepsi.workqueue_body b USING (body_id)"
        " WHERE w.workqueue_id = %s",
        (wid,),
    ).fetchone()
    assert found is not None, f"message {wid} is not in the database"
    columns = [
        "stage", "status", "sender", "recipients", "origin_user", "origin_peer", "sender_key",
        "message_id", "header_from", "subject", "properties", "header", "body",
    ]  # fmt: skip
    return dict(zip(columns, found, strict=True))


def count(conn: psycopg.Connection[Any]) -> int:
    found = conn.execute("SELECT count(*) FROM pepsi.workqueue").fetchone()
    assert found is not None
    return int(found[0])


def auth_plain(client: smtplib.SMTP, user: str, password: str) -> tuple[int, bytes]:
    """One AUTH PLAIN (smtplib's login() tries PLAIN, then LOGIN: two failures a call)."""
    token = base64.b64encode(f"\0{user}\0{password}".encode()).decode()
    return client.docmd("AUTH", f"PLAIN {token}")


def test_a_message_is_stored_with_its_envelope_before_its_250(
    ingress: Callable[..., IngressProcess], conn: psycopg.Connection[Any]
) -> None:
    server = ingress()
    original = message(
        "=?utf-8?q?caf=C3=A9?= time", "Line one.\r\n..dot-stuffed by smtplib\r\n",
        Message_ID="<m1@sender.org>",
    )  # fmt: skip
    with smtplib.SMTP(*server.smtp) as client:
        client.ehlo("client.test")
        features = client.esmtp_features
        for extension in ("pipelining", "size", "8bitmime", "smtputf8", "enhancedstatuscodes"):
            assert extension in features
        assert "dsn" in features
        assert features["size"] == str(25 * 1024 * 1024)
        code, _ = client.mail("alice@sender.org", ["RET=HDRS", "ENVID=env+2B1", "BODY=8BITMIME"])
        assert code == 250
        assert (
            client.rcpt(
                "bob@example.com", ["NOTIFY=SUCCESS,FAILURE", "ORCPT=rfc822;bob@example.com"]
            )[0]
            == 250
        )
        assert client.rcpt("carol@example.com")[0] == 250
        assert client.rcpt("bob@example.com")[0] == 250  # a repeat is kept once
        code, reply = client.data(original)
        assert code == 250
        assert reply.startswith(b"2.0.0 Queued as ")
        stored = row(conn, queued_id(reply))  # committed: visible to another session at once
    assert stored["stage"] == "inbox"
    assert stored["status"] == "pending"
    assert stored["sender"] == "alice@sender.org"
    assert stored["recipients"] == ["bob@example.com", "carol@example.com"]
    assert stored["origin_peer"] == "127.0.0.1"
    assert stored["origin_user"] is None
    assert stored["sender_key"] == "ip:127.0.0.1"
    assert stored["message_id"] == "<m1@sender.org>"
    assert stored["header_from"] == "Alice <alice@sender.org>"
    assert stored["subject"] == "café time"
    smtp = stored["properties"]["smtp"]
    assert smtp["ret"] == "HDRS"
    assert smtp["envid"] == "env+1"
    assert smtp["body"] == "8BITMIME"
    assert smtp["rcpt"] == {
        "bob@example.com": {"notify": ["SUCCESS", "FAILURE"], "orcpt": "rfc822;bob@example.com"}
    }
    header, body = bytes(stored["header"]), bytes(stored["body"])
    assert header.startswith(b"Received: from client.test ([127.0.0.1])\r\n")
    assert f"\tby mx.test (Pepsi) with ESMTP id {smtp['id']}; ".encode() in header
    received_end = header.index(b"\r\nSubject:") + 2
    assert header[received_end:] + b"\r\n" + body == original
    assert body == b"Line one.\r\n..dot-stuffed by smtplib\r\n"


def test_the_null_sender_and_postmaster(
    ingress: Callable[..., IngressProcess], conn: psycopg.Connection[Any]
) -> None:
    server = ingress()
    with smtplib.SMTP(*server.smtp) as client:
        client.ehlo("client.test")
        assert client.mail("<>")[0] == 250
        assert client.rcpt("postmaster")[0] == 250  # RFC 5321 §4.5.1, without a domain
        code, reply = client.data(message("a bounce"))
        assert code == 250
    stored = row(conn, queued_id(reply))
    assert stored["sender"] == ""
    assert stored["recipients"] == ["postmaster@example.com"]


def test_never_an_open_relay_not_even_for_loopback(
    ingress: Callable[..., IngressProcess], conn: psycopg.Connection[Any]
) -> None:
    closed = ingress()
    with smtplib.SMTP(*closed.smtp) as client:
        client.ehlo("client.test")
        client.mail("alice@sender.org")
        code, reply = client.rcpt("eve@elsewhere.org")
        assert (code, reply[:5]) == (554, b"5.7.1")
        assert client.rcpt("bob@sub.example.com")[0] == 554  # only the domains listed
        assert client.rcpt("bob@EXAMPLE.com")[0] == 250
    trusting = ingress("RELAY_NETWORKS = 127.0.0.0/8", name="trusting")
    with smtplib.SMTP(*trusting.smtp) as client:
        client.ehlo("client.test")
        client.mail("alice@sender.org")
        assert client.rcpt("eve@elsewhere.org")[0] == 250
        assert client.data(message())[0] == 250


def test_an_authenticated_user_may_relay_and_is_the_fair_key(
    ingress: Callable[..., IngressProcess], conn: psycopg.Connection[Any]
) -> None:
    server = ingress()
    add_user(server, "alice", "s3cret pass")
    with smtplib.SMTP(*server.smtp) as client:
        client.ehlo("client.test")
        assert "auth" in client.esmtp_features  # loopback: offered without TLS
        code, reply = auth_plain(client, "alice", "wrong")
        assert (code, reply[:5]) == (535, b"5.7.8")
        assert auth_plain(client, "alice", "s3cret pass")[0] == 235
        client.mail("alice@sender.org")
        assert client.rcpt("anyone@elsewhere.org")[0] == 250
        code, reply = client.data(message())
    stored = row(conn, queued_id(reply))
    assert stored["origin_user"] == "alice"
    assert stored["sender_key"] == "user:alice"
    assert b" with ESMTPA id " in bytes(stored["header"])
    assert server.stop() == 0  # its log whole, the session's end included
    assert "s3cret" not in server.log


def test_failed_logins_wait_longer_each_time(ingress: Callable[..., IngressProcess]) -> None:
    server = ingress()
    add_user(server, "alice", "right")
    waits = []
    with smtplib.SMTP(*server.smtp) as client:
        client.ehlo("client.test")
        for _ in range(3):
            started = time.monotonic()
            assert auth_plain(client, "alice", "wrong")[0] == 535
            waits.append(time.monotonic() - started)
    # 0.5 s, then 1 s, then 2 s: lower bounds only (a slow machine only waits longer)
    assert waits[0] >= 0.5
    assert waits[1] >= 1.0
    assert waits[2] >= 2.0


def test_the_limits_of_the_server(
    ingress: Callable[..., IngressProcess], conn: psycopg.Connection[Any]
) -> None:
    server = ingress("MAX_SIZE = 2048\nMAX_RECIPIENTS = 3")
    exactly = b"Subject: big\r\n\r\n" + b"x" * (2048 - 18) + b"\r\n"
    assert len(exactly) == 2048
    with smtplib.SMTP(*server.smtp) as client:
        client.ehlo("client.test")
        assert client.esmtp_features["size"] == "2048"
        assert client.mail("a@sender.org", ["SIZE=2049"])[0] == 552
        client.mail("a@sender.org", ["SIZE=2048"])
        for name in "abc":
            assert client.rcpt(f"{name}@example.com")[0] == 250
        code, reply = client.rcpt("d@example.com")
        assert (code, reply[:5]) == (452, b"4.5.3")
        code, reply = client.data(exactly)
        assert code == 250
        assert bytes(row(conn, queued_id(reply))["body"]) == exactly[16:]
        client.mail("a@sender.org")
        client.rcpt("a@example.com")
        code, reply = client.data(exactly[:-2] + b"y\r\n")
        assert (code, reply[:5]) == (552, b"5.3.4")
        assert client.noop()[0] == 250  # the session goes on
    assert count(conn) == 1


def test_a_full_first_stage_is_452_and_stores_nothing(
    ingress: Callable[..., IngressProcess], conn: psycopg.Connection[Any]
) -> None:
    server = ingress(stages="MAX_LENGTH = 2\nOVERFLOW = reject-publish")
    replies = []
    for n in range(3):
        with smtplib.SMTP(*server.smtp) as client:
            client.ehlo("client.test")
            client.mail("a@sender.org")
            client.rcpt("bob@example.com")
            replies.append(client.data(message(f"m{n}")))
    assert [code for code, _ in replies] == [250, 250, 452]
    assert replies[2][1].startswith(b"4.3.1")
    assert count(conn) == 2


def test_lmtp_on_a_unix_socket_answers_per_recipient_as_the_local_user(
    ingress: Callable[..., IngressProcess], conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    socket_path = tmp_path / "lmtp.sock"
    server = ingress(f"LMTP_LISTEN = {socket_path}")
    assert server.addresses["lmtp"] == str(socket_path)
    assert oct(socket_path.stat().st_mode & 0o777) == "0o660"
    line = Line(str(socket_path))
    assert line.reply()[0].startswith("220 mx.test LMTP Pepsi")
    assert line.command("EHLO client")[0].startswith("500 5.5.1")
    assert "250 DSN" in line.command("LHLO client")
    assert line.command("MAIL FROM:<a@sender.org>")[0].startswith("250")
    for rcpt in ("bob@example.com", "carol@elsewhere.org"):  # local: may send anywhere
        assert line.command(f"RCPT TO:<{rcpt}>")[0].startswith("250")
    assert line.command("DATA")[0].startswith("354")
    line.send(message() + b".\r\n")
    first, second = line.reply(), line.reply()  # one reply per recipient
    assert first == second
    assert first[0].startswith("250 2.0.0 Queued as ")
    line.command("QUIT")
    line.close()
    stored = row(conn, queued_id(first[0]))
    assert stored["origin_user"] == getpass.getuser()
    assert stored["sender_key"] == f"user:{getpass.getuser()}"
    assert stored["origin_peer"] is None
    assert b" with LMTP id " in bytes(stored["header"])


def test_lmtp_on_tcp(ingress: Callable[..., IngressProcess]) -> None:
    server = ingress("LISTEN = off\nLMTP_LISTEN = 127.0.0.1:0")
    address = server.addresses["lmtp"]
    assert isinstance(address, tuple)
    assert "smtp" not in server.addresses
    with smtplib.LMTP(*address) as client:
        assert client.docmd("EHLO", "client")[0] == 500
        assert client.ehlo("client")[0] == 250  # smtplib's LMTP sends LHLO
        client.mail("a@sender.org")
        assert client.rcpt("eve@elsewhere.org")[0] == 554  # not trusted: relay rules hold
        client.rcpt("bob@example.com")
        assert client.data(message())[0] == 250


def test_bare_line_feeds_never_smuggle_a_second_message(
    ingress: Callable[..., IngressProcess], conn: psycopg.Connection[Any]
) -> None:
    server = ingress()
    line = Line(server.smtp)
    line.reply()
    line.command("EHLO client")
    line.send(b"MAIL FROM:<a@sender.org>\r\nRCPT TO:<bob@example.com>\r\nDATA\r\n")
    assert [line.reply()[0][:3] for _ in range(3)] == ["250", "250", "354"]
    line.send(
        b"Subject: one\r\n\r\nhello\n.\nMAIL FROM:<x@sender.org>\nRCPT TO:<bob@example.com>\n"
        b"DATA\nSubject: smuggled\n\nsmuggled body\r\n.\r\n"
    )
    reply = line.reply()[0]
    assert line.command("QUIT")[0].startswith("221")
    line.close()
    assert count(conn) == 1
    stored = row(conn, queued_id(reply))
    assert stored["subject"] == "one"
    assert b"MAIL FROM:<x@sender.org>\r\n" in bytes(stored["body"])  # inside, as text


def test_garbage_gets_replies_and_the_server_goes_on(
    ingress: Callable[..., IngressProcess], conn: psycopg.Connection[Any]
) -> None:
    server = ingress()
    line = Line(server.smtp)
    line.reply()
    for junk in (b"\x00\xff\xfe garbage", b"MAIL", b"RCPT TO:<a@b>", b"DATA", b"x" * 5000,
                 b"\xc3\x28 bad utf-8", b"EHLO", b"MAIL FROM:<a b@c>", b"AUTH PLAIN =="):  # fmt: skip
        line.send(junk + b"\r\n")
        code = line.reply()[-1][:1]
        assert code in ("5",), junk
    assert line.command("EHLO client")[-1].startswith("250 ")
    line.send(b"MAIL FROM:<\xe9@sender.org>\r\n")  # not UTF-8
    assert line.reply()[0].startswith("553 5.1.3")
    line.close()
    with smtplib.SMTP(*server.smtp) as client:
        client.ehlo("client.test")
        client.mail("a@sender.org")
        client.rcpt("bob@example.com")
        assert client.data(message())[0] == 250
    assert server.alive()


def test_help_names_the_commands_the_session_takes(
    ingress: Callable[..., IngressProcess],
) -> None:
    server = ingress("LMTP_LISTEN = 127.0.0.1:0")
    line = Line(server.smtp)
    line.reply()
    line.command("EHLO client")
    listed = line.command("HELP")[-1]
    assert listed.startswith("250 ")
    assert listed.split(": ", 1)[1].split() == [
        "AUTH", "DATA", "EHLO", "HELO", "HELP", "MAIL", "NOOP", "QUIT", "RCPT", "RSET", "VRFY",
    ]  # fmt: skip  # AUTH: offered to a loopback client; no STARTTLS without a certificate
    assert line.command("HELP mail") == [
        "250 2.0.0 Syntax: MAIL FROM:<address> [SP <mail-parameters>]"
    ]
    assert line.command("HELP NOPE")[0].startswith("501 ")
    line.close()
    lmtp = Line(server.addresses["lmtp"])
    lmtp.reply()
    lmtp.command("LHLO client")
    commands = lmtp.command("HELP")[-1].split(": ", 1)[1].split()
    assert "LHLO" in commands
    assert "HELO" not in commands
    assert "EHLO" not in commands
    lmtp.close()


def test_a_slow_client_is_told_421_when_its_time_is_up(
    ingress: Callable[..., IngressProcess],
) -> None:
    server = ingress("TIMEOUT = 2s")
    started = time.monotonic()  # before the server can start its clock
    line = Line(server.smtp)
    line.reply()
    line.send(b"E")  # one byte, then nothing: no command ever completes
    reply = line.reply()
    assert reply[0].startswith("421 4.4.2")
    assert time.monotonic() - started >= 2.0
    assert line.file.readline() == b""  # closed
    line.close()


@pytest.mark.skipif(SWAKS is None, reason="swaks is not installed (scripts/dev.py installs it)")
def test_swaks_delivers_a_message(
    ingress: Callable[..., IngressProcess], conn: psycopg.Connection[Any]
) -> None:
    server = ingress()
    host, port = server.smtp
    result = subprocess.run(
        [str(SWAKS), "--server", f"{host}:{port}", "--from", "a@sender.org", "--to",
         "bob@example.com", "--header", "Subject: from swaks", "--helo", "swaks.test"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    reply = next(line for line in result.stdout.splitlines() if "Queued as" in line)
    stored = row(conn, queued_id(reply))
    assert stored["subject"] == "from swaks"
    assert bytes(stored["header"]).startswith(b"Received: from swaks.test ([127.0.0.1])")


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    return make_certificate(tmp_path, "mx.test")


@pytest.mark.skipif(SWAKS is None, reason="swaks is not installed (scripts/dev.py installs it)")
def test_auth_only_over_tls_from_a_client_that_is_not_loopback(
    ingress: Callable[..., IngressProcess],
    conn: psycopg.Connection[Any],
    certificate: tuple[Path, Path],
) -> None:
    address = outside_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    cert, key = certificate
    server = ingress(f"LISTEN = {address}:0\nTLS_CERT = {cert}\nTLS_KEY = {key}")
    add_user(server, "alice", "s3cret")
    host, port = server.smtp
    with smtplib.SMTP(host, port) as client:  # plain text from a non-loopback address
        client.ehlo("client.test")
        assert "starttls" in client.esmtp_features
        assert "auth" not in client.esmtp_features
        code, reply = client.docmd("AUTH", "PLAIN AGFsaWNlAHMzY3JldA==")
        assert (code, reply[:6]) == (538, b"5.7.11")
        client.mail("a@sender.org")
        assert client.rcpt("eve@elsewhere.org")[0] == 554
    with smtplib.SMTP(host, port) as client:  # STARTTLS, then AUTH is offered
        client.starttls(context=ssl._create_unverified_context())  # self-signed
        client.ehlo("client.test")
        assert "auth" in client.esmtp_features
        assert "starttls" not in client.esmtp_features
    if subprocess.run(["perl", "-MNet::SSLeay", "-e1"], check=False).returncode != 0:
        pytest.skip("swaks cannot speak TLS without Net::SSLeay (scripts/dev.py installs it)")
    result = subprocess.run(
        [str(SWAKS), "--server", f"{host}:{port}", "--tls", "--auth", "PLAIN", "--auth-user",
         "alice", "--auth-password", "s3cret", "--from", "alice@sender.org", "--to",
         "eve@elsewhere.org", "--helo", "swaks.test"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "235 2.7.0 Authentication successful" in result.stdout
    reply = next(line for line in result.stdout.splitlines() if "Queued as" in line)
    stored = row(conn, queued_id(reply))
    assert stored["origin_user"] == "alice"
    header = bytes(stored["header"])
    assert b" with ESMTPSA id " in header
    assert b"(using TLSv1." in header


def test_serve_without_a_listener_is_a_configuration_error(tmp_path: Path, dsn: str) -> None:
    conf = tmp_path / "pepsi.conf"
    conf.write_text("[stage-inbox]\nHANDLER = tests.stages:noop\n")
    result = subprocess.run(
        [sys.executable, "-m", "pepsi", "-c", str(conf), "ingress", "--serve"],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=False,
        env={**IngressProcess(dsn, tmp_path).env()},
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert "nothing to serve" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "pepsi", "-c", str(conf), "ingress", "--serve", "--stage", "x"],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--serve takes no publishing option (got --stage)" in result.stderr


def test_sigterm_stops_the_server_cleanly(ingress: Callable[..., IngressProcess]) -> None:
    server = ingress()
    idle = Line(server.smtp)
    idle.reply()
    assert server.stop() == 0
    assert idle.reply()[0].startswith("421 4.3.2")
    idle.close()
    wait_until(lambda: "stopped" in server.log, what="the ingress's last log line")


def test_a_port_in_use_is_one_line_and_exit_1(tmp_path: Path, dsn: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = IngressProcess(dsn, tmp_path, f"LISTEN = 127.0.0.1:{port}")
        result = subprocess.run(
            [sys.executable, "-m", "pepsi", "-c", str(server.conf), "ingress", "--serve"],
            capture_output=True, text=True, cwd=REPO, timeout=60, check=False, env=server.env(),
        )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("pepsi: cannot listen: ")
    assert "Traceback" not in result.stderr


def test_a_failed_tls_handshake_is_one_log_line(
    ingress: Callable[..., IngressProcess], certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    server = ingress(f"TLS_CERT = {cert}\nTLS_KEY = {key}")
    line = Line(server.smtp)
    line.reply()
    assert "250-STARTTLS" in line.command("EHLO client")
    assert line.command("STARTTLS")[0].startswith("220")
    line.send(b"this is no TLS client hello\r\n" * 4)
    line.file.read()  # returns only once the server has closed the connection (else: timeout)
    line.close()
    wait_until(lambda: "TLS handshake with 127.0.0.1 failed" in server.log, what="its log line")
    assert "Traceback" not in server.log
    with smtplib.SMTP(*server.smtp) as client:  # and it goes on serving
        client.starttls(context=ssl._create_unverified_context())  # self-signed
        client.ehlo("client.test")
        client.mail("a@sender.org")
        client.rcpt("bob@example.com")
        assert client.data(message())[0] == 250
