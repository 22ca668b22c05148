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
from psycopg.types.json import Jsonb

from pepsi.amqp.broker.consume.state import id_array
from pepsi.db.queries import query
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


def test_the_claims_record_reads_what_the_load_reads(conn: Conn) -> None:
    """pepsi.amqp_claimed_delivery writes out amqp_delivery_load's columns: the two read
    the same row alike (a first delivery, a redelivery with x-death and an expiry, a
    message a pipeline stage sent, one without a body); a row too large for the claim,
    or no longer running, is NULL (loaded as before, or gone)."""
    stage = "amqp:/:q"
    found = conn.execute(
        "INSERT INTO pepsi.workqueue_body (header, body) VALUES (%s, %s) RETURNING body_id",
        (b"\x00\x00", b"hello"),
    ).fetchone()
    assert found is not None
    body_id = found[0]
    rows = [
        ({"exchange": "ex", "routing_key": "rk"}, {}, None, body_id),
        (
            {"exchange": "", "routing_key": "q"},
            {
                "delivery_count": 2,
                "redelivered": True,
                "x_death": [{"queue": "q", "count": 1}],
                "x_first_death": {"queue": "q", "reason": "rejected"},
            },
            "2030-01-01T00:00:00Z",
            body_id,
        ),
        ({"content_type_note": "from a stage"}, {}, None, body_id),
        ({"exchange": "", "routing_key": "q"}, {}, None, None),
    ]
    ids = []
    for props, state, expires, body in rows:
        inserted = conn.execute(
            "INSERT INTO pepsi.workqueue (stage, status, properties, state, expires, body_id,"
            " message_id, content_type) VALUES (%s, 'running', %s, %s, %s, %s, 'm', 't/p')"
            " RETURNING workqueue_id",
            (stage, Jsonb(props), Jsonb(state), expires, body),
        ).fetchone()
        assert inserted is not None
        ids.append(int(inserted[0]))
    loaded = conn.execute(query("amqp_delivery_load"), {"ids": id_array(ids)}, binary=True)
    by_id = {row[0]: tuple(row) for row in loaded.fetchall()}

    def records(for_stages: list[str], max_bytes: int) -> list[Any]:
        cur = conn.execute(
            "SELECT pepsi.amqp_claimed_delivery(i, %s, %s)"
            " FROM unnest(%s::bigint[]) WITH ORDINALITY AS u(i, n) ORDER BY n",
            (for_stages, max_bytes, ids),
            binary=True,
        )
        return [row[0] for row in cur.fetchall()]

    assert records([stage], 1 << 20) == [by_id[wid] for wid in ids]
    # header and body 2 + 5 bytes, past 6; the last row has neither
    assert records([stage], 6) == [None, None, None, by_id[ids[3]]]
    assert records(["amqp:/:other"], 1 << 20) == [None] * 4
    conn.execute("UPDATE pepsi.workqueue SET status = 'pending' WHERE workqueue_id = %s", (ids[0],))
    assert records([stage], 1 << 20)[0] is None
