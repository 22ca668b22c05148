"""What the parts of the `Deliverer` share: its state, its connections, the dispatcher's link.

`DelivererState` is the base of the deliverer's three parts (`readahead.ReadAhead`,
`pump.Pump`, `settle.Settle`, joined in `delivery.Deliverer`): it holds everything they
read and write, on the one object, so that the hot consume path is no slower for the
split; the methods one part calls of another are stubs here. Each task has a database
connection of its own (`_connection`), reconnecting with the usual backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

import psycopg

from pepsi.amqp.broker.catalogue import Queue
from pepsi.amqp.broker.consume.fetched import Fetched
from pepsi.amqp.broker.consume.outcomes import Outcomes
from pepsi.amqp.model.arguments import QUORUM
from pepsi.amqp.model.consumers import ChannelBook, Registry
from pepsi.db.backoff import Backoff
from pepsi.db.connect import connect_async
from pepsi.db.queries import query

APPLICATION_NAME = "pepsi-amqp-delivery"
COUNT_TRIES = 3  # a count of pending rows taken again while claims overlap it, at most

AConn = psycopg.AsyncConnection[tuple[Any, ...]]


class DispatchLink(Protocol):
    """What the dispatcher learns from the deliverer (see Dispatcher._serve_amqp)."""

    def wake(self, cause: str) -> None:
        """A claim is due. "credit": consumers have room, and nothing became pending
        (a queue whose last claim found nothing is left out); any other cause: rows
        may have (returned, dead-lettered)."""

    def returned(self, stage: str, ids: list[int]) -> None:
        """Back to pending: the fair-share debit is refunded."""

    def known_pending(self, stage: str) -> int | None:
        """The stage's pending rows for sure, or None: known from the dispatcher's last
        claim and the listener's commits since, with no other news
        (`pepsi.dispatch.policy.known_pending`)."""

    def changed(self, stage: str) -> None:
        """Pending rows of the stage were taken or removed here other than by a claim
        (basic.get, a purge, the queue deleted, expired): its count is not known."""

    def consumed(self, stage: str, ids: list[int]) -> None:
        """Settled for good (acked, dead-lettered, or gone with its queue)."""

    def direct(self, count: int) -> None:
        """Rows a publish wrote running for consumers (direct delivery): claimed too."""

    def claim_turn(self) -> int:
        """Odd while a claim runs (until its AMQP rows are read ahead); each claim adds 2.
        A count of pending rows that no claim overlapped adds up with the read-ahead."""

    async def between_claims(self) -> int:
        """Once no claim runs: the claim turn then (even)."""


class NoDispatch:
    """A listener without a dispatcher (tests): nothing claims, nothing to tell."""

    def wake(self, cause: str) -> None:
        pass

    def returned(self, stage: str, ids: list[int]) -> None:
        pass

    def known_pending(self, stage: str) -> int | None:
        return None

    def changed(self, stage: str) -> None:
        pass

    def consumed(self, stage: str, ids: list[int]) -> None:
        pass

    def direct(self, count: int) -> None:
        pass

    def claim_turn(self) -> int:
        return 0

    async def between_claims(self) -> int:
        return 0


def id_array(ids: Iterable[int]) -> str:
    """A bigint[] literal: psycopg dumps a list element by element in Python, thousands
    of times a second here; one string is cheaper and means the same to `::bigint[]`."""
    return "{" + ",".join(map(str, ids)) + "}"


def subtract(counts: dict[str, int], stage: str, n: int) -> None:
    """`counts[stage]` less `n`; a stage left with none is dropped (the per-stage counts
    of rows loading, reserved or going back hold only stages with some)."""
    left = counts.get(stage, 0) - n
    if left > 0:
        counts[stage] = left
    else:
        counts.pop(stage, None)


async def count_between_claims(link: DispatchLink, count: Callable[[], Awaitable[int]]) -> int:
    """`count()` of a stage's pending rows, taken while no claim runs, and again if one ran
    meanwhile (at most COUNT_TRIES times). The caller adds the read-ahead: a claim that
    ran while it counted may have moved rows it saw pending into the read-ahead, counted
    twice then (a thousand too many, with busy consumers)."""
    found = 0
    for _ in range(COUNT_TRIES):
        turn = await link.between_claims()
        found = await count()
        if link.claim_turn() == turn:
            break
    return found


def quorum_queue(queue: Queue | None) -> bool:
    """Delivery counting and limits are quorum queues' (x-queue-type = quorum)."""
    return queue is not None and queue.arguments.queue_type == QUORUM


class DeadLetterRoute(Protocol):
    """Where the catalogue sends a dead letter: the destination stages (sorted), and the
    x-message-ttl (ms) of those whose queue has one."""

    async def __call__(
        self, stage: str, exchange: str, routing_keys: list[str], headers: dict[str, Any] | None
    ) -> tuple[list[str], dict[str, int]]: ...


class DelivererState:
    """The deliverer's state (see the module doc); `Deliverer` is made with these arguments."""

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
        self.loaded_with_claim = 0  # rows the claim brought loaded: no load of their own
        self.direct_rows = 0  # rows a publish wrote running for consumers: no claim
        self.ready: dict[str, deque[Fetched]] = {}  # stage -> read ahead, not yet sent
        self._ready_bytes: dict[str, int] = {}
        self._claimed: list[tuple[int, str, int]] = []  # (id, stage, epoch) to be loaded
        # Messages going back to pending are written before the stage claims again, and
        # what was claimed before they went back is not sent before them: per stage, the
        # returns not written yet, and a count of returns (a claim's epoch).
        self._returning: dict[str, int] = {}
        self._epoch: dict[str, int] = {}
        # Per stage: rows claimed before this epoch were purged while their load ran.
        self._purged: dict[str, int] = {}
        self._loading: dict[str, int] = {}  # per stage: claimed, not in `ready` yet
        # per stage: rows of a publish being written running for its consumers (direct
        # delivery, publish/direct.py), not committed yet
        self._reserved: dict[str, int] = {}
        self._outcomes = Outcomes()
        self._barriers: list[asyncio.Future[None]] = []  # flush() callers
        self._fetch_wake = asyncio.Event()
        self._settle_wake = asyncio.Event()
        self._gathering = False  # the settle task waits for more acks ...
        self._gather_cut = asyncio.Event()  # ... until this is set or the time is up
        self._fetch_conn: AConn | None = None
        self._settle_conn: AConn | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._in_fetch: list[int] = []  # ids of the load running now
        # ... or, while a load goes out in steps, the claimed rows not loaded yet
        self._in_fetch_rest: list[tuple[int, str, int]] = []
        self._to_pump: set[str] = set()  # stages whose consumers got credit back
        self._pump_scheduled = False
        self._in_settle: list[int] = []  # ids of the commit running now
        self._dead_in_settle = False  # whether it dead-letters some

    def single_active(self, stage: str) -> bool:
        queue = self.queues.get(stage)
        return queue is not None and queue.arguments.single_active_consumer

    # ---- provided by the other parts ----------------------------------------------------

    def pump(self, stage: str) -> None:
        raise NotImplementedError

    def unsent(self, stage: str, ids: Iterable[int]) -> None:
        raise NotImplementedError

    def _unready(self, stage: str) -> None:
        raise NotImplementedError

    def _settle_soon(self) -> None:
        raise NotImplementedError

    def _start(self) -> None:
        raise NotImplementedError

    # ---- the connections ----------------------------------------------------------------

    async def _connection(self, name: str) -> AConn:
        attr = f"_{name}_conn"
        conn: AConn | None = getattr(self, attr)
        if conn is None or conn.closed:
            conn = await connect_async(
                self.dsn, application_name=APPLICATION_NAME, timeout=self.connect_timeout
            )
            await conn.set_autocommit(True)
            if name == "settle":
                # An outcome lost with a crash is a redelivery, which at-least-once
                # allows (the client's ack is never waited for): no fsync per commit.
                await conn.execute(query("amqp_outcomes_async_commit"))
            setattr(self, attr, conn)
        return conn

    async def _drop(self, name: str) -> None:
        attr = f"_{name}_conn"
        conn: AConn | None = getattr(self, attr)
        setattr(self, attr, None)
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                await conn.close()


__all__ = [
    "APPLICATION_NAME",
    "AConn",
    "DeadLetterRoute",
    "DelivererState",
    "DispatchLink",
    "NoDispatch",
    "id_array",
    "quorum_queue",
    "subtract",
]
