"""Settling: consumers' outcomes to their rows, many per commit, and dead letters routed.

The settle task writes what consumers decided (`amqp_settle`): an ack deletes the
row, a return puts it back to pending at its place with the redelivered mark. A
reject without requeue, a quorum queue's delivery limit reached, an expired message
and the expiry passes' rows (`dead_letter`) are dead-lettered (`amqp_dead_letter`):
through the queue's dead-letter exchange, with x-death, or kept as failed without one.
Credit is freed when the client's ack arrives, before its row is written, as in
RabbitMQ: if the write is lost (database down, crash) the message is delivered
again: at least once (SPEC R-6). What was settled is told to the dispatcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import psycopg

from pepsi.amqp.broker.catalogue import Queue
from pepsi.amqp.broker.consume.outcomes import SETTLE_GATHER_SECONDS, Outcomes, worth_gathering
from pepsi.amqp.broker.consume.state import (
    AConn,
    DelivererState,
    id_array,
    quorum_queue,
    subtract,
)
from pepsi.amqp.model.consumers import Delivery
from pepsi.amqp.wire import dead_letters, headers
from pepsi.amqp.wire.properties import decode_properties
from pepsi.db.queries import query
from pepsi.errors import PepsiError, one_line

log = logging.getLogger("pepsi.amqp")

MAX_SETTLE_BATCH = 5000  # outcomes per commit

# A dead letter starts afresh in its new queue: no delivery count, no failure of the old.
_NOT_CARRIED = frozenset({
    "redelivered", "delivery_count", "last_error", "failed_stage", "failure_class",
    "dead_letter_reason",
})  # fmt: skip


class Settle(DelivererState):
    """Outcomes recorded, then written (a part of `delivery.Deliverer`)."""

    # ---- outcomes -----------------------------------------------------------------------

    def ack(self, deliveries: Iterable[Delivery]) -> None:
        self._outcomes.acked += [(d.stage, d.wid) for d in deliveries]
        self._settle_soon()

    def ack_one(self, delivery: Delivery) -> None:
        """`ack` of one delivery (a consumer's basic.ack, one per message)."""
        self._outcomes.acked.append((delivery.stage, delivery.wid))
        self._settle_soon()

    def requeue(self, deliveries: Iterable[Delivery]) -> None:
        """Returned by the consumer (or its channel closed): redelivered later, unless the
        queue's delivery limit is reached, then dead-lettered. The stage's read-ahead goes
        back too, so that the returned message is first again, as in RabbitMQ."""
        stages: set[str] = set()
        for d in deliveries:
            stages.add(d.stage)
            queue = self.queues.get(d.stage)
            limit = queue.arguments.delivery_limit if quorum_queue(queue) and queue else None
            if limit is not None and d.delivery_count + 1 > limit:
                self._outcomes.dead.append((d.stage, d.wid, "delivery_limit"))
            else:
                self._outcomes.returned.append((d.stage, d.wid))
                self._returned(d.stage)
        for stage in stages:
            self._unready(stage)
        self._settle_soon()

    def dead_letter(self, queue: Queue, ids: Iterable[int], reason: str) -> None:
        """Rows of `queue` this side has claimed itself (status running, held by no
        consumer: an expiry sweep's) to dead-letter for `reason` with the next commit."""
        self.queues.setdefault(queue.stage, queue)
        self._outcomes.dead += [(queue.stage, wid, reason) for wid in ids]
        self._settle_soon()

    def reject(self, deliveries: Iterable[Delivery]) -> None:
        self._outcomes.dead += [(d.stage, d.wid, "rejected") for d in deliveries]
        self._settle_soon()

    def unsent(self, stage: str, ids: Iterable[int]) -> None:
        for wid in ids:
            self._outcomes.unsent.append((stage, wid))
            self._returned(stage)
        self._settle_soon()

    def _returned(self, stage: str) -> None:
        self._returning[stage] = self._returning.get(stage, 0) + 1
        self._epoch[stage] = self._epoch.get(stage, 0) + 1

    def _settle_soon(self) -> None:
        self._start()
        self._settle_wake.set()
        if self._gathering and not worth_gathering(
            self._outcomes, awaited=bool(self._barriers), closing=self._closing
        ):
            self._gather_cut.set()  # a return, a reject, a flush or enough acks: write now

    def settles_into(self, stage: str) -> bool:
        """Whether an outcome not written yet may make rows of `stage` pending: a return to
        it, or any dead letter (its queue's dead-letter exchange may route it there).
        Acknowledgements delete rows that are not pending: no count waits for them."""
        return bool(self._returning.get(stage) or self._outcomes.dead or self._dead_in_settle)

    async def flush(self) -> None:
        """Return once every outcome recorded so far is written (a channel's methods are
        ordered: a get after a nack must see the nacked message back)."""
        if not self._outcomes and not self._in_settle:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._barriers.append(waiter)
        self._settle_soon()
        await waiter

    # ---- writing ------------------------------------------------------------------------

    async def _settle_loop(self) -> None:
        delays = self.backoff.delays()
        while True:
            if not self._outcomes:
                waiting, self._barriers = self._barriers, []
                for waiter in waiting:  # nothing left unwritten
                    if not waiter.done():
                        waiter.set_result(None)
                if self._closing and not self._claimed:
                    return
                self._settle_wake.clear()
                await self._settle_wake.wait()
                continue
            if worth_gathering(self._outcomes, awaited=bool(self._barriers), closing=self._closing):
                self._gathering = True
                self._gather_cut.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._gather_cut.wait(), SETTLE_GATHER_SECONDS)
                self._gathering = False
            batch = self._outcomes.take(MAX_SETTLE_BATCH)
            barriers: list[asyncio.Future[None]] = []
            if not self._outcomes:  # everything recorded so far is in this batch
                barriers, self._barriers = self._barriers, []
            self._in_settle = batch.ids()
            self._dead_in_settle = bool(batch.dead)
            try:
                await self._write(batch)
            except (psycopg.Error, PepsiError, OSError) as error:
                log.error(
                    "amqp: could not record %d consumer outcomes: %s", len(batch), one_line(error)
                )
                self._outcomes.put_back(batch)
                self._barriers[:0] = barriers
                await self._drop("settle")
                if self._closing:
                    return  # the next start resets them (they stay running): redelivered
                await asyncio.sleep(next(delays))
                continue
            finally:
                self._in_settle = []
                self._dead_in_settle = False
            delays = self.backoff.delays()
            self._report(batch)
            for waiter in barriers:
                if not waiter.done():
                    waiter.set_result(None)

    async def _write(self, batch: Outcomes) -> None:
        conn = await self._connection("settle")
        settle = batch.acked or batch.returned or batch.unsent
        params = {
            "acked": id_array(w for _, w in batch.acked),
            "returned": id_array(w for _, w in batch.returned),
            "unsent": id_array(w for _, w in batch.unsent),
        }
        if not batch.dead:
            # the common case: one statement, its own transaction (autocommit), one round
            # trip instead of three
            await conn.execute(query("amqp_settle"), params)
            return
        async with conn.transaction():
            if settle:
                await conn.execute(query("amqp_settle"), params)
            await self._dead_letter(conn, batch.dead)

    async def _dead_letter(self, conn: AConn, dead: list[tuple[str, int, str]]) -> None:
        reasons = {wid: reason for _, wid, reason in dead}
        cur = await conn.execute(query("amqp_dead_letter_load"), {"ids": list(reasons)})
        letters = []
        for row in await cur.fetchall():
            letters.append(await self._letter(row, reasons[int(row[0])]))
        if letters:
            await conn.execute(query("amqp_dead_letter"), {"rows": json.dumps(letters)})

    async def _letter(self, row: Sequence[Any], reason: str) -> dict[str, Any]:
        """One row's dead letter (`amqp_dead_letter_load`'s columns): where it goes, its
        new state and properties."""
        wid, stage = int(row[0]), str(row[1])
        properties: dict[str, Any] = row[2] or {}
        state: dict[str, Any] = row[3] or {}
        header: bytes | None = row[4]
        queue = self.queues.get(stage)
        exchange = str(properties.get("exchange", ""))
        routing_key = str(properties.get("routing_key", ""))
        stages: list[str] = []
        ttls: dict[str, int] = {}
        new_properties = properties
        args = queue.arguments if queue is not None else None
        deaths = list(state.get("x_death") or [])
        if not deaths and header is not None:
            with contextlib.suppress(ValueError):
                deaths = dead_letters.deaths_from_header(
                    headers.header_entry(bytes(header), "x-death")
                )
        expiration = None
        if header is not None:
            with contextlib.suppress(ValueError):
                expiration = headers.expiration(bytes(header))
        deaths = dead_letters.record_death(
            deaths,
            queue=queue.name if queue is not None else stage,
            reason=reason,
            exchange=exchange,
            routing_keys=[routing_key],
            now=self.clock(),
            original_expiration=expiration,  # RabbitMQ: the property goes, the entry keeps it
        )
        new_state = {k: v for k, v in state.items() if k not in _NOT_CARRIED}
        new_state["x_death"] = deaths
        new_state.setdefault("x_first_death", {
            "reason": reason, "queue": deaths[0]["queue"], "exchange": exchange,
        })  # fmt: skip
        if args is not None and args.dead_letter_exchange is not None and self.dead_letter_route:
            key = args.dead_letter_routing_key
            keys = [routing_key] if key is None else [key]
            decoded = None
            if header is not None:
                with contextlib.suppress(ValueError):
                    decoded = decode_properties(bytes(header)).headers
            stages, ttls = await self.dead_letter_route(
                stage, args.dead_letter_exchange, keys, decoded
            )
            # RabbitMQ's cycle rule: an automatic dead letter never returns to its own queue
            stages = [s for s in stages if reason == "rejected" or s != stage]
            new_properties = {
                **properties,
                "exchange": args.dead_letter_exchange,
                "routing_key": keys[0],
            }
        return {
            "workqueue_id": wid,
            "stages": stages,
            "ttls": [ttls.get(s) for s in stages],  # each queue's x-message-ttl from now on
            "state": new_state,
            "properties": new_properties,
            "reason": reason,
        }

    def _report(self, batch: Outcomes) -> None:
        for stage, _ in (*batch.returned, *batch.unsent):
            subtract(self._returning, stage, 1)
        for kind, pairs in (("consumed", batch.acked), ("returned", batch.returned),
                            ("returned", batch.unsent)):  # fmt: skip
            by_stage: dict[str, list[int]] = {}
            for stage, wid in pairs:
                by_stage.setdefault(stage, []).append(wid)
            for stage, ids in by_stage.items():
                getattr(self.link, kind)(stage, ids)
        dead: dict[str, list[int]] = {}
        for stage, wid, _ in batch.dead:
            dead.setdefault(stage, []).append(wid)
        for stage, ids in dead.items():
            self.link.consumed(stage, ids)
        if batch.returned or batch.unsent or batch.dead:
            self.link.wake("amqp")  # ready again (here or in a dead-letter queue)


__all__ = ["MAX_SETTLE_BATCH", "Settle"]
