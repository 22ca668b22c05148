"""Direct delivery (issue 36): a publish to a queue whose consumers wait, with nothing
pending, is written running and sent when its commit returns, without a claim; a
returned message still comes first; rows a lost commit may have left running go back.
pika against a real dispatcher in this process."""

from __future__ import annotations

import json
from typing import Any

import pika
import psycopg
from psycopg.types.json import Jsonb

from pepsi.amqp.broker.publish.columns import routing_json
from pepsi.db.queries import query
from tests.integration.amqp_dispatcher import BASE, DispatcherThread, connect, open_channel, rows
from tests.scenarios.conftest import wait_until

Conn = psycopg.Connection[Any]
QUEUE = "direct"
STAGE = f"amqp:/:{QUEUE}"


def known_empty(broker: DispatcherThread) -> bool:
    """The dispatcher knows the queue has nothing pending (a claim found it empty)."""
    return broker.run(lambda: broker.dispatcher.known.pending(STAGE)) == 0


def consumer(broker: DispatcherThread, prefetch: int) -> tuple[Any, Any, list[Any]]:
    """A connection, channel and the deliveries of a consumer on QUEUE (manual acks)."""
    connection = connect(broker)
    channel = connection.channel()
    channel.queue_declare(QUEUE)
    channel.basic_qos(prefetch_count=prefetch)
    got: list[Any] = []
    channel.basic_consume(QUEUE, lambda ch, m, p, body: got.append((m, body)))
    return connection, channel, got


def receive(connection: pika.BlockingConnection, got: list[Any], n: int) -> None:
    def arrived() -> bool:
        connection.process_data_events(time_limit=0.02)
        return len(got) >= n

    wait_until(arrived, what=f"{n} deliveries")


def test_a_waiting_consumer_gets_publishes_without_a_claim(
    broker: DispatcherThread, conn: Conn
) -> None:
    connection, channel, got = consumer(broker, prefetch=50)
    wait_until(lambda: known_empty(broker), what="the queue known empty")
    publisher = connect(broker)
    sending = open_channel(publisher)
    for i in range(20):
        sending.basic_publish("", QUEUE, b"m%d" % i)  # confirmed: committed
    receive(connection, got, 20)
    assert [body for _, body in got] == [b"m%d" % i for i in range(20)]
    assert not any(m.redelivered for m, _ in got)
    assert broker.run(lambda: broker.deliverer.direct_rows) == 20
    assert broker.run(lambda: broker.deliverer.loaded_with_claim) == 0  # no claim took one
    assert rows(conn, QUEUE) == {"running": 20}  # unacked: the consumer's
    for method, _ in got:
        channel.basic_ack(method.delivery_tag)
    wait_until(lambda: rows(conn, QUEUE) == {}, what="the acks written")
    publisher.close()
    connection.close()


def test_a_returned_message_comes_before_one_published_after_it(broker: DispatcherThread) -> None:
    connection, channel, got = consumer(broker, prefetch=1)
    wait_until(lambda: known_empty(broker), what="the queue known empty")
    publisher = connect(broker)
    sending = open_channel(publisher)
    sending.basic_publish("", QUEUE, b"first")
    receive(connection, got, 1)
    sending.basic_publish("", QUEUE, b"second")  # read ahead: no credit for it yet
    channel.basic_nack(got[0][0].delivery_tag, requeue=True)
    receive(connection, got, 2)
    assert (got[1][1], got[1][0].redelivered) == (b"first", True)
    channel.basic_ack(got[1][0].delivery_tag)
    receive(connection, got, 3)
    assert (got[2][1], got[2][0].redelivered) == (b"second", False)
    channel.basic_ack(got[2][0].delivery_tag)
    publisher.close()
    connection.close()


def test_rows_a_lost_commit_left_running_go_back_and_are_claimed(
    dsn: str, users: Conn, conn: Conn
) -> None:
    # no poll tick within the test: only the reset itself can make the row claimable
    server = DispatcherThread(dsn, base=BASE.replace("POLL_INTERVAL = 1s", "POLL_INTERVAL = 1h"))
    try:
        connection, _, got = consumer(server, prefetch=10)
        wait_until(lambda: known_empty(server), what="the queue known empty")
        # a row written running, as by a publish whose connection was lost during its
        # commit: no consumer holds it, and the dispatcher still counts the queue empty
        props = Jsonb(json.loads(routing_json("", QUEUE)))  # what a publish writes
        nothing: list[None] = [None]
        args = ([STAGE], nothing, ["alice"], *[nothing] * 3, [props], nothing, nothing, [b"lost"])
        conn.execute(query("amqp_publish"), (*args, None, [True]))  # [True]: written running
        assert rows(conn, QUEUE) == {"running": 1}
        amqp = server.dispatcher.amqp_broker
        assert amqp is not None
        server.run(amqp.batcher.on_orphans)  # as the batcher calls it after such a loss
        receive(connection, got, 1)  # put back, its queue's count forgotten, claimed
        assert got[0][1] == b"lost"
        assert got[0][0].redelivered is True  # the reset cannot know it was never sent
        connection.close()
    finally:
        assert server.stop() == 0


def test_direct_rows_are_counted_as_claimed(dsn: str, users: Conn, conn: Conn) -> None:
    def claimed() -> int:
        row = conn.execute("SELECT claimed FROM pepsi.dispatch_stats").fetchone()
        return int(row[0]) if row else 0

    # no poll tick within the test: the consumers' freed credit wakes the loop, which
    # then flushes the statistics (P-9)
    server = DispatcherThread(dsn, base=BASE.replace("POLL_INTERVAL = 1s", "POLL_INTERVAL = 1h"))
    try:
        connection, channel, got = consumer(server, prefetch=10)
        wait_until(lambda: known_empty(server), what="the queue known empty")
        before = claimed()
        publisher = connect(server)
        sending = open_channel(publisher)
        for body in (b"a", b"b", b"c"):
            sending.basic_publish("", QUEUE, body)
        receive(connection, got, 3)
        assert server.run(lambda: server.deliverer.direct_rows) == 3
        wait_until(lambda: claimed() >= before + 3, what="the direct rows counted as claimed")
        for method, _ in got:
            channel.basic_ack(method.delivery_tag)
        publisher.close()
        connection.close()
    finally:
        assert server.stop() == 0
