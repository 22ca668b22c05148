"""The AMQP broker, part 1 (issue 16): exchanges, queues, bindings and publishing, driven by
pika and aio-pika against an in-process listener on an ephemeral port and the real test
database. Messages are checked where they land: rows of pepsi.workqueue at the queue's
stage, with the content header's property octets byte for byte."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import aio_pika
import pika
import pika.exceptions
import psycopg
import pytest
from pika.spec import BasicProperties

from pepsi.admin.accounts import amqp_users
from pepsi.amqp.broker.broker import Broker
from pepsi.amqp.session.shell import ConnectionOptions
from pepsi.config.model import AmqpOptions
from tests.integration.amqp_harness import PASSWORD, Listener, assert_no_server_bugs

Conn = psycopg.Connection[Any]


@pytest.fixture(autouse=True)
def no_server_bugs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    yield
    assert_no_server_bugs(caplog, tracebacks_only=True)


@pytest.fixture
def users(conn: Conn) -> Conn:
    amqp_users.add_user(conn, "alice", PASSWORD)
    amqp_users.set_permissions(conn, "alice", ".*", ".*", ".*")
    amqp_users.add_user(conn, "bob", PASSWORD)  # may configure and write only ^bob-
    amqp_users.set_permissions(conn, "bob", "^bob-", "^bob-", "^bob-")
    return conn


@pytest.fixture
def listener(dsn: str, users: Conn) -> Iterator[Listener]:
    server = Listener(dsn, ConnectionOptions(AmqpOptions(), close_timeout=1.0), Broker(dsn, 5.0))
    yield server
    server.close()


def connect(listener: Listener, user: str = "alice") -> pika.BlockingConnection:
    return pika.BlockingConnection(
        pika.ConnectionParameters(
            "127.0.0.1", listener.port, credentials=pika.PlainCredentials(user, PASSWORD)
        )
    )


@pytest.fixture
def amqp(listener: Listener) -> Iterator[Callable[..., pika.BlockingConnection]]:
    opened: list[pika.BlockingConnection] = []

    def make(user: str = "alice") -> pika.BlockingConnection:
        connection = connect(listener, user)
        opened.append(connection)
        return connection

    yield make
    for connection in opened:
        if connection.is_open:
            connection.close()


def closed_with(code: int, call: Callable[[], Any]) -> str:
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as caught:
        call()
    assert caught.value.reply_code == code, caught.value
    return str(caught.value.reply_text)


def rows(conn: Conn, queue: str, vhost: str = "/") -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT w.status, w.message_id, w.correlation_id, w.content_type, w.origin_user,"
        " host(w.origin_peer), w.properties, w.expires IS NOT NULL, b.header, b.body"
        " FROM pepsi.workqueue w LEFT JOIN pepsi.workqueue_body b USING (body_id)"
        " WHERE w.stage = pepsi.amqp_queue_stage(%s, %s) ORDER BY w.workqueue_id",
        (vhost, queue),
    ).fetchall()


def bodies(conn: Conn, queue: str) -> list[bytes]:
    return [bytes(r[-1]) for r in rows(conn, queue)]


# -- exchanges ------------------------------------------------------------------------------


def test_exchange_declare_redeclare_passive_and_delete(amqp: Any, conn: Conn) -> None:
    connection = amqp()
    ch = connection.channel()
    ch.exchange_declare("orders", "topic", durable=True)
    ch.exchange_declare("orders", "topic", durable=True)  # same: fine
    ch.exchange_declare("orders", passive=True)
    stored = conn.execute(
        "SELECT type, durable FROM pepsi.amqp_exchange WHERE vhost = '/' AND name = 'orders'"
    ).fetchone()
    assert stored == ("topic", True)
    text = closed_with(406, lambda: ch.exchange_declare("orders", "fanout"))
    assert "inequivalent arg 'type' for exchange 'orders' in vhost '/'" in text
    ch = connection.channel()
    assert "no exchange 'nope'" in closed_with(
        404, lambda: ch.exchange_declare("nope", passive=True)
    )
    ch = connection.channel()
    assert "reserved prefix" in closed_with(403, lambda: ch.exchange_declare("amq.mine"))
    ch = connection.channel()
    assert "unknown exchange type 'x-bogus'" in closed_with(
        406, lambda: ch.exchange_declare("odd", "x-bogus")
    )
    ch = connection.channel()
    closed_with(403, lambda: ch.exchange_delete("amq.direct"))
    ch = connection.channel()
    ch.exchange_delete("never-declared")  # idempotent, as RabbitMQ
    ch.queue_declare("q")
    ch.queue_bind("q", "orders", "a.#")
    text = closed_with(406, lambda: ch.exchange_delete("orders", if_unused=True))
    assert "exchange 'orders' in vhost '/' in use" in text
    ch = connection.channel()
    ch.exchange_delete("orders")
    assert not conn.execute("SELECT 1 FROM pepsi.amqp_binding WHERE source = 'orders'").fetchall()
    assert connection.is_open


def test_auto_delete_exchange_goes_with_its_last_binding(amqp: Any, conn: Conn) -> None:
    ch = amqp().channel()
    ch.exchange_declare("temp", "fanout", auto_delete=True)
    ch.queue_declare("q")
    ch.queue_bind("q", "temp")
    ch.queue_unbind("q", "temp")
    assert not conn.execute("SELECT 1 FROM pepsi.amqp_exchange WHERE name = 'temp'").fetchall()


# -- queues ---------------------------------------------------------------------------------


def test_queue_declare_rules_and_codes(amqp: Any, conn: Conn) -> None:
    connection = amqp()
    ch = connection.channel()
    ok = ch.queue_declare("jobs", durable=True, arguments={"x-queue-type": "quorum"})
    assert (ok.method.queue, ok.method.message_count, ok.method.consumer_count) == ("jobs", 0, 0)
    stage = conn.execute("SELECT stage FROM pepsi.amqp_queue WHERE name = 'jobs'").fetchone()
    assert stage == ("amqp:/:jobs",)
    ch.queue_declare("jobs", durable=True, arguments={"x-queue-type": "quorum"})
    ch.queue_declare("jobs", passive=True)
    text = closed_with(406, lambda: ch.queue_declare("jobs", durable=False))
    assert "inequivalent arg 'durable'" in text
    ch = connection.channel()
    closed_with(404, lambda: ch.queue_declare("missing", passive=True))
    ch = connection.channel()
    closed_with(403, lambda: ch.queue_declare("amq.mine"))
    ch = connection.channel()
    text = closed_with(406, lambda: ch.queue_declare("bad", arguments={"x-max-length": -1}))
    assert "invalid arg 'x-max-length'" in text
    ch = connection.channel()
    named = ch.queue_declare("", exclusive=True).method.queue
    assert named.startswith("amq.gen-")
    ch.queue_bind(named, "amq.fanout")
    # another connection may not touch the exclusive queue
    other = amqp().channel()
    closed_with(405, lambda: other.queue_declare(named, passive=True))
    connection.close()
    deadline = time.monotonic() + 10
    while conn.execute("SELECT 1 FROM pepsi.amqp_queue WHERE name = %s", (named,)).fetchall():
        assert time.monotonic() < deadline, "the exclusive queue outlived its connection"
        time.sleep(0.05)


def test_purge_and_delete_count_and_remove_rows(amqp: Any, conn: Conn) -> None:
    ch = amqp().channel()
    ch.confirm_delivery()
    ch.queue_declare("p")
    for i in range(5):
        ch.basic_publish("", "p", f"m{i}".encode())
    assert ch.queue_declare("p", passive=True).method.message_count == 5
    assert ch.queue_purge("p").method.message_count == 5
    assert rows(conn, "p") == []
    for i in range(3):
        ch.basic_publish("", "p", f"m{i}".encode())
    text = closed_with(406, lambda: ch.queue_delete("p", if_empty=True))
    assert "queue 'p' in vhost '/' not empty" in text
    ch = amqp().channel()
    assert ch.queue_delete("p").method.message_count == 3
    assert rows(conn, "p") == []
    assert not conn.execute("SELECT 1 FROM pepsi.amqp_queue WHERE name = 'p'").fetchall()
    assert ch.queue_delete("p").method.message_count == 0  # gone already: ok


def test_a_declaration_waits_only_for_what_its_count_must_see(
    amqp: Any, conn: Conn, dsn: str
) -> None:
    """queue.declare's message_count counts this channel's earlier publishes to that
    queue and the deliveries it gave back; a publish to another queue still being
    written does not hold it up (Celery's client declares its reply queue after each
    task it publishes)."""
    ch = amqp().channel()
    for name in ("tasks", "replies"):
        ch.queue_declare(name)
    ch.basic_publish("", "tasks", b"kept")
    ch.queue_declare("tasks", passive=True)  # written: the lock below holds no publish
    declared = threading.Event()
    with psycopg.connect(dsn) as blocker:
        blocker.execute("LOCK TABLE pepsi.workqueue IN EXCLUSIVE MODE")  # inserts wait

        def publish_then_declare() -> int:
            ch.basic_publish("", "tasks", b"held")  # no confirm: waits in the batcher
            count = ch.queue_declare("replies", passive=True).method.message_count
            declared.set()
            return int(count)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            replies = pool.submit(publish_then_declare)
            answered = declared.wait(10)
            blocker.rollback()  # the publish goes ahead
            assert answered, "the declaration of another queue waited for the publish"
            assert replies.result(10) == 0
    assert ch.queue_declare("tasks", passive=True).method.message_count == 2
    method, _, body = ch.basic_get("tasks")
    assert body == b"kept"
    ch.basic_nack(method.delivery_tag, requeue=True)
    assert ch.queue_declare("tasks", passive=True).method.message_count == 2  # back
    assert [r[0] for r in rows(conn, "tasks")] == ["pending", "pending"]


# -- bindings and routing -------------------------------------------------------------------


def test_bindings_of_every_exchange_type_and_exchange_to_exchange(amqp: Any, conn: Conn) -> None:
    ch = amqp().channel()
    ch.confirm_delivery()
    for name in ("d", "f1", "f2", "t", "h", "e2e"):
        ch.queue_declare(name)
    ch.queue_bind("d", "amq.direct", "key")
    ch.queue_bind("f1", "amq.fanout")
    ch.queue_bind("f2", "amq.fanout")
    ch.queue_bind("t", "amq.topic", "orders.*.eu")
    ch.queue_bind("h", "amq.headers", arguments={"x-match": "any", "kind": "a", "n": 1})
    ch.exchange_declare("upstream", "topic")
    ch.exchange_declare("downstream", "fanout")
    ch.exchange_bind("downstream", "upstream", "#.important")
    ch.queue_bind("e2e", "downstream")

    ch.basic_publish("amq.direct", "key", b"direct")
    ch.basic_publish("amq.direct", "other", b"direct-miss")
    ch.basic_publish("amq.fanout", "", b"fanout")
    ch.basic_publish("amq.topic", "orders.new.eu", b"topic")
    ch.basic_publish("amq.topic", "orders.new.us", b"topic-miss")
    ch.basic_publish("amq.headers", "", b"headers", BasicProperties(headers={"kind": "a"}))
    ch.basic_publish("amq.headers", "", b"headers-miss", BasicProperties(headers={"kind": "b"}))
    ch.basic_publish("upstream", "a.b.important", b"e2e")
    ch.basic_publish("upstream", "a.b.boring", b"e2e-miss")
    ch.basic_publish("", "d", b"default")

    assert bodies(conn, "d") == [b"direct", b"default"]
    assert bodies(conn, "f1") == bodies(conn, "f2") == [b"fanout"]
    assert bodies(conn, "t") == [b"topic"]
    assert bodies(conn, "h") == [b"headers"]
    assert bodies(conn, "e2e") == [b"e2e"]
    ch.exchange_unbind("downstream", "upstream", "#.important")
    ch.basic_publish("upstream", "x.important", b"after-unbind")
    assert bodies(conn, "e2e") == [b"e2e"]
    ch.queue_unbind("d", "amq.direct", "key")
    ch.basic_publish("amq.direct", "key", b"after-unbind")
    assert bodies(conn, "d") == [b"direct", b"default"]


def test_a_topic_binding_of_many_words_is_refused_and_many_hashes_route_fast(
    amqp: Any, conn: Conn
) -> None:
    """Issue 34, finding 2: a binding of 128 '#' and publishes with distinct 128-word
    keys froze the loop for 160-210 ms each. Runs of '#' now count as one word, a key
    of more than 32 words is refused (406), and the probe's publishes are confirmed."""
    connection = amqp()
    ch = connection.channel()
    ch.confirm_delivery()
    ch.queue_declare("t")
    ch.queue_bind("t", "amq.topic", ".".join(["#"] * 128))
    started = time.monotonic()
    for n in range(15):
        ch.basic_publish("amq.topic", ".".join([chr(97 + n)] * 127), b"x")  # 253 bytes
    took = time.monotonic() - started
    assert len(bodies(conn, "t")) == 15
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
        ch.queue_bind("t", "amq.topic", ".".join(["*"] * 33))
    assert refused.value.reply_code == 406
    assert "33 words: at most 32" in refused.value.reply_text
    print(f"15 confirmed publishes of 127 words against 128 '#': {took * 1000:.0f} ms")


def test_binding_to_missing_things_is_404_and_default_exchange_403(amqp: Any) -> None:
    connection = amqp()
    ch = connection.channel()
    ch.queue_declare("q")
    assert "no exchange 'nope'" in closed_with(404, lambda: ch.queue_bind("q", "nope"))
    ch = connection.channel()
    assert "no queue 'nope'" in closed_with(404, lambda: ch.queue_bind("nope", "amq.direct"))
    ch = connection.channel()
    closed_with(403, lambda: ch.queue_bind("q", ""))
    # unbinding what is gone already is done, as RabbitMQ answers (aio-pika's clean-ups)
    ch = connection.channel()
    ch.exchange_declare("gone", "direct")
    ch.queue_bind("q", "gone", "k")
    ch.exchange_delete("gone")
    ch.queue_unbind("q", "gone", "k")
    ch.queue_unbind("never-declared", "amq.direct", "k")
    ch.exchange_unbind("amq.topic", "gone", "#")
    ch.exchange_unbind("gone", "amq.topic", "#")
    assert ch.is_open


# -- publishing -----------------------------------------------------------------------------


def test_a_confirmed_publish_is_a_row_with_the_raw_header(amqp: Any, conn: Conn) -> None:
    ch = amqp().channel()
    ch.confirm_delivery()
    ch.queue_declare("inbox")
    props = BasicProperties(
        content_type="application/json",
        delivery_mode=2,
        message_id="order-7",
        correlation_id="corr-1",
        expiration="60000",
        headers={"tenant": "acme", "n": 7, "nested": {"a": [1, "two", True]}},
        timestamp=1_700_000_000,
        app_id="tests",
    )
    ch.basic_publish("", "inbox", b'{"id": 7}', props)
    [row] = rows(conn, "inbox")
    status, message_id, correlation_id, content_type, user, peer, properties, expires = row[:8]
    assert (status, message_id, correlation_id, content_type) == (
        "pending", "order-7", "corr-1", "application/json",
    )  # fmt: skip
    assert (user, peer, expires) == ("alice", "127.0.0.1", True)
    assert properties == {"exchange": "", "routing_key": "inbox"}
    assert bytes(row[8]) == b"".join(props.encode())  # pika's own encoding, byte for byte
    assert bytes(row[9]) == b'{"id": 7}'


def test_repeated_publishes_follow_binding_changes_and_their_own_expiry(
    amqp: Any, conn: Conn
) -> None:
    """A channel reuses the rows of its last publish for the next one with the same
    exchange, key and properties (only the body differs): a binding made or removed in
    between routes the next publish anew, and a per-message expiration is each publish's
    own, never reused."""
    ch = amqp().channel()
    ch.confirm_delivery()
    for name in ("first", "second"):
        ch.queue_declare(name)
    ch.queue_bind("first", "amq.direct", "k")
    props = BasicProperties(delivery_mode=2)
    ch.basic_publish("amq.direct", "k", b"1", props)
    ch.basic_publish("amq.direct", "k", b"2", props)
    ch.queue_bind("second", "amq.direct", "k")
    ch.basic_publish("amq.direct", "k", b"3", props)
    ch.queue_unbind("first", "amq.direct", "k")
    ch.basic_publish("amq.direct", "k", b"4", props)
    assert bodies(conn, "first") == [b"1", b"2", b"3"]
    assert bodies(conn, "second") == [b"3", b"4"]
    assert [r[8] for r in rows(conn, "second")] == [b"".join(props.encode())] * 2

    expiring = BasicProperties(expiration="60000")
    ch.basic_publish("", "first", b"5", expiring)
    ch.basic_publish("", "first", b"6", expiring)  # confirmed after the first's commit
    expires = conn.execute(
        "SELECT expires FROM pepsi.workqueue WHERE stage = pepsi.amqp_queue_stage('/', 'first')"
        " AND expires IS NOT NULL ORDER BY workqueue_id"
    ).fetchall()
    assert len(expires) == 2
    assert expires[1][0] > expires[0][0]  # each from its own publish time


def test_mandatory_unroutable_is_returned_before_the_ack(amqp: Any, conn: Conn) -> None:
    ch = amqp().channel()
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.UnroutableError):
        ch.basic_publish("amq.direct", "nobody", b"x", mandatory=True)
    ch.basic_publish("amq.direct", "nobody", b"x")  # not mandatory: acked, dropped
    assert conn.execute("SELECT count(*) FROM pepsi.workqueue").fetchone() == (0,)
    closed_with(404, lambda: ch.basic_publish("missing-exchange", "k", b"x"))


def test_reject_publish_at_max_length_nacks_the_publish_that_does_not_fit(
    amqp: Any, conn: Conn
) -> None:
    ch = amqp().channel()
    ch.confirm_delivery()
    ch.queue_declare("one", arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    ch.queue_declare("free")
    ch.queue_bind("one", "amq.fanout")
    ch.queue_bind("free", "amq.fanout")
    ch.basic_publish("", "one", b"first")
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", "one", b"second")
    # a fanout to a full queue and a free one: nacked, yet the free queue has it (RabbitMQ)
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("amq.fanout", "", b"both")
    assert bodies(conn, "one") == [b"first"]
    assert bodies(conn, "free") == [b"both"]


def test_drop_head_keeps_the_newest(amqp: Any, conn: Conn) -> None:
    ch = amqp().channel()
    ch.confirm_delivery()
    ch.queue_declare("dh", arguments={"x-max-length": 2})  # RabbitMQ's default: drop-head
    for body in (b"1", b"2", b"3"):
        ch.basic_publish("", "dh", body)
    pending = conn.execute(
        "SELECT b.body FROM pepsi.workqueue w JOIN pepsi.workqueue_body b USING (body_id)"
        " WHERE w.stage = 'amqp:/:dh' AND w.status = 'pending' ORDER BY w.workqueue_id"
    ).fetchall()
    assert [bytes(r[0]) for r in pending] == [b"2", b"3"]


def test_tx_commit_and_rollback(amqp: Any, conn: Conn) -> None:
    ch = amqp().channel()
    ch.queue_declare("txq")
    ch.tx_select()
    ch.basic_publish("", "txq", b"a")
    ch.basic_publish("", "txq", b"b")
    assert bodies(conn, "txq") == []
    ch.tx_commit()
    assert bodies(conn, "txq") == [b"a", b"b"]
    ch.basic_publish("", "txq", b"c")
    ch.tx_rollback()
    ch.tx_commit()
    assert bodies(conn, "txq") == [b"a", b"b"]
    closed_with(406, ch.confirm_delivery)


def test_publishes_without_confirms_are_stored(amqp: Any, conn: Conn) -> None:
    ch = amqp().channel()
    ch.queue_declare("plain")
    for i in range(50):
        ch.basic_publish("", "plain", str(i).encode())
    deadline = time.monotonic() + 10
    while len(rows(conn, "plain")) < 50:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert bodies(conn, "plain") == [str(i).encode() for i in range(50)]


# -- permissions ------------------------------------------------------------------------------


def test_permissions_are_enforced_with_rabbitmqs_403(amqp: Any, users: Conn) -> None:
    admin = amqp().channel()
    admin.queue_declare("alice-q")
    connection = amqp("bob")
    ch = connection.channel()
    ch.queue_declare("bob-q")
    text = closed_with(403, lambda: ch.queue_declare("alice-q2"))
    assert text == (
        "ACCESS_REFUSED - access to queue 'alice-q2' in vhost '/' refused for user 'bob'"
    )
    ch = connection.channel()
    ch.confirm_delivery()  # so that pika waits for the answer
    text = closed_with(403, lambda: ch.basic_publish("", "bob-q", b"x"))
    assert "access to exchange 'amq.default' in vhost '/' refused for user 'bob'" in text
    ch = connection.channel()
    # bind: write on the queue, read on the exchange (amq.direct is not ^bob-)
    text = closed_with(403, lambda: ch.queue_bind("bob-q", "amq.direct", "k"))
    assert "exchange 'amq.direct'" in text
    ch = connection.channel()
    closed_with(403, lambda: ch.queue_delete("alice-q"))
    ch = connection.channel()
    closed_with(403, lambda: ch.exchange_declare("x"))
    ch = connection.channel()
    ch.exchange_declare("bob-x", "fanout")
    ch.queue_bind("bob-q", "bob-x")
    ch.confirm_delivery()
    ch.basic_publish("bob-x", "", b"ok")
    # issue 34, finding 3: an exchange of bob's whose alternate is alice's would take
    # bob's messages where he may not write: refused at declare, as RabbitMQ does
    admin.exchange_declare("alice-x", "fanout")
    admin.queue_bind("alice-q", "alice-x")
    ch = connection.channel()
    text = closed_with(
        403,
        lambda: ch.exchange_declare(
            "bob-sneaky", "direct", arguments={"alternate-exchange": "alice-x"}
        ),
    )
    assert text == (
        "ACCESS_REFUSED - access to exchange 'alice-x' in vhost '/' refused for user 'bob'"
    )
    ch = connection.channel()
    ch.exchange_declare("bob-alt", "fanout")  # his own alternate: fine
    ch.exchange_declare("bob-main", "direct", arguments={"alternate-exchange": "bob-alt"})


# The permission table of docs/amqp.md#permissions, row by row: what each operation
# needs ({access: pattern}), what alice prepares first, and the operation itself.
PERMISSION_TABLE: list[tuple[str, dict[str, str], Callable[[Any], Any], Callable[[Any], Any]]] = [
    ("exchange.declare", {"configure": "^x1$"}, lambda a: None,
     lambda ch: ch.exchange_declare("x1", "fanout")),
    ("exchange.delete", {"configure": "^x2$"}, lambda a: a.exchange_declare("x2", "fanout"),
     lambda ch: ch.exchange_delete("x2")),
    ("exchange.declare alternate-exchange",
     {"configure": "^x3$", "write": "^alt3$", "read": "^x3$"},
     lambda a: a.exchange_declare("alt3", "fanout"),
     lambda ch: ch.exchange_declare("x3", "direct", arguments={"alternate-exchange": "alt3"})),
    ("queue.declare", {"configure": "^q4$"}, lambda a: None, lambda ch: ch.queue_declare("q4")),
    ("queue.delete", {"configure": "^q5$"}, lambda a: a.queue_declare("q5"),
     lambda ch: ch.queue_delete("q5")),
    ("queue.declare x-dead-letter-exchange",
     {"configure": "^q6$", "write": "^dlx6$", "read": "^q6$"},
     lambda a: a.exchange_declare("dlx6", "fanout"),
     lambda ch: ch.queue_declare("q6", arguments={"x-dead-letter-exchange": "dlx6"})),
    ("queue.bind", {"write": "^q7$", "read": "^x7$"},
     lambda a: (a.queue_declare("q7"), a.exchange_declare("x7", "fanout")),
     lambda ch: ch.queue_bind("q7", "x7")),
    ("queue.unbind", {"write": "^q8$", "read": "^x8$"},
     lambda a: (a.queue_declare("q8"), a.exchange_declare("x8", "direct"),
                a.queue_bind("q8", "x8", "k")),
     lambda ch: ch.queue_unbind("q8", "x8", "k")),
    ("exchange.bind", {"write": "^d9$", "read": "^s9$"},
     lambda a: (a.exchange_declare("d9", "fanout"), a.exchange_declare("s9", "fanout")),
     lambda ch: ch.exchange_bind("d9", "s9")),
    ("exchange.unbind", {"write": "^d10$", "read": "^s10$"},
     lambda a: (a.exchange_declare("d10", "fanout"), a.exchange_declare("s10", "fanout"),
                a.exchange_bind("d10", "s10")),
     lambda ch: ch.exchange_unbind("d10", "s10")),
    ("basic.publish", {"write": "^x11$"},
     lambda a: (a.exchange_declare("x11", "fanout"), a.queue_declare("q11"),
                a.queue_bind("q11", "x11")),
     lambda ch: (ch.confirm_delivery(), ch.basic_publish("x11", "", b"m"))),
    ("basic.get", {"read": "^q12$"}, lambda a: a.queue_declare("q12"),
     lambda ch: ch.basic_get("q12")),
    ("basic.consume", {"read": "^q13$"}, lambda a: a.queue_declare("q13"),
     lambda ch: ch.basic_consume("q13", lambda *_: None)),
    ("queue.purge", {"read": "^q14$"}, lambda a: a.queue_declare("q14"),
     lambda ch: ch.queue_purge("q14")),
]  # fmt: skip


@pytest.mark.parametrize(
    ("operation", "needs", "prepare", "act"),
    PERMISSION_TABLE,
    ids=[row[0] for row in PERMISSION_TABLE],
)
def test_each_row_of_the_permission_table_with_two_users(
    amqp: Any,
    users: Conn,
    operation: str,
    needs: dict[str, str],
    prepare: Callable[[Any], Any],
    act: Callable[[Any], Any],
) -> None:
    """alice prepares; carol, with every access the row needs but one, is refused (403)
    for each missing one in turn; with all of them, she may."""
    prepare(amqp().channel())
    amqp_users.add_user(users, "carol", PASSWORD)

    def grant(missing: str | None) -> None:
        patterns = {a: ("" if a == missing else needs.get(a, "")) for a in ACCESSES}
        amqp_users.set_permissions(users, "carol", *(patterns[a] for a in ACCESSES))

    for missing in needs:
        grant(missing)
        text = closed_with(403, lambda: act(amqp("carol").channel()))
        assert "refused for user 'carol'" in text, (operation, missing)
    grant(None)
    act(amqp("carol").channel())


ACCESSES = ("configure", "write", "read")


# -- grouping and failures ------------------------------------------------------------------


def test_publishes_of_two_connections_share_commits(listener: Listener, conn: Conn) -> None:
    url = f"amqp://alice:{PASSWORD}@127.0.0.1:{listener.port}/"
    per_connection = 300

    async def run() -> None:
        first, second = await aio_pika.connect(url), await aio_pika.connect(url)
        async with first, second:
            channels = [await first.channel(), await second.channel()]
            await channels[0].declare_queue("grouped")
            await asyncio.gather(
                *(
                    ch.default_exchange.publish(aio_pika.Message(b"x" * 100), "grouped")
                    for ch in channels
                    for _ in range(per_connection)
                )
            )

    before = listener.broker.batcher.commits
    asyncio.run(run())
    commits = listener.broker.batcher.commits - before
    total = conn.execute("SELECT count(*) FROM pepsi.workqueue").fetchone()
    assert total == (2 * per_connection,)
    assert 1 <= commits < 2 * per_connection / 5, commits


def test_a_failed_commit_is_nacked_not_acked(amqp: Any, conn: Conn) -> None:
    conn.execute(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN RAISE EXCEPTION 'refused at commit'; END $$"
    )
    conn.execute(
        "CREATE CONSTRAINT TRIGGER refuse AFTER INSERT ON pepsi.workqueue"
        " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW"
        " WHEN (NEW.stage = 'amqp:/:poison') EXECUTE FUNCTION refuse()"
    )
    ch = amqp().channel()
    ch.confirm_delivery()
    ch.queue_declare("poison")
    ch.queue_declare("fine")
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", "poison", b"x")
    ch.basic_publish("", "fine", b"y")  # the next batch commits
    assert bodies(conn, "fine") == [b"y"]
    assert rows(conn, "poison") == []


def test_a_publish_the_database_refuses_costs_only_its_own_confirm(
    listener: Listener, conn: Conn
) -> None:
    conn.execute(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN RAISE EXCEPTION 'refused'; END $$"
    )
    conn.execute(
        "CREATE TRIGGER refuse BEFORE INSERT ON pepsi.workqueue FOR EACH ROW"
        " WHEN (NEW.stage = 'amqp:/:poison') EXECUTE FUNCTION refuse()"
    )
    url = f"amqp://alice:{PASSWORD}@127.0.0.1:{listener.port}/"

    async def run() -> list[Any]:
        async with await aio_pika.connect(url) as connection:
            channel = await connection.channel()
            await channel.declare_queue("poison")
            await channel.declare_queue("fine")
            publish = channel.default_exchange.publish
            return await asyncio.gather(
                *(publish(aio_pika.Message(b"ok"), "fine") for _ in range(100)),
                publish(aio_pika.Message(b"bad"), "poison"),
                *(publish(aio_pika.Message(b"ok"), "fine") for _ in range(100)),
                return_exceptions=True,
            )

    results = asyncio.run(run())
    failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert failed == [100], results[100]
    assert len(bodies(conn, "fine")) == 200


def _database_down(admin_dsn: str, conn: Conn) -> None:
    """The test database refuses connections and loses the ones it had (but `conn`)."""
    name = conn.info.dbname
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> %s",
            (name, conn.info.backend_pid),
        )


def _database_up(admin_dsn: str, conn: Conn) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{conn.info.dbname}" WITH ALLOW_CONNECTIONS true')


def test_database_down_nacks_and_recovers(
    amqp: Any, conn: Conn, admin_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    ch = amqp().channel()
    ch.confirm_delivery()
    ch.queue_declare("outage")
    ch.basic_publish("", "outage", b"before")
    _database_down(admin_dsn, conn)
    try:
        with pytest.raises(pika.exceptions.NackError):
            ch.basic_publish("", "outage", b"during")
    finally:
        _database_up(admin_dsn, conn)
    deadline = time.monotonic() + 15
    while True:  # the batcher reconnects (backoff): a later publish is acked
        try:
            ch.basic_publish("", "outage", b"after")
            break
        except pika.exceptions.NackError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert bodies(conn, "outage")[0] == b"before"
    assert bodies(conn, "outage")[-1] == b"after"
    assert b"during" not in bodies(conn, "outage")
    assert "publishes not committed" in caplog.text


def test_database_down_closes_a_connection_without_confirms(
    amqp: Any, conn: Conn, admin_dsn: str
) -> None:
    connection = amqp()
    ch = connection.channel()
    ch.queue_declare("fire-and-forget")
    _database_down(admin_dsn, conn)
    try:
        ch.basic_publish("", "fire-and-forget", b"lost?")

        def drain() -> None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                connection.process_data_events(time_limit=0.2)

        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as caught:
            drain()
        assert caught.value.reply_code == 541
    finally:
        _database_up(admin_dsn, conn)
