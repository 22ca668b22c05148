"""The AMQP deliverer's outcome writes (pepsi.amqp.broker.consume.settle): acks alone wait a moment
for more, anything else ends that wait. Against the test database, without a listener."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from pepsi.amqp.broker.consume.delivery import Deliverer
from pepsi.amqp.model.consumers import Delivery

STAGE = "amqp:/:q"


def running_rows(conn: psycopg.Connection[Any], n: int) -> list[int]:
    rows = conn.execute(
        "INSERT INTO pepsi.workqueue (stage, status, sender_key)"
        " SELECT %s, 'running', 'user:t' FROM generate_series(1, %s) RETURNING workqueue_id",
        (STAGE, n),
    ).fetchall()
    return sorted(int(r[0]) for r in rows)


def test_a_return_ends_the_wait_of_acks_gathering_for_more(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    acked, returned = running_rows(conn, 2)

    async def run() -> bool:
        deliverer = Deliverer(dsn, 5.0)
        try:
            deliverer.ack([Delivery(acked, STAGE, "c", 0)])

            async def gathering() -> None:  # the settle task waits for more acks
                while not deliverer._gathering:
                    await asyncio.sleep(0)

            await asyncio.wait_for(gathering(), 10)
            cut_by_ack = deliverer._gather_cut.is_set()
            deliverer.requeue([Delivery(returned, STAGE, "c", 0)])  # goes at once
            cut = deliverer._gather_cut.is_set()
            await deliverer.flush()
            return cut and not cut_by_ack
        finally:
            await deliverer.close()

    assert asyncio.run(run())
    rows = conn.execute(
        "SELECT workqueue_id, status, state ->> 'redelivered' FROM pepsi.workqueue"
    ).fetchall()
    assert rows == [(returned, "pending", "true")]  # the ack deleted its row
