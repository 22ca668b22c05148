"""The AMQP broker's expiry (pepsi.amqp.broker.expiry): expired messages are dead-lettered with
reason `expired`, unused queues with x-expires deleted. pika against a real dispatcher in
this process, whose broker runs the expiry passes; outcomes are checked where they land,
in pepsi.workqueue and pepsi.amqp_queue."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pika
import pika.exceptions
import psycopg
import pytest
from pika.adapters.blocking_connection import BlockingChannel
from pika.spec import BasicProperties

from tests.integration.amqp_dispatcher import (
    DispatcherThread,
    await_passes,
    connect,
    expiry,
    open_channel,
    rows,
    text,
)
from tests.integration.amqp_harness import assert_no_server_bugs
from tests.scenarios.conftest import wait_until

Conn = psycopg.Connection[Any]


@pytest.fixture(autouse=True)
def no_server_bugs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    yield
    assert_no_server_bugs(caplog, tracebacks_only=True)


def queue_exists(conn: Conn, queue: str) -> bool:
    found = conn.execute(
        "SELECT 1 FROM pepsi.amqp_queue WHERE vhost = '/' AND name = %s", (queue,)
    ).fetchone()
    return found is not None


def publish(channel: BlockingChannel, queue: str, bodies: list[bytes], **props: Any) -> None:
    """Confirmed publishes (the channel is in confirm mode: `open_channel`)."""
    for body in bodies:
        channel.basic_publish("", queue, body, BasicProperties(**props))


def dead_letter_setup(channel: BlockingChannel, queue: str, **arguments: Any) -> None:
    """`queue` dead-letters through the fanout exchange dlx into the queue `dead`."""
    channel.exchange_declare("dlx", "fanout")
    channel.queue_declare("dead")
    channel.queue_bind("dead", "dlx")
    channel.queue_declare(queue, arguments={"x-dead-letter-exchange": "dlx", **arguments})


def assert_expired_letter(channel: BlockingChannel, queue: str, body: bytes) -> None:
    method, props, got = channel.basic_get("dead", auto_ack=True)
    assert method is not None, "a dead letter"
    assert got == body
    assert (method.exchange, method.routing_key) == ("dlx", queue)
    death = props.headers["x-death"]
    assert len(death) == 1
    assert {k: text(death[0][k]) for k in ("reason", "queue", "exchange")} == {
        "reason": "expired",
        "queue": queue,
        "exchange": "",
    }
    assert death[0]["count"] == 1
    assert text(props.headers["x-first-death-reason"]) == "expired"


# -- expired messages -----------------------------------------------------------------------


def test_a_message_past_its_expiration_is_dead_lettered_as_expired(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn, broker: DispatcherThread
) -> None:
    channel = open_channel(amqp())
    dead_letter_setup(channel, "live")
    publish(channel, "live", [b"short-lived"], expiration="50")
    publish(channel, "live", [b"long-lived"], expiration="600000")
    # nobody consumes or gets: only the expiry pass can have moved it
    wait_until(lambda: rows(conn, "dead") == {"pending": 1}, what="the dead letter")
    assert rows(conn, "live") == {"pending": 1}  # the other one has not expired
    assert_expired_letter(channel, "live", b"short-lived")
    assert expiry(broker).expired == 1


def test_a_dead_letter_loses_its_expiration_and_takes_its_new_queues_ttl(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn
) -> None:
    """As RabbitMQ: the expiration property goes (x-death's original-expiration keeps
    it: aio-pika's test_expiration reads it), and the dead-letter queue's x-message-ttl
    applies from the dead letter's arrival there."""
    channel = open_channel(amqp())
    channel.exchange_declare("dlx", "fanout")
    channel.queue_declare("dead", arguments={"x-message-ttl": 600_000})
    channel.queue_bind("dead", "dlx")
    channel.queue_declare("live", arguments={"x-dead-letter-exchange": "dlx"})
    publish(channel, "live", [b"short-lived"], expiration="50", headers={"mine": "kept"})
    wait_until(lambda: rows(conn, "dead") == {"pending": 1}, what="the dead letter")
    (seconds,) = conn.execute(
        "SELECT extract(epoch FROM expires - now()) FROM pepsi.workqueue"
        " WHERE stage = 'amqp:/:dead'"
    ).fetchone() or (None,)
    assert seconds is not None
    assert 590 < seconds <= 600  # the new queue's TTL, from now: not the 50 ms it had
    method, props, body = channel.basic_get("dead", auto_ack=True)
    assert method is not None
    assert body == b"short-lived"
    assert props.expiration is None
    assert text(props.headers["mine"]) == "kept"
    (death,) = props.headers["x-death"]
    assert text(death["original-expiration"]) == "50"
    assert text(death["reason"]) == "expired"


def test_x_message_ttl_expires_every_message_of_the_queue(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn
) -> None:
    channel = open_channel(amqp())
    dead_letter_setup(channel, "brief", **{"x-message-ttl": 100})
    channel.queue_declare(
        "at-once", arguments={"x-message-ttl": 0, "x-dead-letter-exchange": "dlx"}
    )
    publish(channel, "brief", [b"a", b"b", b"c"])
    publish(channel, "at-once", [b"zero"])
    wait_until(lambda: rows(conn, "dead") == {"pending": 4}, what="four dead letters")
    assert rows(conn, "brief") == {}
    assert rows(conn, "at-once") == {}
    got = []
    for _ in range(4):
        method, props, body = channel.basic_get("dead", auto_ack=True)
        assert method is not None
        death = props.headers["x-death"][0]
        assert text(death["reason"]) == "expired"
        got.append((text(death["queue"]), body))
    assert sorted(got) == [("at-once", b"zero"), ("brief", b"a"), ("brief", b"b"),
                           ("brief", b"c")]  # fmt: skip


def test_x_message_ttl_0_delivers_to_a_consumer_ready_at_once_and_expires_otherwise(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn
) -> None:
    """As RabbitMQ: TTL 0 means 'now or never': a consumer with room gets the message;
    without one it is dead-lettered as expired."""
    connection = amqp()
    channel = open_channel(connection)
    dead_letter_setup(channel, "now", **{"x-message-ttl": 0})
    consumer = connection.channel()
    consumer.basic_qos(prefetch_count=10)
    got: list[bytes] = []
    tag = consumer.basic_consume(
        "now", lambda ch, m, p, body: (got.append(body), ch.basic_ack(m.delivery_tag))
    )
    publish(channel, "now", [b"a", b"b", b"c"])
    wait_until(lambda: connection.process_data_events(time_limit=0.05) or len(got) == 3,
               what="three deliveries")  # fmt: skip
    assert sorted(got) == [b"a", b"b", b"c"]
    assert rows(conn, "dead") == {}
    consumer.basic_cancel(tag)
    publish(channel, "now", [b"nobody"])
    wait_until(lambda: rows(conn, "dead") == {"pending": 1}, what="the expired one")
    assert_expired_letter(channel, "now", b"nobody")


def test_x_message_ttl_sets_the_sooner_of_the_two_expiries_at_publish(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn
) -> None:
    channel = open_channel(amqp())
    channel.queue_declare("slow", arguments={"x-message-ttl": 60_000})
    channel.queue_declare("plain")
    channel.exchange_declare("both", "fanout")
    channel.queue_bind("slow", "both")
    channel.queue_bind("plain", "both")
    channel.basic_publish("both", "", b"ttl only")
    channel.basic_publish("both", "", b"own first", BasicProperties(expiration="30000"))
    channel.basic_publish("both", "", b"queue first", BasicProperties(expiration="90000"))
    found = conn.execute(
        "SELECT w.stage, b.body, extract(epoch FROM w.expires - w.arrived)"
        " FROM pepsi.workqueue w JOIN pepsi.workqueue_body b USING (body_id)"
        " ORDER BY w.workqueue_id"
    ).fetchall()
    seconds = {(stage.rsplit(":", 1)[1], bytes(body)): s for stage, body, s in found}
    assert seconds[("plain", b"ttl only")] is None  # one row per queue, each its own expiry
    assert 59 < seconds[("slow", b"ttl only")] <= 60.5
    assert 29 < seconds[("plain", b"own first")] <= 30.5
    assert 29 < seconds[("slow", b"own first")] <= 30.5
    assert 89 < seconds[("plain", b"queue first")] <= 90.5
    assert 59 < seconds[("slow", b"queue first")] <= 60.5


def test_an_expired_message_without_dead_letter_exchange_fails_and_is_never_delivered(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn, broker: DispatcherThread
) -> None:
    connection = amqp()
    channel = open_channel(connection)
    channel.queue_declare("nowhere")
    publish(channel, "nowhere", [b"stale"], expiration="50")
    wait_until(lambda: rows(conn, "nowhere") == {"failed": 1}, what="the failed row")
    state = conn.execute(
        "SELECT state FROM pepsi.workqueue WHERE stage = 'amqp:/:nowhere'"
    ).fetchone()
    assert state is not None
    assert state[0]["dead_letter_reason"] == "expired"
    assert state[0]["x_death"][0]["reason"] == "expired"
    assert channel.basic_get("nowhere") == (None, None, None)
    got: list[bytes] = []
    channel.basic_consume("nowhere", lambda ch, m, p, b: got.append(b), auto_ack=True)
    publish(channel, "nowhere", [b"fresh"])

    def received() -> bool:
        connection.process_data_events(time_limit=0.05)
        return bool(got)

    wait_until(received, what="the fresh message")
    await_passes(broker)
    connection.process_data_events(time_limit=0.05)
    assert got == [b"fresh"]
    assert rows(conn, "nowhere") == {"failed": 1}


# -- expired queues -------------------------------------------------------------------------


def test_an_unused_queue_with_x_expires_is_deleted_and_a_consumed_one_is_not(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn, broker: DispatcherThread
) -> None:
    connection = amqp()
    channel = open_channel(connection)
    channel.queue_declare("idle", arguments={"x-expires": 300})
    channel.queue_declare("busy", arguments={"x-expires": 300})
    channel.queue_declare("forever")
    publish(channel, "idle", [b"goes with its queue"])
    tag = channel.basic_consume("busy", lambda ch, m, p, b: None)
    wait_until(lambda: not queue_exists(conn, "idle"), what="the idle queue to go")
    assert rows(conn, "idle") == {}
    await_passes(broker)  # each began more than 300 ms after "busy" was declared
    assert queue_exists(conn, "busy")
    assert queue_exists(conn, "forever")
    channel.basic_cancel(tag)
    wait_until(lambda: not queue_exists(conn, "busy"), what="the busy queue, once unused")
    assert queue_exists(conn, "forever")
    # counted once the deletion committed, which this connection may see first
    wait_until(lambda: expiry(broker).deleted == 2, what="both deletions counted")


def test_the_x_expires_timer_starts_again_with_the_broker(dsn: str, users: Conn) -> None:
    first = DispatcherThread(dsn)
    try:
        connection = connect(first)
        # durable: a transient queue would not outlive the broker at all
        connection.channel().queue_declare("old", durable=True, arguments={"x-expires": 5000})
        connection.close()
    finally:
        assert first.stop() == 0
    users.execute("UPDATE pepsi.amqp_queue SET declared_at = now() - interval '1 hour'")
    second = DispatcherThread(dsn)
    try:
        await_passes(second, 1)
        assert queue_exists(users, "old")  # declared an hour ago, but the broker is new
        wait_until(lambda: not queue_exists(users, "old"), what="the queue, 5 s later")
    finally:
        assert second.stop() == 0
