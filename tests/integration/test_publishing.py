"""Publishing (issue 4): confirms, batches, outbox, dedup, routing, limits, TTL."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import conninfo

from pepsi.config import load_config
from pepsi.errors import DatabaseBusy, DatabaseLost, DatabaseUnavailable, SchemaMismatch
from pepsi.publishing import (
    AsyncPublisher,
    InvalidMessage,
    NoRoute,
    NotConfirmed,
    NotOpen,
    OutgoingMessage,
    Publisher,
    PublishFailed,
    Rejected,
)
from tests.commits import committed
from tests.scenarios.conftest import REPO

Conn = psycopg.Connection[tuple[Any, ...]]

CONF = """
[pepsi-ingress]
MAX_MESSAGE_SIZE = 4K
DEDUP_WINDOW = 1h
[stage-inbound]
HANDLER = tests.stages:noop
[stage-small]
HANDLER = tests.stages:noop
MAX_LENGTH = 5
[stage-dropping]
HANDLER = tests.stages:noop
MAX_LENGTH = 5
OVERFLOW = drop-head
BOUNCE_STAGE = dlq
[stage-dropping-nowhere]
HANDLER = tests.stages:noop
MAX_LENGTH = 2
OVERFLOW = drop-head
[stage-short]
HANDLER = tests.stages:noop
TTL = 1h
BOUNCE_STAGE = dlq
[stage-dlq]
HANDLER = tests.stages:noop
"""


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF)
    return path


@pytest.fixture
def pub(conf: Path, dsn: str) -> Iterator[Publisher]:
    with Publisher(load_config(conf), dsn) as publisher:
        yield publisher


def count(conn: Conn, where: str = "true", *params: Any) -> int:
    row = conn.execute(f"SELECT count(*) FROM pepsi.workqueue WHERE {where}", params).fetchone()
    assert row is not None
    return int(row[0])


def test_publish_is_committed_with_everything_it_carries(pub: Publisher, conn: Conn) -> None:
    wid = pub.publish(
        "inbound",
        "héllo",
        header=b"Subject: hi\r\n",
        sender="a@example.org",
        recipients=["b@example.net", "c@example.net"],
        origin_peer="2001:db8::1",
        message_id="m-1",
        subject="hi",
        header_from="A <a@example.org>",
        content_type="text/plain",
        correlation_id="c-9",
        properties={"priority": 3},
    )
    row = conn.execute(
        "SELECT stage, status::text, sender, recipients, host(origin_peer), message_id, subject,"
        " header_from, content_type, correlation_id, properties, sender_key, b.header, b.body"
        " FROM pepsi.workqueue w JOIN pepsi.workqueue_body b USING (body_id)"
        " WHERE workqueue_id = %s",
        (wid,),
    ).fetchone()
    assert row == (
        "inbound", "pending", "a@example.org", ["b@example.net", "c@example.net"],
        "2001:db8::1", "m-1", "hi", "A <a@example.org>", "text/plain", "c-9",
        {"priority": 3}, "ip:2001:db8::/64", b"Subject: hi\r\n", "héllo".encode(),
    )  # fmt: skip


@pytest.mark.usefixtures("no_autovacuum")
def test_batch_is_one_transaction_one_notify_few_round_trips(
    conf: Path, dsn: str, admin_dsn: str, conn: Conn
) -> None:
    listener = psycopg.connect(dsn, autocommit=True)
    listener.execute("LISTEN workqueue")
    dbname = str(conninfo.conninfo_to_dict(dsn)["dbname"])
    conn.close()
    listener_pid = listener.info.backend_pid
    with psycopg.connect(admin_dsn, autocommit=True) as admin:

        def xacts() -> int:
            return committed(admin, dbname, keep={listener_pid})

        config = load_config(conf)
        before = xacts()
        Publisher.connect(config, dsn).close()
        baseline = xacts() - before
        before = xacts()
        with Publisher(config, dsn) as publisher:
            ids = publisher.publish_many(
                OutgoingMessage("inbound", b"x" * 1024, message_id=f"b{i}") for i in range(1000)
            )
        used = xacts() - before - baseline
    assert len(set(ids)) == 1000
    assert ids == sorted(ids)  # FIFO order is the order given
    assert used == 1  # the whole batch: one statement, one transaction
    notes = list(listener.notifies(timeout=1))
    listener.close()
    assert [n.channel for n in notes] == ["workqueue"]


def test_outbox_message_exists_iff_the_callers_transaction_commits(
    pub: Publisher, dsn: str
) -> None:
    listener = psycopg.connect(dsn, autocommit=True)
    listener.execute("LISTEN workqueue")
    with psycopg.connect(dsn) as caller:
        caller.execute("CREATE TABLE orders (id int)")
        caller.commit()
        with caller.transaction():
            caller.execute("INSERT INTO orders VALUES (1)")
            kept = pub.publish("inbound", b"kept", connection=caller)
            # not visible, not notified before the commit
            with psycopg.connect(dsn, autocommit=True) as other:
                assert count(other, "workqueue_id = %s", kept) == 0
            assert list(listener.notifies(timeout=0.2)) == []
        assert len(list(listener.notifies(timeout=1))) == 1
        lost = 0
        try:
            with caller.transaction():
                caller.execute("INSERT INTO orders VALUES (2)")
                lost = pub.publish("inbound", b"lost", connection=caller)
                raise RuntimeError("the caller's work failed")
        except RuntimeError:
            pass
        assert list(listener.notifies(timeout=0.2)) == []
    listener.close()
    with psycopg.connect(dsn, autocommit=True) as check:
        assert count(check, "workqueue_id = %s", kept) == 1
        assert count(check, "workqueue_id = %s", lost) == 0
        assert check.execute("SELECT array_agg(id) FROM orders").fetchone() == ([1],)


def test_dedup_returns_the_original_even_after_it_finished(pub: Publisher, conn: Conn) -> None:
    first = pub.publish("inbound", b"1", message_id="order-7", dedup=True)
    assert pub.publish("inbound", b"2", message_id="order-7", dedup=True) == first
    assert count(conn) == 1
    conn.execute("DELETE FROM pepsi.workqueue")  # the message finished
    assert pub.publish("inbound", b"3", message_id="order-7", dedup=True) == first
    assert count(conn) == 0
    # duplicates inside one batch collapse onto one message
    msg = OutgoingMessage("inbound", b"x", message_id="order-8", dedup=True)
    a, b = pub.publish_many([msg, msg])
    assert a == b
    assert count(conn) == 1
    # without dedup the same message id is just metadata
    pub.publish("inbound", b"x", message_id="order-8")
    assert count(conn) == 2
    # past the window the id is free again, and the sweep forgets old entries
    conn.execute("UPDATE pepsi.publish_dedup SET published = now() - interval '2 hours'")
    again = pub.publish("inbound", b"4", message_id="order-7", dedup=True)
    assert again != first
    row = conn.execute("SELECT pepsi.publish_dedup_sweep(3600)").fetchone()
    assert row == (1,)  # order-8's entry is older than the window; order-7's was renewed


def test_concurrent_dedup_publishes_one_message(conf: Path, dsn: str, conn: Conn) -> None:
    results: list[int] = []
    config = load_config(conf)

    def publish() -> None:
        with Publisher(config, dsn) as publisher:
            results.append(publisher.publish("inbound", b"x", message_id="same", dedup=True))

    threads = [threading.Thread(target=publish) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(results) == 6
    assert len(set(results)) == 1
    assert count(conn) == 1


def test_no_route(pub: Publisher, conn: Conn) -> None:
    with pytest.raises(NoRoute, match="no stage named 'nowhere'"):
        pub.publish("nowhere", b"x")
    with pytest.raises(NoRoute):
        pub.publish_many([OutgoingMessage("inbound"), OutgoingMessage("nowhere")])
    assert count(conn) == 0
    # a stage added through the database overlay is a route
    conn.execute(
        "INSERT INTO pepsi.config_override VALUES ('stage-added', 'HANDLER', 'tests.stages:noop')"
    )
    assert pub.publish("added", b"x") > 0


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"sender": "not an address"}, "sender is not an address"),
        ({"sender": b"\xff@x.org"}, "sender is not UTF-8"),
        ({"recipients": ["ok@x.org", "bad"]}, "recipient is not an address"),
        ({"recipients": "a@x.org"}, "recipients must be a list"),
        ({"origin_peer": "300.1.1.1"}, "origin_peer is not an IP address"),
        ({"body": b"x" * 5000}, "over the limit of 4096"),
        ({"properties": {"x": object()}}, "properties are not JSON"),
        ({"dedup": True}, "dedup=True needs a message_id"),
        ({"expires": datetime(2030, 1, 1)}, "timezone-aware"),
        ({"expires": -5}, "seconds > 0"),
        ({"subject": "a\x00b"}, "NUL"),
        ({"body": 42}, "body must be bytes or str"),
    ],
)
def test_invalid_input_is_refused_before_anything_is_written(
    pub: Publisher, conn: Conn, fields: dict[str, Any], problem: str
) -> None:
    body = fields.pop("body", b"ok")
    with pytest.raises(InvalidMessage, match=problem):
        pub.publish_many(
            [OutgoingMessage("inbound", b"fine"), OutgoingMessage("inbound", body, **fields)]
        )
    assert count(conn) == 0


def test_unknown_keyword_is_a_clear_error(pub: Publisher) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'recipient'"):
        pub.publish("inbound", b"x", recipient="a@b.c")


def test_publish_takes_a_message_object_too(pub: Publisher, conf: Path, dsn: str) -> None:
    message = OutgoingMessage("inbound", b"made before", sender="a@b.c")
    wid = pub.publish(message)
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT stage, sender FROM pepsi.workqueue WHERE workqueue_id = %s", (wid,)
        ).fetchone()
    assert row == ("inbound", "a@b.c")
    with pytest.raises(TypeError, match=r"^publish\(message\) takes the message alone"):
        pub.publish(message, b"another body")
    with pytest.raises(TypeError, match="a stage name or an OutgoingMessage first, not dict"):
        pub.publish({"stage": "inbound"})  # type: ignore[arg-type]

    async def in_async() -> int:
        async with await AsyncPublisher.connect(load_config(conf), dsn) as publisher:
            return await publisher.publish(message)

    assert asyncio.run(in_async()) > wid


def test_max_length_reject_publish(pub: Publisher, conn: Conn) -> None:
    pub.publish_many([OutgoingMessage("small")] * 4)
    with pytest.raises(Rejected, match="stage small is full") as info:
        pub.publish_many([OutgoingMessage("small")] * 2)  # the whole batch is refused
    assert info.value.stage == "small"
    assert count(conn, "stage = 'small'") == 4
    pub.publish("small")
    assert count(conn, "stage = 'small'") == 5
    with pytest.raises(Rejected):
        pub.publish("small")
    # rows being worked on do not count: only what waits
    conn.execute("UPDATE pepsi.workqueue SET status = 'running' WHERE stage = 'small'")
    pub.publish("small")


def test_max_length_is_exact_under_concurrent_publishers(conf: Path, dsn: str, conn: Conn) -> None:
    outcomes: list[str] = []
    config = load_config(conf)

    def publish() -> None:
        with Publisher(config, dsn) as publisher:
            for _ in range(4):
                try:
                    publisher.publish("small")
                    outcomes.append("ok")
                except Rejected:
                    outcomes.append("rejected")

    threads = [threading.Thread(target=publish) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(outcomes) == ["ok"] * 5 + ["rejected"] * 11
    assert count(conn, "stage = 'small'") == 5


def test_drop_head_dead_letters_the_oldest(pub: Publisher, conn: Conn) -> None:
    ids = pub.publish_many([OutgoingMessage("dropping", str(i)) for i in range(7)])
    rows = conn.execute(
        "SELECT workqueue_id, stage, status::text, state->>'dead_letter_reason'"
        " FROM pepsi.workqueue ORDER BY workqueue_id"
    ).fetchall()
    assert [r[1] for r in rows] == ["dlq", "dlq"] + ["dropping"] * 5
    assert [r[0] for r in rows[:2]] == ids[:2]
    assert {r[3] for r in rows[:2]} == {"overflow"}
    assert {r[2] for r in rows} == {"pending"}
    pub.publish_many([OutgoingMessage("dropping-nowhere")] * 3)
    failed = conn.execute(
        "SELECT status::text, state->>'failure_class' FROM pepsi.workqueue"
        " WHERE stage = 'dropping-nowhere' ORDER BY workqueue_id"
    ).fetchall()
    assert failed == [("failed", "overflow"), ("pending", None), ("pending", None)]


def test_ttl_and_per_message_expiry_are_dead_lettered_by_the_sweep(
    pub: Publisher, conn: Conn
) -> None:
    old, fresh = pub.publish_many([OutgoingMessage("short", "old"), OutgoingMessage("short")])
    conn.execute(
        "UPDATE pepsi.workqueue SET arrived = now() - interval '2 hours' WHERE workqueue_id = %s",
        (old,),
    )
    soon = pub.publish("inbound", b"x", expires=0.001)
    later = pub.publish("inbound", b"x", expires=3600)
    config = pub.config
    stages = list(config.stages.values())
    row = conn.execute(
        "SELECT pepsi.workqueue_expire(%s, %s, %s)",
        ([s.name for s in stages], [s.ttl for s in stages], [s.bounce_stage for s in stages]),
    ).fetchone()
    assert row == (2,)
    state = {
        int(w): (str(s), str(st), r)
        for w, s, st, r in conn.execute(
            "SELECT workqueue_id, stage, status::text, state->>'dead_letter_reason'"
            " FROM pepsi.workqueue"
        ).fetchall()
    }
    assert state[old] == ("dlq", "pending", "expired")
    assert state[fresh] == ("short", "pending", None)
    assert state[soon] == ("inbound", "failed", "expired")  # inbound has no bounce stage
    assert state[later] == ("inbound", "pending", None)


def test_async_publisher_and_pipeline(conf: Path, dsn: str, conn: Conn) -> None:
    async def scenario() -> tuple[int, list[int], int]:
        async with await AsyncPublisher.connect(load_config(conf), dsn) as pub:
            single = await pub.publish("inbound", b"one")
            caller = await psycopg.AsyncConnection.connect(dsn)
            async with caller, caller.transaction():
                await pub.publish("inbound", b"outbox", connection=caller)
            peak = 0
            async with pub.pipeline(max_outstanding=10, max_batch=4) as pipe:
                futures = []
                for i in range(200):
                    futures.append(await pipe.submit(OutgoingMessage("inbound", str(i))))
                    peak = max(peak, len(pipe.outstanding))
                ids = list(await asyncio.gather(*futures))
            with pytest.raises(NoRoute):
                async with pub.pipeline() as pipe:
                    await pipe.submit(OutgoingMessage("nowhere"))
            return single, ids, peak

    single, ids, peak = asyncio.run(scenario())
    assert single > 0
    assert len(set(ids)) == 200
    assert peak <= 10
    assert count(conn) == 202


def test_killed_producer_leaves_only_whole_confirmed_batches(
    conf: Path, dsn: str, conn: Conn
) -> None:
    rng = random.Random(7)
    confirmed: list[int] = []
    for run in range(4):
        # Each run numbers its batches in a range of its own: a run killed after a
        # commit but before printing it leaves a batch number nobody saw, which a
        # numbering derived from the confirmed ones would hand out again.
        first = 100_000 * run
        with subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "programs" / "batch_producer.py"),
             str(conf), dsn, str(first)],
            cwd=REPO, stdout=subprocess.PIPE, text=True,
        ) as proc:  # fmt: skip
            assert proc.stdout is not None
            threading.Timer(rng.uniform(0.5, 1.5), proc.send_signal, [signal.SIGKILL]).start()
            confirmed += [int(line) for line in proc.stdout]
            proc.wait()
    per_batch: dict[int, int] = dict(
        conn.execute(
            "SELECT (properties->>'batch')::int, count(*) FROM pepsi.workqueue GROUP BY 1"
        ).fetchall()
    )
    assert confirmed, "the producer confirmed nothing before it was killed"
    assert all(per_batch.get(b) == 50 for b in confirmed)  # every confirmed batch, whole
    assert set(per_batch.values()) == {50}  # and no partial batch anywhere


# -- lifecycle, the sync pipeline and refresh, domain errors (issue 13) --------------------


def test_constructors_do_no_io_and_an_unopened_publisher_says_so(conf: Path) -> None:
    config = load_config(conf)
    unreachable = "postgresql://nobody@127.0.0.1:1/none?connect_timeout=1"
    publisher = Publisher(config, unreachable)  # psycopg's pools: no I/O in a constructor
    with pytest.raises(NotOpen, match=r"use Publisher\.connect\(\), open\(\) or a with block"):
        publisher.publish("inbound", b"x")
    publisher.close()

    async def unopened() -> None:
        apub = AsyncPublisher(config, unreachable)
        with pytest.raises(NotOpen, match="AsyncPublisher is not open"):
            await apub.publish("inbound", b"x")
        await apub.close()

    asyncio.run(unopened())


def test_open_failures_are_domain_errors(conf: Path, dsn: str, admin_dsn: str) -> None:
    config = load_config(replace_timeout(conf))
    with (
        pytest.raises(DatabaseUnavailable, match="cannot connect to the database"),
        Publisher(config, "postgresql://nobody@127.0.0.1:1/none"),
    ):
        pass
    with pytest.raises(SchemaMismatch):  # the server's own database has no pepsi schema
        Publisher.connect(config, admin_dsn)

    async def unreachable() -> None:
        with pytest.raises(DatabaseUnavailable):
            async with AsyncPublisher(config, "postgresql://nobody@127.0.0.1:1/none"):
                pass

    asyncio.run(unreachable())


def replace_timeout(conf: Path) -> Path:
    conf.write_text(conf.read_text() + "[pepsi-postgres]\nCONNECT_TIMEOUT = 1s\n")
    return conf


def test_async_with_opens_the_async_publisher(conf: Path, dsn: str, conn: Conn) -> None:
    async def scenario() -> int:
        async with AsyncPublisher(load_config(conf), dsn) as pub:
            return await pub.publish("inbound", json={"n": 1})

    wid = asyncio.run(scenario())
    assert conn.execute(
        "SELECT content_type FROM pepsi.workqueue WHERE workqueue_id = %s", (wid,)
    ).fetchone() == ("application/json",)


def test_sync_refresh_sees_a_stage_added_in_the_database(pub: Publisher, conn: Conn) -> None:
    assert "late" not in pub.config.stages
    conn.execute(
        "INSERT INTO pepsi.config_override (section, key, value)"
        " VALUES ('stage-late', 'HANDLER', 'tests.stages:noop')"
    )
    pub.refresh()
    assert "late" in pub.config.stages


def test_sync_pipeline_bounds_batches_and_refuses_at_submit(pub: Publisher, conn: Conn) -> None:
    with pub.pipeline(max_outstanding=10, max_batch=4) as pipe:
        futures = [pipe.submit(OutgoingMessage("inbound", str(i))) for i in range(100)]
        assert pipe.outstanding <= 10
        with pytest.raises(NoRoute):
            pipe.submit(OutgoingMessage("nowhere"))
        with pytest.raises(InvalidMessage):
            pipe.submit(OutgoingMessage("inbound", sender="not an address"))
        pipe.flush()
        assert pipe.outstanding == 0
        ids = [f.result(timeout=0) for f in futures]
    assert len(set(ids)) == 100
    assert count(conn) == 100
    with pub.pipeline() as pipe:  # a refused batch fails its futures
        futures = [pipe.submit(OutgoingMessage("small")) for _ in range(6)]
    refused = [f.exception(timeout=0) for f in futures]
    assert any(isinstance(e, Rejected) for e in refused)
    accepted = sum(e is None for e in refused)
    assert count(conn, "stage = 'small'") == accepted <= 5


def test_database_errors_reach_the_caller_as_domain_errors(
    pub: Publisher, dsn: str, conn: Conn
) -> None:
    with psycopg.connect(dsn) as caller:  # the outbox on an aborted transaction
        with pytest.raises(psycopg.errors.DivisionByZero):
            caller.execute("SELECT 1/0")
        with pytest.raises(PublishFailed, match="transaction is aborted") as failed:
            pub.publish("inbound", b"x", connection=caller)
        assert failed.value.sqlstate == "25P02"
        caller.rollback()
    with psycopg.connect(dsn, autocommit=True) as caller:  # its session ended under it
        pid = caller.info.backend_pid
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(NotConfirmed) as lost:
            pub.publish("inbound", b"x", connection=caller)
        assert isinstance(lost.value, DatabaseLost)
        assert lost.value.exit_code == 74


def test_no_free_connection_within_connect_timeout_is_database_busy(conf: Path, dsn: str) -> None:
    conf.write_text(CONF + "[pepsi-postgres]\nPOOL_MIN_SIZE = 1\nPOOL_MAX_SIZE = 1\n"
                    "CONNECT_TIMEOUT = 1s\n")  # fmt: skip
    with (
        Publisher.connect(conf, dsn) as publisher,
        publisher.pool.connection(),  # the only connection, held
        pytest.raises(DatabaseBusy, match="no database connection available") as busy,
    ):
        publisher.publish("inbound", b"x")
    assert busy.value.exit_code == 75


def test_priority_is_stored_and_checked(pub: Publisher, conn: Conn) -> None:
    """Issue 33: `priority=` (0-255, higher first) on publish, publish_many and the
    async publisher; a bad one is InvalidMessage, in one line."""
    one = pub.publish("inbound", b"x", priority=7)
    plain, high = pub.publish_many(
        [OutgoingMessage("inbound", b"y"), OutgoingMessage("inbound", b"z", priority=255)]
    )
    limited = pub.publish("small", b"w", priority=2)  # the general path, with a limit

    async def publish_async() -> int:
        async with AsyncPublisher(pub.base, pub.dsn) as publisher:
            return await publisher.publish("inbound", b"a", priority=9)

    later = asyncio.run(publish_async())
    rows = conn.execute(
        "SELECT workqueue_id, priority FROM pepsi.workqueue WHERE workqueue_id = ANY(%s)",
        ([one, plain, high, limited, later],),
    ).fetchall()
    assert dict(rows) == {one: 7, plain: 0, high: 255, limited: 2, later: 9}
    for bad in (-1, 256, True, "5", 1.5):
        with pytest.raises(InvalidMessage, match="priority must be an integer from 0 to 255"):
            pub.publish("inbound", b"x", priority=bad)
