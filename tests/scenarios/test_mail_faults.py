"""The ingress under faults (SPEC M-3): nothing that got 250 is lost, nothing else is 250.

A kill -9 while clients send, the database going away and coming back, a
flood of idle connections, and the whole path with a real dispatcher.
"""

from __future__ import annotations

import resource
import signal
import smtplib
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import conninfo, sql

from tests.mail_server import IngressProcess, Line, message, queued_id
from tests.scenarios.conftest import Pipeline, wait_until


def send(address: tuple[str, int], subject: str) -> tuple[int, bytes]:
    with smtplib.SMTP(*address, timeout=30) as client:
        client.ehlo("client.test")
        client.mail("a@sender.org")
        client.rcpt("bob@example.com")
        return client.data(message(subject, Message_ID=f"<{subject}@sender.org>"))


def copies(conn: psycopg.Connection[Any]) -> dict[str, int]:
    rows = conn.execute("SELECT subject, count(*) FROM pepsi.workqueue GROUP BY subject").fetchall()
    return {str(subject): int(n) for subject, n in rows}


def test_kill_9_loses_no_message_that_got_250(
    ingress: Callable[..., IngressProcess], conn: psycopg.Connection[Any]
) -> None:
    server = ingress()
    acked: list[str] = []
    unacked: list[str] = []
    lock = threading.Lock()
    many_acked = threading.Event()

    def client(number: int) -> None:
        for n in range(200):
            subject = f"c{number}-{n}"
            try:
                code, _ = send(server.smtp, subject)
            except (OSError, smtplib.SMTPException):
                code = 0
            with lock:
                (acked if code == 250 else unacked).append(subject)
                if len(acked) >= 150:
                    many_acked.set()
            if code == 0:
                return  # the server is gone: this client stops, as a real one would retry

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    assert many_acked.wait(60)
    server.stop(signal.SIGKILL)
    for thread in threads:
        thread.join(60)
    stored = copies(conn)
    assert len(acked) >= 150
    assert all(stored.get(subject) == 1 for subject in acked), "a 250 lost or doubled"
    # What got no 250 is absent or present once; its client sends it again.
    assert all(stored.get(subject, 0) <= 1 for subject in unacked)
    again = ingress(name="again")
    for subject in unacked:
        assert send(again.smtp, subject)[0] == 250
    stored = copies(conn)
    assert all(stored.get(subject) == 1 for subject in acked)
    assert all(stored.get(subject, 0) >= 1 for subject in unacked)


def test_the_database_going_away_is_451_and_its_return_needs_no_restart(
    ingress: Callable[..., IngressProcess], dsn: str, admin_dsn: str, conn: psycopg.Connection[Any]
) -> None:
    server = ingress()
    name = str(conninfo.conninfo_to_dict(dsn)["dbname"])
    database = sql.Identifier(name)

    def transaction(client: smtplib.SMTP, subject: str) -> tuple[int, bytes]:
        client.mail("a@sender.org")
        client.rcpt("bob@example.com")
        return client.data(message(subject))

    with smtplib.SMTP(*server.smtp, timeout=60) as client:  # one session through it all
        client.ehlo("client.test")
        assert transaction(client, "before")[0] == 250
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(database))
            try:
                ended = admin.execute(
                    "SELECT count(pg_terminate_backend(pid, 10000)) FROM pg_stat_activity"
                    " WHERE datname = %s AND application_name = 'pepsi-publish'",
                    (name,),
                ).fetchone()
                assert ended is not None
                assert ended[0] >= 1
                for attempt in range(3):  # a broken connection, then no connection at all
                    code, reply = transaction(client, f"during-{attempt}")
                    assert (code, reply[:5]) == (451, b"4.3.0")
                assert send(server.smtp, "another session")[0] == 451
            finally:
                admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(database))
        assert transaction(client, "after, same session")[0] == 250
    assert send(server.smtp, "after, new session")[0] == 250
    # a 451 stored nothing; the server was never restarted
    assert copies(conn) == {"before": 1, "after, same session": 1, "after, new session": 1}
    assert server.alive()


def test_a_thousand_idle_connections_each_get_a_reply_and_others_are_served(
    ingress: Callable[..., IngressProcess],
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this machine allows {hard} open files, the test needs 1 200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    server = ingress()
    before = server.rss()
    idle = [Line(server.smtp) for _ in range(1000)]
    try:
        greetings = [line.reply()[0][:9] for line in idle]
        # CLIENT_CONNECTION_LIMIT (50): one address cannot take every slot.
        assert greetings.count("220 mx.te") == 50
        assert greetings.count("421 4.7.0") == 950
        # Another client is served all the while (127.0.0.2 is loopback too).
        other = Line(server.smtp, source="127.0.0.2")
        assert other.reply()[0].startswith("220 ")
        other.command("EHLO other")
        other.command("MAIL FROM:<a@sender.org>")
        other.command("RCPT TO:<bob@example.com>")
        assert other.command("DATA")[0].startswith("354")
        other.send(message("while flooded") + b".\r\n")
        assert other.reply()[0].startswith("250 2.0.0 Queued as ")
        other.close()
        assert server.rss() - before < 64 * 1024 * 1024
    finally:
        for line in idle:
            line.close()
    assert server.alive()


def test_mail_goes_through_a_real_dispatcher(
    pipeline: Pipeline, ingress: Callable[..., IngressProcess]
) -> None:
    pipeline.configure("[stage-inbox]\nHANDLER = tests.stages:noop\n")
    pipeline.start()
    server = ingress()
    ids = [queued_id(send(server.smtp, f"m{n}")[1]) for n in range(20)]
    assert len(set(ids)) == 20
    wait_until(lambda: pipeline.remaining() == 0, what="the dispatcher to finish the mail")
