"""The publish function's fast paths (`workqueue_publish_one`, `_plain`) and its
general path (`workqueue_publish`) write the same rows."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings

from pepsi.amqp.broker.publish import arrays
from pepsi.amqp.broker.publish.params import LEAN_SQL, call_params, lean_params
from pepsi.config import Config, load_config
from pepsi.publishing import (
    AsyncPublisher,
    InvalidMessage,
    OutgoingMessage,
    Publisher,
    Rejected,
    batch,
)
from pepsi.publishing.message import Row
from tests.scenarios.conftest import wait_until
from tests.unit import test_message_fuzz as fuzz

Conn = psycopg.Connection[tuple[Any, ...]]

CONF = """
[stage-inbound]
HANDLER = tests.stages:noop
[stage-other]
HANDLER = tests.stages:noop
[stage-small]
HANDLER = tests.stages:noop
MAX_LENGTH = 100
"""

# Everything but the ids: the row and its body row, as the database stores them.
ROWS = """
SELECT w.stage, w.status::text, w.message_id, w.sender, w.recipients, w.origin_user,
       host(w.origin_peer), w.header_from, w.subject, w.content_type, w.correlation_id,
       w.properties, w.expires, w.state, w.sender_key, w.arrived = now() - (now() - w.arrived),
       w.body_id IS NULL, b.header, b.body
FROM pepsi.workqueue w LEFT JOIN pepsi.workqueue_body b USING (body_id)
WHERE w.workqueue_id = ANY(%s) ORDER BY w.workqueue_id
"""


@pytest.fixture
def config(tmp_path: Path) -> Config:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF)
    return load_config(path)


@pytest.fixture
def pub(config: Config, dsn: str) -> Iterator[Publisher]:
    with Publisher(config, dsn) as publisher:
        yield publisher


def general(conn: Conn, messages: list[OutgoingMessage], config: Config) -> list[int]:
    call = batch.build(messages, config, fast=False)
    assert call.sql is batch.SQL
    with conn.transaction():
        answer = conn.execute(call.sql, call.params).fetchall()
    return batch.ids_from(call, answer)


def rows(conn: Conn, ids: list[int]) -> list[tuple[Any, ...]]:
    return conn.execute(ROWS, (ids,)).fetchall()


PLAIN = [
    OutgoingMessage("inbound", b"body only"),
    OutgoingMessage("other", header=b"Subject: header only\r\n"),
    OutgoingMessage("inbound", "both", header=b"X: y\r\n"),
    OutgoingMessage("inbound"),  # neither: no body row
    OutgoingMessage("inbound", b""),  # an empty body is a body
    OutgoingMessage("other", b"\x00\xff binary"),
]


def test_fast_paths_are_taken(config: Config) -> None:
    assert batch.build(PLAIN[:1], config).sql is batch.ONE_SQL
    assert batch.build(PLAIN, config).sql is batch.PLAIN_SQL
    assert batch.build([*PLAIN, OutgoingMessage("inbound", sender="a@b.c")], config).sql is (
        batch.SQL
    )
    assert batch.build([OutgoingMessage("small")], config).sql is batch.SQL  # MAX_LENGTH
    dedup = OutgoingMessage("inbound", message_id="m", dedup=True)
    assert batch.build([dedup], config).sql is batch.SQL


def test_plain_batch_writes_what_the_general_path_writes(
    pub: Publisher, conn: Conn, config: Config
) -> None:
    fast = pub.publish_many(PLAIN)
    slow = general(conn, PLAIN, config)
    assert fast == sorted(fast)  # FIFO order is the order given
    assert slow == sorted(slow)
    assert min(slow) > max(fast)
    assert rows(conn, fast) == rows(conn, slow)
    got = rows(conn, fast)
    assert [r[-3:] for r in got] == [
        (False, None, b"body only"),
        (False, b"Subject: header only\r\n", None),
        (False, b"X: y\r\n", b"both"),
        (True, None, None),
        (False, None, b""),
        (False, None, b"\x00\xff binary"),
    ]
    assert {r[1] for r in got} == {"pending"}
    assert {r[14] for r in got} == {"null:"}  # sender_key, computed by the database


def test_single_publish_writes_what_the_general_path_writes(
    pub: Publisher, conn: Conn, config: Config
) -> None:
    for msg in PLAIN:
        fast = [pub.publish(msg.stage, msg.body, header=msg.header)]
        slow = general(conn, [msg], config)
        assert rows(conn, fast) == rows(conn, slow)


BARE = [b"bytes", "text é", bytearray(b"array"), memoryview(b"view"), b"", None]


def test_a_bare_publish_goes_the_short_way_and_writes_what_the_general_path_writes(
    pub: Publisher, conn: Conn, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """publish(stage, body) to a stage without MAX_LENGTH makes no OutgoingMessage and no
    batch (`batch.single`); what it stores and refuses is the general path's."""
    assert pub.lean == {"inbound", "other"}  # not "small": its MAX_LENGTH needs the general call
    fast = [pub.publish("inbound", body) for body in BARE]
    slow = [general(conn, [OutgoingMessage("inbound", body)], config)[0] for body in BARE]
    assert rows(conn, fast) == rows(conn, slow)
    with pytest.raises(InvalidMessage, match="body must be bytes or str, not int") as short:
        pub.publish("inbound", 7)
    with pytest.raises(InvalidMessage) as long:
        pub.publish_many([OutgoingMessage("inbound", 7)])  # type: ignore[arg-type]
    assert str(short.value) == str(long.value)
    too_big = b"x" * (config.ingress.max_message_size + 1)
    with pytest.raises(InvalidMessage, match="over the limit") as short:
        pub.publish("inbound", too_big)
    with pytest.raises(InvalidMessage) as long:
        pub.publish_many([OutgoingMessage("inbound", too_big)])
    assert str(short.value) == str(long.value)

    def no_batch(*args: object, **kwargs: object) -> None:
        raise AssertionError("the short way makes no batch")

    monkeypatch.setattr(batch, "build", no_batch)
    assert pub.publish("other", b"x") > max(slow)
    for general_call in (
        lambda: pub.publish("small", b"x"),  # MAX_LENGTH
        lambda: pub.publish("inbound", b"x", subject="s"),  # a field
        lambda: pub.publish("inbound", b"x", retry=True),
        lambda: pub.publish("inbound", b"x", confirm_timeout=5),
        lambda: pub.publish(OutgoingMessage("inbound", b"x")),
    ):
        with pytest.raises(AssertionError, match="no batch"):
            general_call()


def test_a_single_publishs_prepared_statement_is_made_again_when_gone(
    pub: Publisher, conn: Conn
) -> None:
    first = pub.publish("inbound", b"one")
    for statement in ("DEALLOCATE ALL", "DISCARD ALL"):
        with pub.pool.connection() as pooled:
            pooled.execute(statement)
        assert pub.publish("inbound", b"again") > first
    conn.execute(
        "CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        " RAISE EXCEPTION 'full' USING ERRCODE = 'PP001', DETAIL = 'inbound'; END $$"
    )
    conn.execute(
        "CREATE TRIGGER refuse BEFORE INSERT ON pepsi.workqueue_body"
        " FOR EACH ROW EXECUTE FUNCTION public.refuse()"
    )
    with pytest.raises(Rejected, match="full"):  # its errors are psycopg's, told apart as ever
        pub.publish("inbound", b"refused")


def test_a_callers_connection_is_left_without_a_prepared_statement(
    pub: Publisher, dsn: str
) -> None:
    with psycopg.connect(dsn, autocommit=True) as own:
        assert pub.publish("inbound", b"x", connection=own) > 0  # its own transaction
        assert own.execute("SELECT name FROM pg_prepared_statements").fetchall() == []


def test_a_bare_async_publish_goes_the_short_way(config: Config, dsn: str, conn: Conn) -> None:
    async def scenario() -> list[int]:
        async with AsyncPublisher(config, dsn) as apub:
            assert apub.lean == {"inbound", "other"}
            ids = [await apub.publish("inbound", body) for body in BARE]
            with pytest.raises(InvalidMessage, match="body must be bytes or str, not int"):
                await apub.publish("inbound", 7)
        assert apub.lean == set()  # closed: the general path, which says so
        return ids

    fast = asyncio.run(scenario())
    slow = [general(conn, [OutgoingMessage("inbound", body)], config)[0] for body in BARE]
    assert rows(conn, fast) == rows(conn, slow)


def test_amqp_batch_writes_what_the_general_path_writes(conn: Conn) -> None:
    """The AMQP listener's function for queues without limits (pepsi.amqp_publish) stores
    a basic.publish's rows as workqueue_publish does, in order, sender_key included."""
    when = datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC)
    amqp_rows = [
        Row("inbound", "m-1", False, None, None, "alice", "192.0.2.1", None, None,
            "text/plain", "c-1", '{"exchange": "", "routing_key": "inbound"}', when,
            b"\x90\x00", b"body"),
        Row("other", None, False, None, None, None, "2001:db8:1:2::7", None, None, None, None,
            None, None, None, b""),
        Row("inbound", None, False, None, None, None, None, None, None, None, None, None,
            None, b"h", None),
        Row("other", None, False, None, None, "bob", None, None, None, None, None, None, None,
            None, None),
    ]  # fmt: skip
    params = lean_params(amqp_rows)
    assert params is not None

    def written(sql: str, args: tuple[Any, ...]) -> list[int]:
        before = conn.execute("SELECT coalesce(max(workqueue_id), 0) FROM pepsi.workqueue")
        floor = before.fetchone()
        assert floor is not None
        conn.execute(sql, args)
        found = conn.execute(
            "SELECT workqueue_id FROM pepsi.workqueue WHERE workqueue_id > %s"
            " ORDER BY workqueue_id",
            (floor[0],),
        )
        return [int(r[0]) for r in found.fetchall()]

    lean = written(LEAN_SQL, params)
    slow = written(batch.SQL, call_params(amqp_rows, {}))
    assert len(lean) == len(slow) == 4
    got = rows(conn, lean)
    assert got == rows(conn, slow)
    # as the batcher sends them: text and octets packed (amqp.broker.publish.arrays)
    arrays.register(conn)
    for model, count in ((amqp_rows[0], 9), (amqp_rows[2], 10)):  # all set; mostly NULL
        same = [model._replace(body=b"same")] * 3
        same_params = lean_params(same)
        assert same_params is not None
        packed = arrays.pack_columns(same_params, keep=9)
        assert sum(isinstance(c, arrays.PackedText | arrays.PackedBytea) for c in packed) == count
        assert rows(conn, written(LEAN_SQL, packed)) == rows(conn, written(LEAN_SQL, same_params))
    mixed = arrays.pack_columns(params, keep=9)  # varying values, NULLs among them
    assert all(isinstance(c, arrays.PackedText | arrays.PackedBytea) for c in mixed[:7])
    assert rows(conn, written(LEAN_SQL, mixed)) == got
    assert [r[0] for r in got] == ["inbound", "other", "inbound", "other"]  # as given
    assert [r[14] for r in got] == ["user:alice", "ip:2001:db8:1:2::/64", "null:", "user:bob"]
    assert [r[-3:] for r in got] == [
        (False, b"\x90\x00", b"body"), (False, None, b""), (False, b"h", None),
        (True, None, None),  # neither: no body row
    ]  # fmt: skip


def test_every_field_travels_through_the_arrays(pub: Publisher, conn: Conn) -> None:
    when = datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC)
    odd = 'a"b\\c,{d}NULL@x.org'  # quotes, a backslash, a comma and braces in an address
    msg = OutgoingMessage(
        "inbound", b"b", header=b"h", sender="s@example.org",
        recipients=(odd, "NULL@y.org", "z@y.org"), origin_user="alice", origin_peer="2001:DB8::7",
        message_id="m-1", header_from="A <a@x>", subject="", content_type="text/plain",
        correlation_id="c-1", properties={"k": [1, "two"], "n": None}, expires=when,
    )  # fmt: skip
    bare = OutgoingMessage("other", recipients=("r@example.net",), expires=60.0)
    ids = pub.publish_many([msg, bare])
    got = rows(conn, ids)
    assert got[0] == (
        "inbound", "pending", "m-1", "s@example.org", [odd, "NULL@y.org", "z@y.org"], "alice",
        "2001:db8::7", "A <a@x>", "", "text/plain", "c-1", {"k": [1, "two"], "n": None},
        when, {}, "user:alice", True, False, b"h", b"b",
    )  # fmt: skip
    assert got[1][:4] == ("other", "pending", None, None)
    assert got[1][4] == ["r@example.net"]
    assert got[1][11] == {}
    assert got[1][14] == "null:example.net"
    row = conn.execute(
        "SELECT expires - now() FROM pepsi.workqueue WHERE workqueue_id = %s", (ids[1],)
    ).fetchone()
    assert row is not None
    assert 30 < row[0].total_seconds() <= 61


def test_one_notify_per_call_on_every_path(pub: Publisher, dsn: str) -> None:
    listener = psycopg.connect(dsn, autocommit=True)
    listener.execute("LISTEN workqueue")
    pub.publish("inbound", b"x")
    pub.publish_many(PLAIN)
    pub.publish_many([OutgoingMessage("small"), OutgoingMessage("inbound", sender="a@b.c")])
    notes = list(listener.notifies(timeout=1, stop_after=4))
    listener.close()
    assert [n.channel for n in notes] == ["workqueue"] * 3


def test_fast_paths_force_a_synchronous_commit(pub: Publisher, dsn: str) -> None:
    with psycopg.connect(dsn) as caller:
        caller.execute("SET synchronous_commit = off")
        with caller.transaction():
            pub.publish("inbound", b"x", connection=caller)
            row = caller.execute("SHOW synchronous_commit").fetchone()
            assert row == ("on",)
        with caller.transaction():
            pub.publish_many(PLAIN, connection=caller)
            row = caller.execute("SHOW synchronous_commit").fetchone()
            assert row == ("on",)


# -- what validation lets through, PostgreSQL takes (issue 13) -----------------------------


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(fuzz.any_fields)
def test_every_message_validation_accepts_is_stored(
    pub: Publisher, given_fields: dict[str, Any]
) -> None:
    try:
        msg = OutgoingMessage("inbound", **given_fields)
        batch.build([msg], pub.config)
    except InvalidMessage:
        return
    try:
        pub.publish_many([msg])
    except (InvalidMessage, Rejected):  # MAX_MESSAGE_SIZE is the config's, not the fuzzer's
        return


def _cli(conf: Path, dsn: str, *args: str | bytes) -> subprocess.CompletedProcess[bytes]:
    exe = Path(sys.executable).parent / "pepsi"
    return subprocess.run(
        [exe, "-c", conf, "ingress", "--stage", "inbound", *args],
        input=b"body", env={"PEPSI_DSN": dsn, "PATH": "/usr/bin:/bin"},
        capture_output=True, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ((b"--sender", b"\xff@x.org"), b"sender is not encodable as UTF-8 text"),
        ((b"--recipient", b"a@\xfe.org"), b"recipient is not encodable as UTF-8 text"),
        ((b"--subject", b"\xc3("), b"subject is not encodable as UTF-8 text"),
        (("--expires", "99999999999999999999999h"), b"expires is too far in the future"),
    ],
)
def test_the_cli_refuses_bad_fields_in_one_line(
    tmp_path: Path, dsn: str, args: tuple[str | bytes, ...], problem: bytes
) -> None:
    conf = tmp_path / "pepsi.conf"
    conf.write_text(CONF)
    done = _cli(conf, dsn, *args)
    assert done.returncode == 65, done.stderr
    assert problem in done.stderr
    assert done.stderr.count(b"\n") == 1  # one line, no traceback


# -- the spare connection (pool_wait.Spare) -------------------------------------------------


def backends(conn: Conn) -> list[int]:
    found = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'pepsi-publish'"
        " AND datname = current_database()"
    ).fetchall()
    return [int(pid) for (pid,) in found]


def test_the_spare_goes_back_on_close_and_a_dead_one_is_replaced(
    config: Config, dsn: str, conn: Conn
) -> None:
    with Publisher(config, dsn) as publisher:
        for body in (b"1", b"2", b"3"):  # the first goes back to the pool, then kept
            publisher.publish("inbound", body)  # (within SPARE_SECONDS of that)
            if publisher.spare.held:
                break
        assert len(publisher.spare.held) == 1
        spare = publisher.spare.held[0]
        pid = spare.info.backend_pid
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_until(lambda: pid not in backends(conn), what="its end")
        assert publisher.publish("inbound", b"4") > 0  # not NotConfirmed: said goodbye
        assert spare.closed
    assert publisher.spare.held == []
    wait_until(lambda: backends(conn) == [], what="every connection closed")


def test_a_pool_of_one_keeps_no_spare(tmp_path: Path, dsn: str) -> None:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF + "[pepsi-postgres]\nPOOL_MAX_SIZE = 1\n")
    with Publisher(load_config(path), dsn) as publisher:
        for body in (b"1", b"2", b"3"):
            publisher.publish("inbound", body)
            assert publisher.spare.held == []
            publisher.refresh()  # the pool's one connection is there for it


def test_an_async_single_publish_is_sent_by_libpq_on_its_pool_connection(
    config: Config, dsn: str
) -> None:
    """The async short way prepares the single publish once per pool connection, as the
    sync one does (it went through a cursor, at twice the client CPU)."""

    async def scenario() -> list[str]:
        async with AsyncPublisher(config, dsn) as apub:
            for body in BARE:
                await apub.publish("inbound", body)
            await apub.spare.release()  # the connection kept for the next publish
            async with apub.pool.connection() as pooled:
                cursor = await pooled.execute("SELECT name FROM pg_prepared_statements")
                return [name for (name,) in await cursor.fetchall()]

    assert "pepsi_publish_one" in asyncio.run(scenario())
