"""Mail out (SPEC M-4 to M-6) with real mail software: Postfix receives, dnsmasq answers.

A real dispatcher runs the relay stages in real worker processes; Postfix
(a second instance, configured as Debian ships it) is the smarthost or the
MX host and delivers to a Maildir the test reads; dnsmasq serves the MX and
DKIM records on a loopback port.
"""

from __future__ import annotations

import email
import signal
import smtplib
import subprocess
import sys
from collections.abc import Iterator
from email import policy
from pathlib import Path
from typing import Any

import dns.resolver
import psutil
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from pepsi.config import load_config
from pepsi.publishing import OutgoingMessage, Publisher
from tests import postfix
from tests.mail_server import IngressProcess, add_user, make_certificate, queued_id
from tests.scenarios.conftest import Pipeline, wait_until

pytestmark = pytest.mark.skipif(postfix.missing() is not None, reason=str(postfix.missing()))

DOMAINS = ("example.test", "sender.test")
RETRIES = "RETRY_DELAY = 1s\nRETRY_MAX_DELAY = 1s\n"


@pytest.fixture
def receiver(request: pytest.FixtureRequest) -> Iterator[postfix.Postfix]:
    """Postfix as shipped (it offers PIPELINING), or without PIPELINING where a test asks
    (the relay's client then waits for each reply before the next command)."""
    pipelining = getattr(request, "param", "pipelining") == "pipelining"
    settings = {} if pipelining else {"smtpd_discard_ehlo_keywords": "pipelining"}
    server = postfix.Postfix(domains=DOMAINS, settings=settings).start()
    yield server
    server.close()


def smarthost(server: postfix.Postfix, extra: str = "") -> str:
    return (
        "[stage-relay]\nPROGRAM = pepsi-stage-relay-to-smarthost\nHOST = 127.0.0.1\n"
        f"PORT = {server.port}\nTLS = none\nDSN_STAGE = relay\n{RETRIES}{extra}"
    )


def mail(
    subject: str, *recipients: str, sender: str = "alice@sender.test", body: bytes = b"Hello.\r\n"
) -> OutgoingMessage:
    header = (
        f"From: Alice <{sender}>\r\nTo: {', '.join(recipients)}\r\nSubject: {subject}\r\n"
        f"Message-ID: <{subject}@sender.test>\r\n"
    ).encode()
    return OutgoingMessage(
        "relay", body, header, sender=sender, recipients=tuple(recipients),
        subject=subject,
    )  # fmt: skip


def publish(pipeline: Pipeline, messages: list[OutgoingMessage]) -> None:
    with Publisher.connect(load_config(pipeline.conf), pipeline.dsn) as publisher:
        for start in range(0, len(messages), 500):
            publisher.publish_many(messages[start : start + 500])


def delivered_count(server: postfix.Postfix) -> int:
    folder = server.mail / "all" / "new"
    return len(list(folder.iterdir())) if folder.exists() else 0


def parse(data: bytes) -> email.message.EmailMessage:
    message = email.message_from_bytes(data, policy=policy.default)
    assert isinstance(message, email.message.EmailMessage)
    return message


def reported(report: bytes) -> list[str]:
    """The Final-Recipient lines of a delivery status notification."""
    return [
        line.split(";", 1)[1].strip()
        for line in report.decode().splitlines()
        if line.startswith("Final-Recipient:")
    ]


DOTTED = b"Hello.\r\n.a line that starts with a dot\r\n.\r\n..two\r\nlast line, no end"


@pytest.mark.parametrize("receiver", ["pipelining", "one command at a time"], indirect=True)
def test_accepted_deferred_and_refused_recipients_each_end_their_own_way(
    pipeline: Pipeline, receiver: postfix.Postfix
) -> None:
    receiver.access({
        "defer@example.test": "450 4.2.0 try later",
        "bad@example.test": "550 5.1.1 no such user here",
        "worse@example.test": "550 5.1.1 nobody here either",
    })  # fmt: skip
    pipeline.configure(smarthost(receiver))
    pipeline.start()
    three = mail("three", "ok@example.test", "defer@example.test", "bad@example.test", body=DOTTED)
    refused = mail("none", "bad@example.test", "worse@example.test", sender="carol@sender.test")
    publish(pipeline, [three, refused])
    (delivered,) = wait_until(lambda: receiver.mailbox("ok@example.test"), what="the delivery")
    # the dots as they were (stuffed on the wire), the last line ended; a Maildir has LF
    assert parse(delivered).get_payload(decode=True) == DOTTED.replace(b"\r\n", b"\n") + b"\n"
    (bounce,) = wait_until(lambda: receiver.mailbox("alice@sender.test"), what="the report")
    dsn = parse(bounce)
    assert dsn["Return-Path"] == "<>"  # from the null sender
    assert dsn.get_content_type() == "multipart/report"
    assert reported(bounce) == ["bad@example.test"]  # only the refused recipient
    assert b"no such user here" not in bounce  # the reason is generic
    (both,) = wait_until(lambda: receiver.mailbox("carol@sender.test"), what="carol's report")
    assert sorted(reported(both)) == ["bad@example.test", "worse@example.test"]
    assert pipeline.scalar(
        "SELECT state->>'temporary_failures' FROM pepsi.workqueue"
        " WHERE recipients = '{defer@example.test}'"
    )
    receiver.access({"bad@example.test": "550 5.1.1 no such user here"})  # defer@ now accepted
    wait_until(lambda: receiver.mailbox("defer@example.test"), what="the retried delivery")
    wait_until(pipeline.settled, what="the pipeline to settle")
    wait_until(receiver.queue_empty, what="Postfix to deliver what it accepted")
    assert len(receiver.mailbox("ok@example.test")) == 1  # exactly once: not sent again
    assert len(receiver.mailbox("defer@example.test")) == 1
    assert len(receiver.mailbox("alice@sender.test")) == 1
    assert len(receiver.mailbox("carol@sender.test")) == 1
    assert len(receiver.mailbox("bad@example.test")) == 0


def test_a_receiver_that_is_down_loses_nothing(
    pipeline: Pipeline, receiver: postfix.Postfix
) -> None:
    receiver.stop()
    pipeline.configure(smarthost(receiver))
    pipeline.start()
    (wid,) = pipeline.publish("relay", body=b"x\r\n", header=b"Subject: down\r\n",
                              sender="alice@sender.test", recipients=["ok@example.test"])  # fmt: skip

    def failed_twice() -> tuple[str, str, dict[str, Any]] | None:
        row = pipeline.row(wid)
        return row if row is not None and row[2].get("temporary_failures", 0) >= 2 else None

    stage, status, state = wait_until(failed_twice, what="two failed attempts")
    assert (stage, status) == ("relay", "paused")
    assert "Connection refused" in state["last_error"]
    receiver.start()
    wait_until(lambda: receiver.mailbox("ok@example.test"), what="the delivery")
    wait_until(pipeline.settled, what="the pipeline to settle")
    wait_until(receiver.queue_empty, what="Postfix to deliver what it accepted")
    assert len(receiver.mailbox("ok@example.test")) == 1


def relay_workers() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            env = proc.info.get("environ") or {}
        except psutil.Error:
            continue
        if env.get("PEPSI_STAGE") == "relay" and "worker" in (proc.info.get("cmdline") or []):
            found.append(proc)
    return found


def test_kill_9_of_the_relay_workers_loses_no_recipient(
    pipeline: Pipeline, receiver: postfix.Postfix
) -> None:
    """Every recipient delivered at least once; duplicates counted and bounded: SMTP
    cannot promise fewer when a worker dies between the remote's 250 and its commit."""
    pipeline.configure(smarthost(receiver, "PARALLELISM = 4\n"), STRIKE_DELAY="200ms")
    pipeline.start()
    count = 2000
    publish(pipeline, [mail(f"m{n}", f"r{n}@example.test") for n in range(count)])
    kills = 0
    for _ in range(2):  # two rounds: no message can collect the three strikes that fail it
        before = delivered_count(receiver)
        wait_until(lambda n=before: delivered_count(receiver) >= n + 100, what="deliveries")
        workers = wait_until(relay_workers, what="relay workers")
        for proc in workers:
            proc.send_signal(signal.SIGKILL)
        kills += len(workers)
    wait_until(pipeline.settled, timeout=180, what="every message to go out")
    wait_until(receiver.queue_empty, what="Postfix to deliver what it accepted")
    counts = receiver.delivered()
    copies = [counts[f"r{n}@example.test"] for n in range(count)]
    assert min(copies) >= 1, f"{copies.count(0)} recipients never delivered"
    duplicates = sum(c - 1 for c in copies)
    print(f"{kills} relay workers killed: {duplicates} duplicates among {count} messages")
    assert duplicates <= kills  # at most the message each killed worker was sending


@pytest.fixture
def dkim_key(tmp_path: Path) -> tuple[Path, bytes]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    path = tmp_path / "dkim.key"
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return path, public


VERIFY = """
import dkim, sys
name, record = sys.argv[1].encode(), sys.argv[2].encode()
def txt(asked, timeout=5):
    return record if asked == name else b""
sys.exit(0 if dkim.verify(sys.stdin.buffer.read(), dnsfunc=txt) else 1)
"""


def verified_by_dkimpy(message: bytes, name: str, record: bytes) -> bool:
    """dkimpy's verifier as it ships, in a process of its own (this one may have had
    Pepsi's signing hooks installed by a unit test), `record` the TXT of `name` only."""
    done = subprocess.run(
        [sys.executable, "-c", VERIFY, name, record.decode()], input=message, check=False
    )
    return done.returncode == 0


def test_smtp_in_dkim_signed_and_out_to_the_second_mx(
    pipeline: Pipeline, tmp_path: Path, dkim_key: tuple[Path, bytes], dsn: str
) -> None:
    import base64  # noqa: PLC0415

    key_file, public = dkim_key
    receiver = postfix.Postfix(domains=("mx.test",)).start()
    record = "v=DKIM1; k=rsa; p=" + base64.b64encode(public).decode()
    names = postfix.Dnsmasq(
        mx=[("mx.test", "mx1.mx.test", 10), ("mx.test", "mx2.mx.test", 20)],
        hosts=[("mx1.mx.test", "127.0.0.2"), ("mx2.mx.test", "127.0.0.1")],  # mx1: nobody there
        txt=[("s1._domainkey.sign.test", record)],
    )
    try:
        pipeline.configure(
            "[stage-sign]\nPROGRAM = pepsi-stage-dkim-sign\nDOMAIN = sign.test\nSELECTOR = s1\n"
            f"KEY_FILE = {key_file}\nNEXT = out\n"
            "[stage-out]\nPROGRAM = pepsi-stage-relay-to-internet\n"
            f"PORT = {receiver.port}\nNAMESERVERS = 127.0.0.1:{names.port}\n{RETRIES}"
        )
        pipeline.start()
        ingress = IngressProcess(
            dsn,
            tmp_path,
            conf=pipeline.conf.read_text()
            + "[pepsi-ingress]\nLISTEN = 127.0.0.1:0\nSTAGE = sign\nRELAY_NETWORKS = 127.0.0.0/8\n",
        )
        ingress.start()
        try:
            with smtplib.SMTP(*ingress.smtp) as client:
                client.ehlo("client.test")
                client.mail("alice@sign.test")
                client.rcpt("bob@mx.test")
                code, reply = client.data(
                    b"From: Alice <alice@sign.test>\r\nTo: bob@mx.test\r\nSubject: signed\r\n"
                    b"Message-ID: <s1@sign.test>\r\n\r\nSigned and sent.\r\n"
                )
                assert code == 250
                queued_id(reply)
            (delivered,) = wait_until(lambda: receiver.mailbox("bob@mx.test"), what="delivery")
        finally:
            ingress.close()
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = ["127.0.0.1"]
        resolver.port = names.port

        name = "s1._domainkey.sign.test."  # from the names server, as a verifier reads it
        record = b"".join(resolver.resolve(name, "TXT")[0].strings)
        assert delivered.count(b"DKIM-Signature:") == 1
        assert verified_by_dkimpy(delivered, name, record), "the signature does not verify"
        assert b"Received: from client.test ([127.0.0.1])" in delivered
    finally:
        names.stop()
        receiver.close()


def test_connections_are_reused_for_the_next_messages(
    pipeline: Pipeline, receiver: postfix.Postfix
) -> None:
    pipeline.configure(smarthost(receiver, "PARALLELISM = 1\n"))
    pipeline.start()
    publish(pipeline, [mail(f"reuse{n}", f"r{n}@example.test") for n in range(5)])
    wait_until(pipeline.settled, what="the messages to go out")
    # settled means Postfix answered 250; its own delivery to the Maildir comes after
    wait_until(receiver.queue_empty, what="Postfix to deliver what it accepted")
    counts = receiver.delivered()
    assert [counts[f"r{n}@example.test"] for n in range(5)] == [1] * 5

    # Postfix's smtpd logs each session's commands when it ends: the worker's ends when it
    # stops (idle), having carried the five messages (the readiness probe's has none)
    def sessions() -> list[str]:
        return [
            line for line in receiver.log.splitlines()
            if "disconnect from" in line and "commands=0/0" not in line
        ]  # fmt: skip

    wait_until(lambda: any(" mail=5 " in line for line in sessions()), what="its session's end")
    assert len(sessions()) == 1, sessions()


def test_a_smarthost_with_starttls_and_auth(pipeline: Pipeline, tmp_path: Path, dsn: str) -> None:
    """Pepsi's own ingress is the smarthost here: STARTTLS with a certificate the relay
    verifies, then AUTH PLAIN with the secret from AUTH_SECRET_FILE."""
    cert, key = make_certificate(tmp_path, "localhost")
    (tmp_path / "auth.secret").write_text("relay secret\n")
    smarthost_conf = (
        "[stage-inbox]\nHANDLER = tests.stages:noop\nNEXT = held\n"
        "[stage-held]\nHANDLER = tests.stages:noop\n"
        "[pepsi-ingress]\nLISTEN = 127.0.0.1:0\nSTAGE = held\nDOMAINS = other.test\n"
        f"TLS_CERT = {cert}\nTLS_KEY = {key}\n"
    )
    ingress = IngressProcess(dsn, tmp_path, conf=smarthost_conf, name="smarthost")
    ingress.start()
    try:
        add_user(ingress, "relay", "relay secret")
        pipeline.configure(
            "[stage-relay]\nPROGRAM = pepsi-stage-relay-to-smarthost\nHOST = localhost\n"
            f"PORT = {ingress.smtp[1]}\nTLS = starttls\nTLS_CA_FILE = {cert}\n"
            f"AUTH_USER = relay\nAUTH_SECRET_FILE = {tmp_path / 'auth.secret'}\n{RETRIES}"
        )  # no [stage-held] here: this dispatcher leaves the smarthost's messages alone
        pipeline.start()
        publish(pipeline, [mail("via-smarthost", "anyone@elsewhere.test")])
        stored = wait_until(
            lambda: pipeline.scalar("SELECT origin_user FROM pepsi.workqueue WHERE stage = 'held'"),
            what="the message at the smarthost",
        )
        assert stored == "relay"  # logged in: it may relay to any domain
        header = pipeline.scalar(
            "SELECT b.header FROM pepsi.workqueue w JOIN pepsi.workqueue_body b USING (body_id)"
            " WHERE w.stage = 'held'"
        )
        assert b" with ESMTPSA id " in bytes(header)  # TLS and AUTH
    finally:
        ingress.close()
