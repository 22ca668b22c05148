"""Deliveries: claimed ids to basic.deliver frames, and consumers' outcomes to rows.

The dispatcher's one claim (P-1, P-4) takes ids for AMQP stages within the
credit `consumers.Registry` reports and hands them here (`Deliverer.deliver`).
One task fetches their properties and bodies (one statement for everything
claimed meanwhile) and sends them; another writes what consumers decided,
many outcomes per commit (`amqp_settle`): an ack deletes the row, a return
puts it back to pending at its place with the redelivered mark, a reject
without requeue dead-letters it (`amqp_dead_letter`). Credit is freed when the
client's ack arrives, before its row is written, as in RabbitMQ: the write
follows in the next commit, and if it is lost (database down, crash) the
message is delivered again: at least once (SPEC R-6).

Each connection of its own, reconnecting with the usual backoff; until the
rows are written their ids stay in `held()`, so the dispatcher's reset of
orphaned rows after a reconnect leaves them alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import psycopg

from pepsi.amqp import framing, headers
from pepsi.amqp.arguments import QUORUM
from pepsi.amqp.catalogue import Queue
from pepsi.amqp.consumers import Assignment, ChannelBook, Consumer, Delivery, Registry
from pepsi.db.backoff import Backoff
from pepsi.db.connect import connect_async
from pepsi.db.queries import query
from pepsi.errors import PepsiError, one_line

log = logging.getLogger("pepsi.amqp")

APPLICATION_NAME = "pepsi-amqp-delivery"
EMPTY_PROPERTIES = b"\x00\x00"  # a row without a stored content header: no properties
MAX_SETTLE_BATCH = 5000  # outcomes per commit

AConn = psycopg.AsyncConnection[tuple[Any, ...]]


class DispatchLink(Protocol):
    """What the dispatcher learns from the deliverer (see Dispatcher._serve_amqp)."""

    def wake(self, cause: str) -> None: ...

    def returned(self, stage: str, ids: list[int]) -> None:
        """Back to pending: the fair-share debit is refunded."""

    def consumed(self, stage: str, ids: list[int]) -> None:
        """Settled for good (acked, dead-lettered, or gone with its queue)."""


class NoDispatch:
    """A listener without a dispatcher (tests): nothing claims, nothing to tell."""

    def wake(self, cause: str) -> None:
        pass

    def returned(self, stage: str, ids: list[int]) -> None:
        pass

    def consumed(self, stage: str, ids: list[int]) -> None:
        pass


class Sender(Protocol):
    """The channel side of a delivery (BrokerChannel)."""

    open: bool

    def send_delivery(self, consumer: Consumer, tag: int, fetched: Fetched) -> None: ...


class Fetched(NamedTuple):
    """A row as basic.deliver and basic.get-ok need it."""

    wid: int
    exchange: str
    routing_key: str
    redelivered: bool
    delivery_count: int
    expired: bool
    raw_properties: bytes
    body: bytes


def fetched_row(row: Sequence[Any], queue_name: str, quorum: bool = True) -> Fetched:
    """`amqp_delivery_load`'s columns (id, properties, state, expired, header, body);
    `quorum`: the queue counts deliveries in `x-delivery-count` (classic ones do not)."""
    wid, properties, state, expired, header, body = row[:6]
    properties = properties or {}
    state = state or {}
    count = int(state.get("delivery_count", 0) or 0)
    raw = bytes(header) if header is not None else EMPTY_PROPERTIES
    deaths = state.get("x_death")
    if (count and quorum) or deaths:
        entries: dict[str, object] = {}
        if count and quorum:
            entries["x-delivery-count"] = count
        if deaths:
            entries.update(headers.death_headers(deaths, state.get("x_first_death")))
        raw = headers.set_headers(raw, entries)
    return Fetched(
        int(wid),
        str(properties.get("exchange", "")),
        str(properties.get("routing_key", queue_name)),
        bool(state.get("redelivered")) or count > 0,
        count,
        bool(expired),
        raw,
        bytes(body) if body is not None else b"",
    )


def _quorum(queue: Queue | None) -> bool:
    """Delivery counting and limits are quorum queues' (x-queue-type = quorum)."""
    return queue is not None and queue.arguments.queue_type == QUORUM


@dataclass
class Outcomes:
    """Outcomes waiting for their commit, by kind; ids with their stage."""

    acked: list[tuple[str, int]] = field(default_factory=list)
    returned: list[tuple[str, int]] = field(default_factory=list)
    unsent: list[tuple[str, int]] = field(default_factory=list)
    dead: list[tuple[str, int, str]] = field(default_factory=list)  # (stage, id, reason)

    def __len__(self) -> int:
        return len(self.acked) + len(self.returned) + len(self.unsent) + len(self.dead)

    def ids(self) -> list[int]:
        return [
            *(w for _, w in self.acked),
            *(w for _, w in self.returned),
            *(w for _, w in self.unsent),
            *(w for _, w, _ in self.dead),
        ]

    def take(self, limit: int) -> Outcomes:
        taken = Outcomes()
        room = limit
        for name in ("acked", "returned", "unsent", "dead"):
            mine: list[Any] = getattr(self, name)
            part, rest = mine[:room], mine[room:]
            setattr(taken, name, part)
            setattr(self, name, rest)
            room -= len(part)
        return taken

    def put_back(self, other: Outcomes) -> None:
        self.acked[:0] = other.acked
        self.returned[:0] = other.returned
        self.unsent[:0] = other.unsent
        self.dead[:0] = other.dead


class DeadLetterRoute(Protocol):
    """Where the catalogue sends a dead letter: the destination stages (sorted)."""

    async def __call__(
        self, stage: str, exchange: str, routing_keys: list[str], headers: dict[str, Any] | None
    ) -> tuple[list[str], str | None]: ...


class Deliverer:
    """The claim's ids to consumers, and their outcomes to the rows (see the module doc)."""

    def __init__(
        self,
        dsn: str,
        connect_timeout: float,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.dsn = dsn
        self.connect_timeout = connect_timeout
        self.backoff = backoff or Backoff()
        self.clock = clock
        self.registry = Registry()
        self.link: DispatchLink = NoDispatch()
        self.queues: dict[str, Queue] = {}  # stage -> its queue, for those consumed or got
        self.books: set[ChannelBook] = set()  # every open channel's book
        self.dead_letter_route: DeadLetterRoute | None = None
        self.delivered = 0  # messages sent (tests, the benchmark)
        self._jobs: list[Assignment] = []
        self._outcomes = Outcomes()
        self._fetch_wake = asyncio.Event()
        self._settle_wake = asyncio.Event()
        self._fetch_conn: AConn | None = None
        self._settle_conn: AConn | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._in_fetch: list[int] = []  # ids of the fetch running now
        self._in_settle: list[int] = []  # ids of the commit running now

    # ---- what the dispatcher asks -------------------------------------------------------

    def single_active(self, stage: str) -> bool:
        queue = self.queues.get(stage)
        return queue is not None and queue.arguments.single_active_consumer

    def capacities(self) -> dict[str, int]:
        """Ids each consumed stage can take now (P-6, for the one claim)."""
        if self._closing:
            return {}
        return self.registry.capacities(self.single_active)

    def deliver(self, rows: Iterable[tuple[int, str]]) -> None:
        """Claimed (id, stage) rows: to their consumers, round robin within credit."""
        by_stage: dict[str, list[int]] = {}
        for wid, stage in rows:
            by_stage.setdefault(stage, []).append(wid)
        for stage, ids in by_stage.items():
            plan, leftover = self.registry.assign(stage, ids, self.single_active(stage))
            self._jobs.extend(plan)
            if leftover:  # credit shrank while the claim ran (a consumer went away)
                self.unsent(stage, leftover)
        if self._jobs:
            self._start()
            self._fetch_wake.set()

    def held(self) -> list[int]:
        """Ids this side holds as running: delivered, being fetched, or being written."""
        ids = [d.wid for book in self.books for d in book.unacked.values()]
        ids += [wid for job in self._jobs for wid in job.ids]
        ids += self._outcomes.ids()
        ids += self._in_fetch
        ids += self._in_settle
        return ids

    # ---- outcomes -----------------------------------------------------------------------

    def ack(self, deliveries: Iterable[Delivery]) -> None:
        self._outcomes.acked += [(d.stage, d.wid) for d in deliveries]
        self._settle_soon()

    def requeue(self, deliveries: Iterable[Delivery]) -> None:
        """Returned by the consumer (or its channel closed): redelivered later, unless the
        queue's delivery limit is reached, then dead-lettered."""
        for d in deliveries:
            queue = self.queues.get(d.stage)
            limit = queue.arguments.delivery_limit if _quorum(queue) and queue else None
            if limit is not None and d.delivery_count + 1 > limit:
                self._outcomes.dead.append((d.stage, d.wid, "delivery_limit"))
            else:
                self._outcomes.returned.append((d.stage, d.wid))
        self._settle_soon()

    def reject(self, deliveries: Iterable[Delivery]) -> None:
        self._outcomes.dead += [(d.stage, d.wid, "rejected") for d in deliveries]
        self._settle_soon()

    def unsent(self, stage: str, ids: Iterable[int]) -> None:
        self._outcomes.unsent += [(stage, wid) for wid in ids]
        self._settle_soon()

    def _settle_soon(self) -> None:
        self._start()
        self._settle_wake.set()
        self.link.wake("amqp")  # credit was freed

    # ---- basic.get ----------------------------------------------------------------------

    async def get(self, queue: Queue) -> tuple[Fetched, int] | None:
        """Claim the queue's oldest ready message: (it, how many stay ready), or None."""
        self.queues[queue.stage] = queue
        while True:
            conn = await self._connection("fetch")
            try:
                async with conn.transaction():
                    cur = await conn.execute(query("amqp_get"), {"stage": queue.stage})
                    row = await cur.fetchone()
            except psycopg.OperationalError:
                await self._drop("fetch")
                raise
            if row is None:
                return None
            fetched = fetched_row(row, queue.name, _quorum(queue))
            if not fetched.expired:
                return fetched, max(int(row[6]), 0)
            self._outcomes.dead.append((queue.stage, fetched.wid, "expired"))
            self._settle_soon()

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
        for job in self._jobs:  # claimed, never sent: back to pending
            self._release(job)
            self.unsent(job.consumer.stage, job.ids)
        self._jobs = []
        if self._tasks:
            self._fetch_wake.set()
            self._settle_wake.set()
            await asyncio.wait(self._tasks, timeout=10)
            for task in self._tasks:
                task.cancel()
        for name in ("fetch", "settle"):
            await self._drop(name)

    async def _connection(self, name: str) -> AConn:
        attr = f"_{name}_conn"
        conn: AConn | None = getattr(self, attr)
        if conn is None or conn.closed:
            conn = await connect_async(
                self.dsn, application_name=APPLICATION_NAME, timeout=self.connect_timeout
            )
            await conn.set_autocommit(True)
            setattr(self, attr, conn)
        return conn

    async def _drop(self, name: str) -> None:
        attr = f"_{name}_conn"
        conn: AConn | None = getattr(self, attr)
        setattr(self, attr, None)
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                await conn.close()

    @staticmethod
    def _release(job: Assignment) -> None:
        consumer = job.consumer
        consumer.reserved -= len(job.ids)
        consumer.book.reserved -= len(job.ids)

    async def _fetch_loop(self) -> None:
        delays = self.backoff.delays()
        while True:
            if not self._jobs:
                if self._closing:
                    return
                self._fetch_wake.clear()
                await self._fetch_wake.wait()
                continue
            jobs, self._jobs = self._jobs, []
            ids = [wid for job in jobs for wid in job.ids]
            self._in_fetch = ids
            try:
                conn = await self._connection("fetch")
                cur = await conn.execute(query("amqp_delivery_load"), {"ids": ids})
                rows = {int(row[0]): row for row in await cur.fetchall()}
            except (psycopg.Error, PepsiError, OSError) as error:
                log.error("amqp: could not load %d deliveries: %s", len(ids), one_line(error))
                await self._drop("fetch")
                for job in jobs:  # back to pending when the database is back
                    self._release(job)
                    self.unsent(job.consumer.stage, job.ids)
                self._in_fetch = []
                await asyncio.sleep(next(delays))
                continue
            delays = self.backoff.delays()
            try:
                for job in jobs:
                    self._send(job, rows)
            finally:
                self._in_fetch = []

    def _send(self, job: Assignment, rows: Mapping[int, Sequence[Any]]) -> None:
        self._release(job)
        consumer = job.consumer
        book = consumer.book
        sender: Sender | None = book.owner  # type: ignore[assignment]
        stage = consumer.stage
        gone: list[int] = []
        acked: list[tuple[str, int]] = []
        for wid in job.ids:
            row = rows.get(wid)
            if row is None:  # purged or deleted with its queue meanwhile
                gone.append(wid)
                continue
            if consumer.cancelled or sender is None or not sender.open:
                self._outcomes.unsent.append((stage, wid))
                continue
            fetched = fetched_row(row, consumer.queue, _quorum(self.queues.get(stage)))
            if fetched.expired:  # RabbitMQ never delivers an expired message
                self._outcomes.dead.append((stage, wid, "expired"))
                continue
            tag = book.new_tag()
            delivery = Delivery(wid, stage, consumer.tag, fetched.delivery_count)
            sender.send_delivery(consumer, tag, fetched)
            self.delivered += 1
            if consumer.no_ack:
                acked.append((stage, wid))
            else:
                book.delivered(tag, delivery)
        if gone:
            self.link.consumed(stage, gone)
        if acked:
            self._outcomes.acked += acked
        if acked or len(self._outcomes):
            self._settle_soon()

    async def _settle_loop(self) -> None:
        delays = self.backoff.delays()
        while True:
            if not self._outcomes:
                if self._closing and not self._jobs:
                    return
                self._settle_wake.clear()
                await self._settle_wake.wait()
                continue
            batch = self._outcomes.take(MAX_SETTLE_BATCH)
            self._in_settle = batch.ids()
            try:
                await self._write(batch)
            except (psycopg.Error, PepsiError, OSError) as error:
                log.error(
                    "amqp: could not record %d consumer outcomes: %s", len(batch), one_line(error)
                )
                self._outcomes.put_back(batch)
                await self._drop("settle")
                if self._closing:
                    return  # the next start resets them (they stay running): redelivered
                await asyncio.sleep(next(delays))
                continue
            finally:
                self._in_settle = []
            delays = self.backoff.delays()
            self._report(batch)

    async def _write(self, batch: Outcomes) -> None:
        conn = await self._connection("settle")
        async with conn.transaction():
            if batch.acked or batch.returned or batch.unsent:
                await conn.execute(
                    query("amqp_settle"),
                    {
                        "acked": [w for _, w in batch.acked],
                        "returned": [w for _, w in batch.returned],
                        "unsent": [w for _, w in batch.unsent],
                    },
                )
            if batch.dead:
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
        new_properties = properties
        args = queue.arguments if queue is not None else None
        deaths = list(state.get("x_death") or [])
        if not deaths and header is not None:
            with contextlib.suppress(ValueError):
                deaths = headers.deaths_from_header(headers.header_entry(bytes(header), "x-death"))
        deaths = headers.record_death(
            deaths,
            queue=queue.name if queue is not None else stage,
            reason=reason,
            exchange=exchange,
            routing_keys=[routing_key],
            now=self.clock(),
        )
        new_state = {k: v for k, v in state.items() if k not in ("redelivered", "delivery_count")}
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
                    decoded = framing.decode_properties(bytes(header)).headers
            stages, _ = await self.dead_letter_route(
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
            "state": new_state,
            "properties": new_properties,
            "reason": reason,
        }

    def _report(self, batch: Outcomes) -> None:
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


__all__ = ["Deliverer", "DispatchLink", "Fetched", "NoDispatch", "fetched_row"]
