"""Deliveries: claimed ids to basic.deliver frames, and consumers' outcomes to rows.

The dispatcher's one claim (P-1, P-4) reads ahead for AMQP stages: up to their
consumers' prefetch windows (`consumers.Registry.targets`), claimed when less
than half of that is left, so each claim and each load is a batch. One task
loads what was claimed (one statement for everything claimed meanwhile) into
the stage's `ready` buffer (`readahead.py`); messages leave it for consumers as
their credit allows (`pump.py`), at once when an ack frees credit, without a round
trip. Another task writes what consumers decided, many outcomes per commit
(`settle.py`): an ack deletes the row, a return puts it back to pending at its place
with the redelivered mark, a reject without requeue dead-letters it. Credit is freed
when the client's ack arrives, before its row is written, as in RabbitMQ: if the
write is lost (database down, crash) the message is delivered again: at least once
(SPEC R-6).

Each task has a connection of its own, reconnecting with the usual backoff; until
their rows are written, ids stay in `held()`, so the dispatcher's reset of
orphaned rows after a reconnect leaves them alone. `Deliverer` joins the three parts
on one object (`state.DelivererState`): what they share is its attributes.
"""

from __future__ import annotations

import asyncio

import psycopg

from pepsi.amqp.broker.catalogue import Queue
from pepsi.amqp.broker.consume.fetched import Fetched, fetched_row
from pepsi.amqp.broker.consume.pump import Pump
from pepsi.amqp.broker.consume.readahead import ReadAhead
from pepsi.amqp.broker.consume.settle import Settle
from pepsi.amqp.broker.consume.state import count_between_claims, quorum_queue
from pepsi.db.queries import query


class Deliverer(ReadAhead, Pump, Settle):
    """The claim's ids to consumers, and their outcomes to the rows (see the module doc)."""

    # ---- what the dispatcher asks (and `capacities`, `deliver`: readahead.py) ------------

    def held(self) -> list[int]:
        """Ids this side holds as running: read ahead, delivered, or being written."""
        ids = [d.wid for book in self.books for d in book.unacked.values()]
        ids += [f.wid for ready in self.ready.values() for f in ready]
        ids += [wid for wid, _, _ in self._claimed]
        ids += self._outcomes.ids()
        ids += self._in_fetch
        ids += [wid for wid, _, _ in self._in_fetch_rest]
        ids += self._in_settle
        return ids

    # ---- basic.get ----------------------------------------------------------------------

    async def get(self, queue: Queue) -> tuple[Fetched, int] | None:
        """Claim the queue's oldest ready message: (it, how many stay ready), or None."""
        self.queues[queue.stage] = queue
        await self.flush()
        stage = queue.stage
        ahead = self.take_ready(stage)
        if ahead is not None:  # consumers read ahead: the head of the queue is here
            return ahead, await self._pending(stage) + self.ready_count(stage)
        while True:
            turn = await self.link.between_claims()  # its count, with the read-ahead's
            conn = await self._connection("fetch")
            try:
                async with conn.transaction():
                    cur = await conn.execute(
                        query("amqp_get"), {"stage": queue.stage}, binary=True
                    )  # as amqp_delivery_load: the body as bytes, not hex
                    row = await cur.fetchone()
            except psycopg.OperationalError:
                await self._drop("fetch")
                raise
            if row is None:
                return None
            self.link.changed(stage)  # a pending row taken, not by the dispatcher's claim
            fetched = fetched_row(row, queue.name, quorum_queue(queue))
            if not fetched.expired(self.clock()):
                pending = max(int(row[11]), 0)
                if self.link.claim_turn() != turn:  # a claim ran meanwhile: counted again
                    pending = await self._pending(stage)
                return fetched, pending + self.ready_count(stage)
            self._outcomes.dead.append((queue.stage, fetched.wid, "expired"))
            self._settle_soon()

    async def _pending(self, stage: str) -> int:
        """The stage's pending rows, counted between claims (`count_between_claims`)."""

        async def count() -> int:
            conn = await self._connection("fetch")
            cur = await conn.execute(query("amqp_queue_message_count"), {"stage": stage})
            row = await cur.fetchone()
            return int(row[0]) if row else 0

        return await count_between_claims(self.link, count)

    # ---- tasks --------------------------------------------------------------------------

    def _start(self) -> None:
        if self._tasks or self._closing:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._fetch_loop(), name="amqp deliveries"),
            loop.create_task(self._settle_loop(), name="amqp outcomes"),
        ]

    async def close(self) -> None:
        """Write every outcome still waiting, then stop (the listener has stopped)."""
        self._closing = True
        for stage in list(self.ready):
            self._unready(stage)
        if self._tasks:
            self._fetch_wake.set()
            self._settle_wake.set()
            self._gather_cut.set()  # what waits is written now
            await asyncio.wait(self._tasks, timeout=10)
            for task in self._tasks:
                task.cancel()
        for name in ("fetch", "settle"):
            await self._drop(name)


__all__ = ["Deliverer"]
