"""A small claim brings an AMQP consumer's rows (issue 36): what basic.deliver sends
comes with the claim, and the read-ahead skips its load. pika against a real
dispatcher in this process, fair and oldest-first claims alike."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pika
import psycopg
import pytest
from pika.spec import BasicProperties

from pepsi.dispatch.services.claimer import DELIVERY_BYTES
from tests.integration.amqp_dispatcher import DispatcherThread, connect, rows
from tests.scenarios.conftest import wait_until

Conn = psycopg.Connection[Any]
QUEUE = "trickle"


@pytest.fixture(params=["yes", "no"], ids=["fair", "fifo"])
def server(request: pytest.FixtureRequest, dsn: str, users: Conn) -> Iterator[DispatcherThread]:
    thread = DispatcherThread(dsn, f"FAIR_SCHEDULING = {request.param}\n")
    yield thread
    assert thread.stop() == 0


def consume_one(connection: pika.BlockingConnection, channel: Any) -> tuple[Any, Any, bytes]:
    """The next delivery of QUEUE (a prefetch-1 consumer is on it)."""
    got: list[tuple[Any, Any, bytes]] = []

    def arrived() -> bool:
        connection.process_data_events(time_limit=0.05)
        return bool(got)

    tag = channel.basic_consume(QUEUE, lambda ch, m, p, b: got.append((m, p, b)))
    wait_until(arrived, what="a delivery")
    channel.basic_cancel(tag)
    return got[0]


def test_small_rows_come_with_the_claim_and_a_large_one_is_loaded(
    server: DispatcherThread, conn: Conn
) -> None:
    connection = connect(server)
    channel = connection.channel()
    channel.queue_declare(QUEUE)
    channel.basic_qos(prefetch_count=1)
    channel.confirm_delivery()
    props = BasicProperties(content_type="text/plain", headers={"k": 1}, message_id="m-1")
    broker = server.dispatcher.amqp_broker
    assert broker is not None
    deliverer = broker.deliverer

    # one at a time, as a trickle comes: each claim takes one row, and brings it
    for i in range(3):
        channel.basic_publish("", QUEUE, b"small %d" % i, props)
        method, got_props, body = consume_one(connection, channel)
        assert body == b"small %d" % i
        assert (method.routing_key, method.redelivered) == (QUEUE, False)
        assert (got_props.content_type, got_props.headers, got_props.message_id) == (
            "text/plain", {"k": 1}, "m-1",
        )  # fmt: skip
        channel.basic_ack(method.delivery_tag)
    assert server.run(lambda: deliverer.loaded_with_claim) == 3

    # given back, it comes again marked redelivered, still with its claim
    channel.basic_publish("", QUEUE, b"again", props)
    method, _, body = consume_one(connection, channel)
    channel.basic_nack(method.delivery_tag, requeue=True)
    method, _, again = consume_one(connection, channel)
    assert (again, method.redelivered) == (b"again", True)
    channel.basic_ack(method.delivery_tag)
    assert server.run(lambda: deliverer.loaded_with_claim) == 5

    # over DELIVERY_BYTES: the claim gives the id only, and the read-ahead loads it
    large = bytes(range(256)) * (DELIVERY_BYTES // 256 + 1)
    channel.basic_publish("", QUEUE, large, props)
    method, _, body = consume_one(connection, channel)
    assert body == large
    channel.basic_ack(method.delivery_tag)
    assert server.run(lambda: deliverer.loaded_with_claim) == 5
    wait_until(lambda: rows(conn, QUEUE) == {}, what="every ack written")
    connection.close()
