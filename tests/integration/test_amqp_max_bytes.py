"""x-max-length-bytes (pepsi.amqp.broker.expiry, BrokerChannel._item): drop-head queues lose their
oldest messages past the limit at the next expiry pass, dead-lettered with reason maxlen
(or kept failed without a dead-letter exchange); reject-publish queues refuse, at publish,
a message that would take them over, by the broker's estimate. pika against a real
dispatcher in this process; outcomes are checked where they land, in pepsi.workqueue."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pika
import pika.exceptions
import psycopg
import pytest
from pika.adapters.blocking_connection import BlockingChannel

from tests.integration.amqp_dispatcher import (
    DispatcherThread,
    await_passes,
    expiry,
    open_channel,
    rows,
    text,
)
from tests.integration.amqp_harness import assert_no_server_bugs
from tests.scenarios.conftest import wait_until

Conn = psycopg.Connection[Any]
LIMIT = 1000
BODIES = [bytes([ord("a") + i]) * 400 for i in range(5)]  # 2000 octets, oldest first


@pytest.fixture(autouse=True)
def no_server_bugs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    yield
    assert_no_server_bugs(caplog, tracebacks_only=True)


def drain(channel: BlockingChannel, queue: str) -> list[bytes]:
    got = []
    while True:
        method, _, body = channel.basic_get(queue, auto_ack=True)
        if method is None:
            return got
        got.append(body)


# -- drop-head ------------------------------------------------------------------------------


def test_drop_head_dead_letters_the_oldest_messages_past_the_byte_limit(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn, broker: DispatcherThread
) -> None:
    channel = open_channel(amqp())
    channel.exchange_declare("dlx", "fanout")
    channel.queue_declare("dead")
    channel.queue_bind("dead", "dlx")
    channel.queue_declare(
        "small", arguments={"x-max-length-bytes": LIMIT, "x-dead-letter-exchange": "dlx"}
    )
    for body in BODIES:
        channel.basic_publish("", "small", body)  # all accepted: the limit holds at the pass
    wait_until(lambda: rows(conn, "dead") == {"pending": 3}, what="three dead letters")
    assert rows(conn, "small") == {"pending": 2}
    await_passes(broker)  # the two that fit stay
    assert rows(conn, "small") == {"pending": 2}
    assert int(broker.run(lambda: expiry(broker).dropped)) == 3
    for body in BODIES[:3]:
        method, props, got = channel.basic_get("dead", auto_ack=True)
        assert method is not None, "a dead letter"
        assert got == body
        assert (method.exchange, method.routing_key) == ("dlx", "small")
        death = props.headers["x-death"]
        assert len(death) == 1
        assert {k: text(death[0][k]) for k in ("reason", "queue", "exchange")} == {
            "reason": "maxlen",
            "queue": "small",
            "exchange": "",
        }
        assert text(props.headers["x-first-death-reason"]) == "maxlen"
    assert drain(channel, "small") == BODIES[3:]


def test_drop_head_without_dead_letter_exchange_keeps_the_dropped_rows_failed(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn, broker: DispatcherThread
) -> None:
    channel = open_channel(amqp())
    channel.queue_declare("small", arguments={"x-max-length-bytes": LIMIT})
    channel.queue_declare("plain")
    for body in BODIES:
        channel.basic_publish("", "small", body)
        channel.basic_publish("", "plain", body)
    wait_until(lambda: rows(conn, "small") == {"pending": 2, "failed": 3}, what="three failed rows")
    reasons = conn.execute(
        "SELECT b.body, w.state ->> 'dead_letter_reason' FROM pepsi.workqueue w"
        " JOIN pepsi.workqueue_body b USING (body_id)"
        " WHERE w.stage = 'amqp:/:small' AND w.status = 'failed' ORDER BY w.workqueue_id"
    ).fetchall()
    assert [(bytes(body), reason) for body, reason in reasons] == [
        (body, "maxlen") for body in BODIES[:3]
    ]
    await_passes(broker)
    assert rows(conn, "small") == {"pending": 2, "failed": 3}
    assert rows(conn, "plain") == {"pending": 5}  # a queue without the argument keeps all
    assert drain(channel, "small") == BODIES[3:]


# -- reject-publish -------------------------------------------------------------------------


def test_reject_publish_nacks_the_publish_over_the_byte_limit(
    amqp: Callable[[], pika.BlockingConnection], conn: Conn, broker: DispatcherThread
) -> None:
    connection = amqp()
    channel = open_channel(connection)
    channel.queue_declare(
        "small", arguments={"x-max-length-bytes": LIMIT, "x-overflow": "reject-publish"}
    )
    channel.queue_declare("plain")
    channel.exchange_declare("both", "fanout")
    channel.queue_bind("small", "both")
    channel.queue_bind("plain", "both")
    channel.basic_publish("", "small", BODIES[0])
    channel.basic_publish("", "small", BODIES[1])
    with pytest.raises(pika.exceptions.NackError):
        channel.basic_publish("", "small", BODIES[2])  # 1200 > 1000
    channel.basic_publish("", "small", b"x" * 200)  # 1000: fits exactly
    with pytest.raises(pika.exceptions.NackError):  # to both: nacked, "plain" has it
        channel.basic_publish("both", "", b"y")
    assert rows(conn, "small") == {"pending": 3}
    assert rows(conn, "plain") == {"pending": 1}
    # without confirms the refused publish is dropped and the channel stays open
    loose = connection.channel()
    loose.basic_publish("", "small", b"z" * 300)
    loose.basic_publish("", "plain", b"after")  # committed after it: the batcher is FIFO
    wait_until(lambda: rows(conn, "plain") == {"pending": 2}, what="the later publish")
    assert rows(conn, "small") == {"pending": 3}
    assert loose.is_open
    await_passes(broker)  # measured: still full
    with pytest.raises(pika.exceptions.NackError):
        channel.basic_publish("", "small", b"w" * 300)
    assert drain(channel, "small") == [BODIES[0], BODIES[1], b"x" * 200]
    await_passes(broker)  # a pass after the queue was drained: room again
    channel.basic_publish("", "small", b"v" * 300)
    channel.basic_publish("", "small", b"u" * 700)
    with pytest.raises(pika.exceptions.NackError):
        channel.basic_publish("", "small", b"t")
    assert rows(conn, "small") == {"pending": 2}
