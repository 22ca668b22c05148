"""The ingress's commits (pepsi.mail.ingress.committer) against a real database, in process.

Concurrent sessions share commits: while one commit waits, the messages that
arrive meanwhile go together into the next. Each commit is one transaction
and one NOTIFY, so a burst costs the dispatcher one wakeup, not one per mail.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import psycopg

from pepsi.config import load_config
from pepsi.errors import DatabaseUnavailable
from pepsi.mail.ingress.committer import Committer, reply_for
from pepsi.mail.protocol import replies
from pepsi.publishing import OutgoingMessage
from pepsi.publishing.async_client import AsyncPublisher
from pepsi.publishing.errors import InvalidMessage, NotConfirmed, Rejected

CONF = "[stage-inbox]\nHANDLER = tests.stages:noop\n"
SESSIONS = 20


def mail(n: int) -> OutgoingMessage:
    return OutgoingMessage(
        "inbox", b"body\r\n", b"Subject: x\r\n", sender="a@sender.org",
        recipients=("bob@example.com",), origin_peer="192.0.2.1", subject=f"m{n}",
    )  # fmt: skip


def test_concurrent_sessions_share_commits_and_notify_once_per_commit(
    dsn: str, tmp_path: Path
) -> None:
    conf = tmp_path / "pepsi.conf"
    conf.write_text(CONF)

    async def scenario() -> tuple[list[str], int, int]:
        listener = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        await listener.execute("LISTEN workqueue")
        blocker = psycopg.connect(dsn)  # holds the queue table: the first commits wait
        observer = psycopg.connect(dsn, autocommit=True)
        blocker.execute("LOCK TABLE pepsi.workqueue IN EXCLUSIVE MODE")
        publisher = AsyncPublisher(load_config(conf), dsn)
        await publisher.open()
        committer = Committer(publisher)
        committer.start()
        assert committer.pipeline is not None

        async def waiting_on_the_lock(sessions: int, queued: int) -> None:
            assert committer.pipeline is not None
            deadline = time.monotonic() + 30
            while True:
                found = observer.execute(  # its own: a transaction sees one snapshot
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND datname = current_database()"
                ).fetchone()
                assert found is not None
                if found[0] == sessions and committer.pipeline.queue.qsize() == queued:
                    return
                assert time.monotonic() < deadline, (found, committer.pipeline.queue.qsize())
                await asyncio.sleep(0.01)

        # The first message's commit waits on the lock; the other 19 arrive meanwhile.
        tasks = [asyncio.create_task(committer.commit(mail(0), "Q0"))]
        await waiting_on_the_lock(1, 0)
        tasks += [
            asyncio.create_task(committer.commit(mail(n), f"Q{n}")) for n in range(1, SESSIONS)
        ]
        await waiting_on_the_lock(1, SESSIONS - 1)
        blocker.commit()
        results = await asyncio.gather(*tasks)
        await committer.close()
        await publisher.close()
        transactions = blocker.execute(
            "SELECT count(DISTINCT xmin::text) FROM pepsi.workqueue"
        ).fetchone()
        blocker.close()
        observer.close()
        notifications = 0
        async for _ in listener.notifies(timeout=0.5):
            notifications += 1
        await listener.close()
        assert transactions is not None
        return [str(reply) for reply, _ in results], int(transactions[0]), notifications

    answers, transactions, notifications = asyncio.run(scenario())
    assert all(answer.startswith("250 2.0.0 Queued as ") for answer in answers)
    assert transactions == 2  # the one that waited on the lock, then the other 19 together
    assert notifications == 2


def test_each_failure_has_its_reply() -> None:
    assert reply_for(Rejected("stage inbox is full", "inbox")) == replies.STAGE_FULL
    assert reply_for(NotConfirmed("connection lost before the confirm")) == replies.NOT_STORED
    assert reply_for(DatabaseUnavailable("cannot connect")) == replies.NOT_STORED
    assert reply_for(InvalidMessage("message is too big")) == replies.BAD_CONTENT
    assert reply_for(RuntimeError("a bug")) == replies.NOT_STORED  # never 250
