"""The AMQP broker, part 2 (issue 16): consuming. pika against a real dispatcher in this
process (its one claim feeds the consumers, A-1) and the test database; outcomes are
checked where they land, in pepsi.workqueue."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import aio_pika
import pika
import pika.exceptions
import psycopg
import pytest
from pika.adapters.blocking_connection import BlockingChannel
from pika.spec import BasicProperties

from pepsi.admin.accounts import amqp_users
from pepsi.amqp.broker.declaring import DeclaringChannel
from pepsi.amqp.broker.publish.batcher import Batcher
from pepsi.amqp.broker.publish.units import Item, Unit
from pepsi.db.backoff import Backoff
from pepsi.publishing.message import Row
from tests.integration.amqp_dispatcher import (
    DispatcherThread,
    rows,
)
from tests.integration.amqp_harness import PASSWORD, assert_no_server_bugs
from tests.scenarios.conftest import wait_until

Conn = psycopg.Connection[Any]
Message = tuple[Any, BasicProperties, bytes]


@pytest.fixture(autouse=True)
def no_server_bugs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    yield
    assert_no_server_bugs(caplog, tracebacks_only=True)


def publish(channel: BlockingChannel, queue: str, bodies: list[bytes], **props: Any) -> None:
    channel.confirm_delivery()
    for body in bodies:
        channel.basic_publish("", queue, body, BasicProperties(**props))


def receive(connection: pika.BlockingConnection, got: list[Any], n: int, what: str) -> None:
    """Let pika dispatch deliveries until `got` holds `n`."""

    def enough() -> bool:
        connection.process_data_events(time_limit=0.05)
        return len(got) >= n

    wait_until(enough, what=what)


def two_held(
    amqp: Callable[[], pika.BlockingConnection], bodies: list[bytes]
) -> tuple[BlockingChannel, pika.BlockingConnection]:
    """`bodies` published to queue "held" (a channel to look with), and a consumer's
    connection (prefetch 2) that got two of them and acks none."""
    watcher = amqp().channel()
    watcher.queue_declare("held")
    publish(watcher, "held", bodies)
    connection = amqp()
    consumer = connection.channel()
    consumer.basic_qos(prefetch_count=2)
    got: list[Message] = []
    consumer.basic_consume("held", lambda ch, m, p, b: got.append((m, p, b)))
    receive(connection, got, 2, "two deliveries, not acked")
    return watcher, connection


def test_manual_ack_consumer_gets_every_message_in_order_and_acks_delete_them(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn
) -> None:
    connection = amqp()
    channel = connection.channel()
    channel.queue_declare("orders")
    bodies = [f"m{i}".encode() for i in range(50)]
    publish(channel, "orders", bodies, headers={"k": 1}, content_type="text/plain")
    got: list[Message] = []
    channel.basic_consume("orders", lambda ch, m, p, b: got.append((m, p, b)))
    receive(connection, got, 50, "50 deliveries")
    assert [b for _, _, b in got] == bodies
    method, props, _ = got[0]
    assert (method.exchange, method.routing_key, method.redelivered) == ("", "orders", False)
    assert (props.headers, props.content_type) == ({"k": 1}, "text/plain")
    assert [m.delivery_tag for m, _, _ in got] == list(range(1, 51))
    assert rows(conn, "orders") == {"running": 50}
    channel.basic_ack(got[24][0].delivery_tag, multiple=True)  # 1..25
    channel.basic_ack(got[30][0].delivery_tag)
    wait_until(lambda: rows(conn, "orders") == {"running": 24}, what="26 acks written")
    channel.basic_ack(0, multiple=True)  # everything outstanding
    wait_until(lambda: rows(conn, "orders") == {}, what="the queue to be empty")


def test_prefetch_bounds_unacked_deliveries(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn, broker: DispatcherThread
) -> None:
    connection = amqp()
    channel = connection.channel()
    channel.queue_declare("work")
    publish(channel, "work", [b"%d" % i for i in range(10)])
    channel.basic_qos(prefetch_count=3)
    got: list[Message] = []
    channel.basic_consume("work", lambda ch, m, p, b: got.append((m, p, b)))
    receive(connection, got, 3, "three deliveries")
    # no credit left: three delivered and unacked; the broker has read the rest ahead
    # (claimed, loaded) and sends nothing of it
    wait_until(lambda: rows(conn, "work") == {"running": 10}, what="the read-ahead")
    assert len(broker.unacked_ids()) == 3
    assert broker.run(lambda: len(broker.deliverer.ready["amqp:/:work"])) == 7
    connection.process_data_events(time_limit=0.2)
    assert len(got) == 3
    channel.basic_ack(got[0][0].delivery_tag)
    receive(connection, got, 4, "one more after an ack")
    assert [b for _, _, b in got] == [b"0", b"1", b"2", b"3"]


def test_nack_with_requeue_redelivers_at_its_place_with_a_delivery_count(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn
) -> None:
    connection = amqp()
    channel = connection.channel()
    channel.queue_declare("q", durable=True, arguments={"x-queue-type": "quorum"})
    publish(channel, "q", [b"first", b"second"])
    method, _, body = channel.basic_get("q")
    assert (body, method.redelivered, method.message_count) == (b"first", False, 1)
    channel.basic_nack(method.delivery_tag, requeue=True)
    wait_until(lambda: rows(conn, "q") == {"pending": 2}, what="the nack to be written")
    method, props, body = channel.basic_get("q")
    assert body == b"first"  # back to its original position
    assert method.redelivered
    assert props.headers == {"x-delivery-count": 1}
    channel.basic_reject(method.delivery_tag, requeue=True)
    wait_until(lambda: rows(conn, "q") == {"pending": 2}, what="the reject to be written")
    method, props, body = channel.basic_get("q", auto_ack=True)
    assert (body, props.headers) == (b"first", {"x-delivery-count": 2})
    assert channel.basic_get("q", auto_ack=True)[2] == b"second"
    assert channel.basic_get("q") == (None, None, None)
    wait_until(lambda: rows(conn, "q") == {}, what="the no-ack gets to be written")


def test_reject_without_requeue_dead_letters_with_x_death(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn
) -> None:
    connection = amqp()
    channel = connection.channel()
    channel.exchange_declare("dlx", "fanout")
    channel.queue_declare("dead")
    channel.queue_bind("dead", "dlx")
    channel.queue_declare("live", arguments={"x-dead-letter-exchange": "dlx"})
    channel.queue_declare("nowhere")  # no dead-letter exchange
    publish(channel, "live", [b"poison"], headers={"app": "x"})
    publish(channel, "nowhere", [b"dropped"])
    method, _, _ = channel.basic_get("live")
    channel.basic_reject(method.delivery_tag, requeue=False)
    method, _, _ = channel.basic_get("nowhere")
    channel.basic_nack(method.delivery_tag, requeue=False)
    wait_until(lambda: rows(conn, "dead") == {"pending": 1}, what="the dead letter")
    method, props, body = channel.basic_get("dead", auto_ack=True)
    assert body == b"poison"
    assert (method.exchange, method.routing_key) == ("dlx", "live")
    death = props.headers["x-death"]
    assert len(death) == 1
    assert {k: death[0][k] for k in ("count", "reason", "queue", "exchange")} == {
        "count": 1,
        "reason": b"rejected" if isinstance(death[0]["reason"], bytes) else "rejected",
        "queue": "live",
        "exchange": "",
    }
    assert death[0]["routing-keys"] == ["live"]
    assert props.headers["app"] == "x"
    assert props.headers["x-first-death-reason"] == "rejected"
    assert rows(conn, "live") == {}
    # without a dead-letter exchange RabbitMQ drops it; Pepsi keeps it as failed
    wait_until(lambda: rows(conn, "nowhere") == {"failed": 1}, what="the failed row")


def test_delivery_limit_dead_letters_a_poison_message(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn
) -> None:
    connection = amqp()
    channel = connection.channel()
    channel.queue_declare("parking")
    channel.queue_declare(
        "poison",
        durable=True,
        arguments={
            "x-queue-type": "quorum",
            "x-delivery-limit": 2,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": "parking",
        },
    )
    publish(channel, "poison", [b"boom"])
    for attempt in range(3):  # delivered, returned: three times, then dead-lettered
        method = wait_until(lambda: channel.basic_get("poison")[0], what=f"delivery {attempt}")
        channel.basic_nack(method.delivery_tag, requeue=True)
    wait_until(lambda: rows(conn, "parking") == {"pending": 1}, what="the parked message")
    assert rows(conn, "poison") == {}
    _, props, _ = channel.basic_get("parking", auto_ack=True)
    assert props.headers["x-death"][0]["reason"] == "delivery_limit"


def test_closing_a_channel_or_dropping_a_connection_requeues_its_unacked_deliveries(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn
) -> None:
    connection = amqp()
    channel = connection.channel()
    channel.queue_declare("jobs")
    publish(channel, "jobs", [b"a", b"b", b"c"])
    consumer_channel = connection.channel()
    got: list[Message] = []
    consumer_channel.basic_consume("jobs", lambda ch, m, p, b: got.append((m, p, b)))
    receive(connection, got, 3, "three deliveries")
    consumer_channel.basic_ack(got[1][0].delivery_tag)
    consumer_channel.close()
    wait_until(lambda: rows(conn, "jobs") == {"pending": 2}, what="a and c back")
    method, _, body = channel.basic_get("jobs")
    assert (body, method.redelivered) == (b"a", True)
    # a connection that drops without closing: its deliveries come back too
    other = amqp()
    other.channel().basic_get("jobs")  # takes c, unacked
    wait_until(lambda: rows(conn, "jobs") == {"running": 2}, what="c taken")
    # the socket goes, no connection.close (pika's own socket, shut down under it)
    other._impl._transport._sock.shutdown(socket.SHUT_RDWR)
    wait_until(lambda: rows(conn, "jobs") == {"running": 1, "pending": 1}, what="c back")


def test_unknown_delivery_tag_closes_the_channel_with_406(
    amqp: Callable[[], pika.BlockingConnection],
) -> None:
    channel = amqp().channel()
    channel.queue_declare("q")
    channel.basic_ack(7)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as caught:
        channel.queue_declare("q", passive=True)  # the close arrives before its answer
    assert caught.value.reply_code == 406
    assert "unknown delivery tag 7" in caught.value.reply_text


def test_no_ack_consumer_messages_are_deleted_as_they_are_sent(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn
) -> None:
    connection = amqp()
    channel = connection.channel()
    channel.queue_declare("fire")
    publish(channel, "fire", [b"%d" % i for i in range(20)])
    got: list[Message] = []
    channel.basic_consume("fire", lambda ch, m, p, b: got.append((m, p, b)), auto_ack=True)
    receive(connection, got, 20, "every message")
    wait_until(lambda: rows(conn, "fire") == {}, what="the rows deleted")


def test_two_consumers_take_turns_and_a_cancel_keeps_unacked_deliveries(
    amqp: Callable[[], pika.BlockingConnection], broker: DispatcherThread
) -> None:
    connection = amqp()
    channel = connection.channel()
    channel.queue_declare("rr")
    channel.basic_qos(prefetch_count=1)
    first: list[Message] = []
    second: list[Message] = []
    tag1 = channel.basic_consume("rr", lambda ch, m, p, b: first.append((m, p, b)))
    channel.basic_consume("rr", lambda ch, m, p, b: second.append((m, p, b)))
    assert channel.queue_declare("rr", passive=True).method.consumer_count == 2
    publish(channel, "rr", [b"1", b"2", b"3"])
    wait_until(
        lambda: connection.process_data_events(time_limit=0.05) or (first and second),
        what="one message each",
    )
    assert len(broker.unacked_ids()) == 2
    channel.basic_cancel(tag1)
    assert channel.queue_declare("rr", passive=True).method.consumer_count == 1
    channel.basic_ack(first[0][0].delivery_tag)  # still the channel's to ack
    channel.basic_ack(second[0][0].delivery_tag)
    receive(connection, second, 2, "the third message to the remaining consumer")
    assert second[1][2] == b"3"


def test_a_declaration_names_the_consumers_when_the_catalogue_is_dropped_meanwhile(
    amqp: Callable[[], pika.BlockingConnection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A catalogue change (a declaration's own NOTIFY, another client's) drops the cached
    view whenever it comes, also while a declaration counts the queue: declare-ok still
    names the queue's consumers (it answered 0, now and then, in the test above)."""
    connection = amqp()
    channel = connection.channel()
    channel.queue_declare("forgotten")
    channel.basic_consume("forgotten", lambda ch, m, p, b: None)
    counting = DeclaringChannel._pending_count

    async def count_then_forget(self: DeclaringChannel, stage: str) -> int:
        found = await counting(self, stage)
        self.catalogue.forget(self.vhost)  # as the listener does on a catalogue NOTIFY
        return found

    monkeypatch.setattr(DeclaringChannel, "_pending_count", count_then_forget)
    assert channel.queue_declare("forgotten", passive=True).method.consumer_count == 1
    assert channel.queue_declare("forgotten").method.consumer_count == 1
    connection.close()


def test_a_declaration_counts_what_a_closed_consumer_gives_back(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn, dsn: str
) -> None:
    """Another connection's consumer goes away holding deliveries (and its read-ahead):
    a declaration of their queue answers once they are written back, not before."""
    channel, consumer = two_held(amqp, [f"m{i}".encode() for i in range(4)])
    answered = threading.Event()
    with (
        psycopg.connect(dsn) as blocker,
        concurrent.futures.ThreadPoolExecutor(2) as pool,
    ):
        blocker.execute("LOCK TABLE pepsi.workqueue IN EXCLUSIVE MODE")  # returns wait
        closed = pool.submit(consumer.close)  # its channel's close waits for the write
        wait_until(
            lambda: conn.execute(
                "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND query LIKE '%WITH acked AS%'"
            ).fetchall(),
            what="the returns waiting for the lock",
        )

        def declare() -> int:
            count = channel.queue_declare("held", passive=True).method.message_count
            answered.set()
            return int(count)

        counted = pool.submit(declare)
        early = answered.wait(2)  # a correct server cannot answer before the write
        blocker.rollback()
        assert not early, "the declaration counted before the returns were written"
        assert counted.result(10) == 4
        closed.result(10)


def test_a_message_count_of_zero_means_every_message_was_sent(
    amqp: Callable[[], pika.BlockingConnection],
) -> None:
    """Rows claimed for a consumer and still being loaded count as ready: once a passive
    declare says 0, the messages are on their way, and a cancel hands them back (as
    pika's acceptance test of a cancelled no-ack consumer expects)."""
    connection = amqp()
    channel = connection.channel()
    channel.queue_declare("sent")
    publish(channel, "sent", [b"a" * 1024, b"b" * 2048])
    tag = channel.basic_consume("sent", lambda *a: None, auto_ack=True)
    wait_until(
        lambda: channel.queue_declare("sent", passive=True).method.message_count == 0,
        what="no message left ready",
    )
    returned = channel.basic_cancel(tag)  # what pika received and did not dispatch yet
    assert [body for _, _, body in returned] == [b"a" * 1024, b"b" * 2048]


def test_exclusive_consumer_and_if_unused_delete(
    amqp: Callable[[], pika.BlockingConnection],
) -> None:
    channel = amqp().channel()
    channel.queue_declare("solo")
    channel.basic_consume("solo", lambda *a: None, exclusive=True)
    other = amqp().channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as caught:
        other.basic_consume("solo", lambda *a: None)
    assert caught.value.reply_code == 403
    assert "in exclusive use" in caught.value.reply_text
    third = amqp().channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as caught:
        third.queue_delete("solo", if_unused=True)
    assert caught.value.reply_code == 406


def test_deleting_a_queue_cancels_its_consumers(
    amqp: Callable[[], pika.BlockingConnection],
) -> None:
    connection = amqp()
    channel = connection.channel()
    channel.queue_declare("doomed")
    cancelled: list[Any] = []
    channel.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
    tag = channel.basic_consume("doomed", lambda *a: None)
    amqp().channel().queue_delete("doomed")
    wait_until(
        lambda: connection.process_data_events(time_limit=0.05) or cancelled,
        what="basic.cancel from the server",
    )
    assert cancelled == [tag]


def test_an_auto_delete_queue_goes_with_its_last_consumer(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn
) -> None:
    channel = amqp().channel()
    channel.queue_declare("temp", auto_delete=True)
    tag = channel.basic_consume("temp", lambda *a: None)
    channel.basic_cancel(tag)

    def gone() -> bool:
        row = conn.execute("SELECT count(*) FROM pepsi.amqp_queue WHERE name = 'temp'")
        return row.fetchone() == (0,)

    wait_until(gone, what="the queue to be deleted")


def test_recover_requeues_unacked_and_prefetch_size_is_not_implemented(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn
) -> None:
    connection = amqp()
    channel = connection.channel()
    channel.queue_declare("r")
    publish(channel, "r", [b"x"])
    channel.basic_get("r")
    channel.basic_recover(requeue=True)
    wait_until(lambda: rows(conn, "r") == {"pending": 1}, what="the recover")
    method, _, _ = channel.basic_get("r", auto_ack=True)
    assert method.redelivered
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as caught:
        channel.basic_qos(prefetch_size=10)
    assert caught.value.reply_code == 540


def test_unacked_deliveries_are_redelivered_after_a_dispatcher_restart(
    dsn: str, conn: Conn
) -> None:
    amqp_users.add_user(conn, "alice", PASSWORD)
    amqp_users.set_permissions(conn, "alice", ".*", ".*", ".*")
    credentials = pika.PlainCredentials("alice", PASSWORD)
    first = DispatcherThread(dsn)
    connection = pika.BlockingConnection(
        pika.ConnectionParameters("127.0.0.1", first.port, credentials=credentials)
    )
    channel = connection.channel()
    channel.queue_declare("durable", durable=True)
    publish(channel, "durable", [b"kept"])
    assert channel.basic_get("durable")[2] == b"kept"  # unacked when the broker stops
    assert first.stop() == 0
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker):  # 320, at the stop
        wait_until(lambda: connection.process_data_events(0.05), what="the 320")
    second = DispatcherThread(dsn)
    try:
        connection = pika.BlockingConnection(
            pika.ConnectionParameters("127.0.0.1", second.port, credentials=credentials)
        )
        method, _, body = connection.channel().basic_get("durable", auto_ack=True)
        assert (body, method.redelivered) == (b"kept", True)
        connection.close()
    finally:
        assert second.stop() == 0


def test_a_channels_methods_are_ordered_a_get_sees_the_publish_before_it(
    amqp: Callable[[], pika.BlockingConnection],
) -> None:
    channel = amqp().channel()
    channel.queue_declare("ordered")
    for i in range(20):  # no confirms: the publish is not waited for by the client
        channel.basic_publish("", "ordered", b"%d" % i)
        method, _, body = channel.basic_get("ordered", auto_ack=True)
        assert body == b"%d" % i
        assert method.message_count == 0
    channel.basic_publish("", "ordered", b"counted")
    assert channel.queue_declare("ordered", passive=True).method.message_count == 1


def test_closing_a_channel_puts_its_deliveries_back_in_order_before_close_ok(
    amqp: Callable[[], pika.BlockingConnection],
) -> None:
    connection = amqp()
    channel = connection.channel()
    channel.queue_declare("back")
    publish(channel, "back", [b"m1", b"m2", b"m3"])
    consumer = connection.channel()
    consumer.basic_qos(prefetch_count=1)
    got: list[Message] = []
    consumer.basic_consume("back", lambda ch, m, p, b: got.append((m, p, b)))
    receive(connection, got, 1, "the first delivery")
    consumer.close()  # m1 unacked, m2 and m3 read ahead: all three ready again, in order
    other = connection.channel()
    bodies = [other.basic_get("back", auto_ack=True)[2] for _ in range(3)]
    assert bodies == [b"m1", b"m2", b"m3"]


def test_closing_a_connection_puts_its_deliveries_back_before_close_ok(
    amqp: Callable[[], pika.BlockingConnection],
) -> None:
    """As RabbitMQ: once connection.close-ok arrives, a passive declare counts them."""
    watcher, connection = two_held(amqp, [b"m1", b"m2", b"m3"])
    connection.close()  # two unacked, the third maybe read ahead
    assert watcher.queue_declare("held", passive=True).method.message_count == 3


def test_an_auto_delete_queue_goes_after_its_consumers_deliveries_are_back(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn
) -> None:
    """Its last consumer's connection closes with unacked deliveries: they are written
    back, then the queue is deleted with them (done at once, the two statements could
    deadlock on the rows and leave the queue behind, as aio-pika's test_rpc showed)."""
    watcher = amqp().channel()
    watcher.queue_declare("sleeper", auto_delete=True)
    publish(watcher, "sleeper", [f"m{i}".encode() for i in range(10)])
    connection = amqp()
    consumer = connection.channel()
    got: list[Message] = []
    consumer.basic_consume("sleeper", lambda ch, m, p, b: got.append((m, p, b)))
    receive(connection, got, 10, "ten deliveries")
    connection.close()

    def gone() -> bool:
        row = conn.execute("SELECT count(*) FROM pepsi.amqp_queue WHERE name = 'sleeper'")
        return row.fetchone() == (0,)

    wait_until(gone, what="the auto-delete queue to go")
    left = conn.execute("SELECT count(*) FROM pepsi.workqueue WHERE stage = 'amqp:/:sleeper'")
    assert left.fetchone() == (0,)


def test_update_secret_is_accepted_and_the_connection_goes_on(
    amqp: Callable[[], pika.BlockingConnection],
) -> None:
    connection = amqp()
    connection.update_secret("a-new-token", "token refresh")
    assert connection.channel().queue_declare("still-open").method.queue == "still-open"


def test_pepsi_amqp_changes_reach_open_connections(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn, broker: DispatcherThread
) -> None:
    """NOTIFY amqp_changed: narrowed permissions apply to the next publish, none left or a
    deleted user ends the connection (320), as rabbitmqctl does."""
    amqp_users.add_user(conn, "bob", PASSWORD)
    amqp_users.set_permissions(conn, "bob", ".*", ".*", ".*")

    def connect(user: str) -> pika.BlockingConnection:
        return pika.BlockingConnection(
            pika.ConnectionParameters(
                "127.0.0.1", broker.port, credentials=pika.PlainCredentials(user, PASSWORD)
            )
        )

    bob = connect("bob")
    channel = bob.channel()
    channel.queue_declare("news")
    channel.confirm_delivery()
    channel.basic_publish("", "news", b"allowed")
    amqp_users.set_permissions(conn, "bob", ".*", "^nothing$", ".*")
    conn.commit()

    codes: list[int] = []

    def refused() -> bool:
        try:
            channel.basic_publish("", "news", b"not any more")
        except pika.exceptions.ChannelClosedByBroker as error:
            codes.append(error.reply_code)
        return bool(codes)

    wait_until(refused, what="the narrowed write permission")
    assert codes == [403]
    amqp_users.clear_permissions(conn, "bob")
    conn.commit()
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as caught:
        wait_until(lambda: bob.process_data_events(0.05), what="bob's close")
    assert caught.value.reply_code == 320
    other = connect("alice")
    amqp_users.delete_user(conn, "alice")
    conn.commit()
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as caught:
        wait_until(lambda: other.process_data_events(0.05), what="alice's close")
    assert caught.value.reply_code == 320
    assert "user 'alice' is deleted" in caught.value.reply_text


def test_publishes_that_cannot_be_written_block_every_connection(dsn: str) -> None:
    """The batcher cannot reach the database: connection.blocked; back: unblocked."""

    async def scenario() -> list[str | None]:
        told: list[str | None] = []
        batcher = Batcher("postgresql://nobody@127.0.0.1:1/none", 1.0, Backoff(0.2, 0.1))
        batcher.on_blocked = told.append
        done = asyncio.Event()
        row = Row._make(("amqp:/:q", *(None,) * 14, 0))
        batcher.submit(Unit([Item([row])], lambda *_: done.set()))
        await asyncio.wait_for(done.wait(), 30)
        batcher.dsn = dsn  # the database is back
        done.clear()
        batcher.submit(Unit([Item([])], lambda *_: done.set()))
        await asyncio.wait_for(done.wait(), 30)
        await batcher.close()
        return told

    assert asyncio.run(scenario()) == ["the database is unavailable", None]


def test_drop_head_overflow_dead_letters_with_reason_maxlen(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn
) -> None:
    channel = amqp().channel()
    channel.queue_declare("overflowed")
    channel.queue_declare(
        "short",
        arguments={
            "x-max-length": 1,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": "overflowed",
        },
    )
    publish(channel, "short", [b"old", b"new"])  # drop-head: old is pushed out
    wait_until(lambda: rows(conn, "overflowed") == {"pending": 1}, what="the dead letter")
    _, props, body = channel.basic_get("overflowed", auto_ack=True)
    assert body == b"old"
    assert props.headers["x-death"][0]["reason"] == "maxlen"
    assert props.headers["x-death"][0]["queue"] == "short"
    assert channel.basic_get("short", auto_ack=True)[2] == b"new"


def test_aio_pika_consumes_with_manual_acks_and_a_requeue(broker: DispatcherThread) -> None:
    url = f"amqp://alice:{PASSWORD}@127.0.0.1:{broker.port}/"

    async def scenario() -> list[tuple[bytes, bool]]:
        async with await aio_pika.connect(url) as connection:
            channel = await connection.channel(publisher_confirms=True)
            await channel.set_qos(prefetch_count=10)
            queue = await channel.declare_queue("aio", durable=True)
            for i in range(5):
                await channel.default_exchange.publish(aio_pika.Message(b"m%d" % i), "aio")
            seen: list[tuple[bytes, bool]] = []
            async with queue.iterator() as messages:
                async for message in messages:
                    seen.append((message.body, message.redelivered))
                    if message.body == b"m2" and not message.redelivered:
                        await message.nack(requeue=True)  # comes again, redelivered
                    else:
                        await message.ack()
                    if len(seen) == 6:
                        break
            return seen

    seen = asyncio.run(scenario())
    assert sorted(b for b, _ in seen) == [b"m0", b"m1", b"m2", b"m2", b"m3", b"m4"]
    assert (b"m2", True) in seen


def test_freed_credit_does_not_claim_again_for_a_queue_found_empty(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn, broker: DispatcherThread
) -> None:
    """A consumer's freed credit asks for a claim (the read-ahead runs low); once a claim
    found its queue empty, such wakeups skip it until news comes (a publish, a NOTIFY, a
    timer): a Celery task paid one or two empty claims besides its two real ones."""
    connection = amqp()
    channel = connection.channel()
    channel.queue_declare("quiet")
    got: list[Message] = []
    channel.basic_qos(prefetch_count=1)
    channel.basic_consume("quiet", lambda ch, m, p, b: got.append((m, p, b)))
    dispatcher = broker.dispatcher
    stage = "amqp:/:quiet"
    asked: list[dict[str, int]] = []
    run_once = dispatcher.claimer.run_once

    async def counting(c: Any, capacities: dict[str, int], *rest: Any) -> Any:
        asked.append(dict(capacities))
        return await run_once(c, capacities, *rest)

    broker.run(lambda: setattr(dispatcher.claimer, "run_once", counting))

    def cycle_after(wake: Callable[[], None]) -> None:
        before = len(asked)
        broker.run(wake)
        wait_until(lambda: len(asked) > before, what="a dispatcher cycle")

    cycle_after(lambda: dispatcher.wake("worker"))  # news: the empty queue is asked once
    assert stage in asked[-1]
    for _ in range(5):  # credit alone: no claim of it
        cycle_after(lambda: broker.deliverer.link.wake("credit"))
        assert stage not in asked[-1]
    # and declare-ok's message_count is 0 without a count(*)
    catalogue = dispatcher.amqp_broker.catalogue  # type: ignore[union-attr]
    counted: list[str] = []
    count = catalogue.message_count

    async def counting_count(name: str) -> int:
        counted.append(name)
        return await count(name)

    broker.run(lambda: setattr(catalogue, "message_count", counting_count))
    assert channel.queue_declare("quiet", passive=True).method.message_count == 0
    assert counted == []
    publish(channel, "quiet", [b"news"])  # its commit wakes the dispatcher: claimed
    receive(connection, got, 1, "the published message")
    assert [b for _, _, b in got] == [b"news"]
    channel.basic_ack(got[0][0].delivery_tag)
    wait_until(lambda: rows(conn, "quiet") == {}, what="the ack written")
    cycle_after(lambda: broker.deliverer.link.wake("amqp"))  # returns written: news
    assert stage in asked[-1]
    channel.basic_cancel(channel.consumer_tags[0])  # no consumer: the queue is not claimed
    # this listener's commits count from the empty claim: no count(*) either
    publish(channel, "quiet", [b"kept", b"more"])
    assert channel.queue_declare("quiet", passive=True).method.message_count == 2
    assert counted == []
    # basic.get takes a row, not the dispatcher's claim: counted again
    _, _, body = channel.basic_get("quiet", auto_ack=True)
    assert body == b"kept"
    assert channel.queue_declare("quiet", passive=True).method.message_count == 1
    assert counted == [stage]


def test_declare_ok_counts_what_the_queue_holds_after_each_change(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn, broker: DispatcherThread
) -> None:
    """declare-ok's message_count comes from what the dispatcher knows (a claim found the
    queue empty, this listener's commits since) until anything else may have changed the
    queue; whichever way it is answered, it is what the queue holds."""
    connection = amqp()
    channel = connection.channel()
    channel.queue_declare("counted")
    dispatcher = broker.dispatcher
    stage = "amqp:/:counted"

    def found_empty() -> None:
        """A consumer comes, its claim finds the queue empty, it goes."""
        tag = channel.basic_consume("counted", lambda *_: None)
        wait_until(lambda: broker.run(lambda: dispatcher.known.pending(stage) == 0), what="a claim")
        channel.basic_cancel(tag)

    def count() -> int:
        return int(channel.queue_declare("counted", passive=True).method.message_count)

    found_empty()
    publish(channel, "counted", [b"1", b"2", b"3"])
    assert count() == 3 == rows(conn, "counted")["pending"]
    assert channel.queue_purge("counted").method.message_count == 3
    assert count() == 0
    found_empty()
    publish(channel, "counted", [b"4", b"5"])
    method, _, body = channel.basic_get("counted")
    assert body == b"4"
    assert count() == 1
    channel.basic_nack(method.delivery_tag, requeue=True)  # given back: ready again
    assert count() == 2
    # another process's publish counts once its NOTIFY reaches the dispatcher
    conn.execute("SELECT pepsi.workqueue_publish_one(%s, NULL, %s)", (stage, b"6"))
    wait_until(lambda: count() == 3, what="the NOTIFY")
    assert rows(conn, "counted") == {"pending": 3}
    channel.queue_delete("counted")
    channel.queue_declare("counted")
    assert count() == 0
    channel.queue_delete("counted")
    channel.queue_declare("counted", arguments={"x-max-length": 2})  # drop-head
    found_empty()
    publish(channel, "counted", [b"7", b"8", b"9"])
    assert count() == 2 == rows(conn, "counted")["pending"]


def test_a_count_that_a_claim_overlapped_is_taken_again(
    amqp: Callable[[], pika.BlockingConnection], broker: DispatcherThread
) -> None:
    """declare-ok adds the read-ahead to the pending rows counted: a claim that ran while
    the count did may have moved rows from one to the other, and counted them twice (a
    thousand too many, with consumers reading ahead). Such a count is taken again."""
    channel = amqp().channel()
    channel.queue_declare("recount")
    publish(channel, "recount", [b"a", b"b"])  # no consumer: the count is not known
    dispatcher = broker.dispatcher
    catalogue = dispatcher.amqp_broker.catalogue  # type: ignore[union-attr]
    count = catalogue.message_count
    calls: list[str] = []

    async def overlapped(stage: str) -> int:
        calls.append(stage)
        if len(calls) == 1:
            dispatcher.claim_turns += 2  # as if a claim ran meanwhile
        return await count(stage)

    broker.run(lambda: setattr(catalogue, "message_count", overlapped))
    assert channel.queue_declare("recount", passive=True).method.message_count == 2
    assert calls == ["amqp:/:recount"] * 2


def test_a_purge_waits_for_a_claim_under_way_and_takes_what_it_read_ahead(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn, broker: DispatcherThread
) -> None:
    """The rows of a claim under way are running in SQL and not read ahead yet: a purge
    then would miss them, and they would reach the consumer after it. The purge waits
    for the claim, then drops what it read ahead."""
    purger = amqp().channel()
    purger.queue_declare("racing")
    publish(purger, "racing", [b"%d" % i for i in range(20)])
    dispatcher = broker.dispatcher
    stage = "amqp:/:racing"
    gate = asyncio.Event()
    claimed = threading.Event()
    run_once = dispatcher.claimer.run_once

    async def gated(c: Any, capacities: dict[str, int], *rest: Any) -> Any:
        rows = await run_once(c, capacities, *rest)
        if any(row.stage == stage for row in rows) and not gate.is_set():
            claimed.set()  # taken in SQL, not read ahead yet
            await gate.wait()
        return rows

    link = dispatcher.amqp_broker.deliverer.link  # type: ignore[union-attr]
    between = link.between_claims
    waiting = threading.Event()

    async def purge_waits() -> int:
        waiting.set()
        return await between()

    broker.run(lambda: setattr(dispatcher.claimer, "run_once", gated))
    broker.run(lambda: setattr(link, "between_claims", purge_waits))
    consumer = amqp()
    channel = consumer.channel()
    channel.basic_qos(prefetch_count=1)
    channel.basic_consume("racing", lambda *_: None)  # its credit asks for a claim
    wait_until(claimed.is_set, what="the claim under way")
    purged: list[int] = []
    thread = threading.Thread(
        target=lambda: purged.append(purger.queue_purge("racing").method.message_count)
    )
    thread.start()
    wait_until(waiting.is_set, what="the purge waiting for the claim")
    broker.run(gate.set)
    thread.join(timeout=30)
    assert purged == [19]  # all but the one delivered to the consumer
    wait_until(lambda: rows(conn, "racing") == {"running": 1}, what="the purge written")
