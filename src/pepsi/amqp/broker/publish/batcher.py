"""The publish batcher: AMQP publishes become rows, many publishes per commit (A-2).

Every `basic.publish` of every channel of every connection is handed to one
`Batcher` as a `Unit` (one publish, or a channel's whole transaction at
tx.commit). One task with its own database connection (application name
`pepsi-amqp-publish`) takes everything submitted since its last commit and
writes it in **one transaction** (synchronous commit), then reports each
unit's outcome and calls `on_committed`: the dispatcher, in the same process,
wakes to claim the new rows (no NOTIFY goes through PostgreSQL for them).
Publishes that arrive while a commit runs form the next one: grouping grows
with load and costs nothing when idle. Without a length
limit in the batch, the transaction is one statement of `pepsi.amqp_publish`
(only the columns a publish fills; one round trip; a column that repeats
one value goes packed, see `pepsi.amqp.broker.publish.arrays`); with one, it is
`pepsi.workqueue_publish`, the function `Publisher` uses, which enforces them
(the arguments of either: `params`).

Queue limits are the publish function's (R-3): the stages of drop-head queues
go with the batch's limit arrays; each reject-publish stage is written under
a savepoint of its own, and if the function refuses it (SQLSTATE PP001),
again one row at a time, so only the publishes that do not fit are refused
(`basic.nack`), as RabbitMQ does, and the rest of the batch commits.

Rows for a queue whose consumers wait for them, with nothing pending, are written
`running` by that statement and handed to the consumers after the commit, before
the confirms (direct delivery: `publish.direct`, `Deliverer.direct_room`).

If the transaction fails (connection lost, commit refused), every unit of it
fails: the broker nacks confirm publishes and closes non-confirm channels'
connections. The connection is then opened again, by `pepsi.db.backoff`. A
connection lost while rows were written running may have committed them: the
dispatcher is told (`on_orphans`), and puts back what no consumer holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Final, Literal

import psycopg

from pepsi.amqp.broker.publish import arrays, direct
from pepsi.amqp.broker.publish.direct import Direct, DirectTarget
from pepsi.amqp.broker.publish.params import LEAN_BODIES, LEAN_SQL, call_params, lean_params, split
from pepsi.amqp.broker.publish.units import Limit, Unit, rows_per_stage
from pepsi.db.backoff import Backoff
from pepsi.db.connect import connect_async
from pepsi.errors import PepsiError, one_line
from pepsi.publishing.batch import SQL as PUBLISH_SQL
from pepsi.publishing.message import Row

log = logging.getLogger("pepsi.amqp")

APPLICATION_NAME: Final = "pepsi-amqp-publish"
REJECTED: Final = "PP001"  # pepsi.workqueue_publish: a reject-publish stage is full
MAX_BATCH_ROWS: Final = 2000  # rows per transaction at most
MAX_BATCH_BYTES: Final = 32 * 1024 * 1024
HIGH_WATER_ROWS: Final = 20_000  # waiting rows over this: publishers wait (TCP back-pressure)
HIGH_WATER_BYTES: Final = 2 * MAX_BATCH_BYTES  # ... or bytes over this (large bodies)


class Batcher:
    """One task, one connection: every publish of the listener, grouped per commit."""

    def __init__(self, dsn: str, connect_timeout: float, backoff: Backoff | None = None) -> None:
        self.dsn = dsn
        self.connect_timeout = connect_timeout
        self.backoff = backoff or Backoff()
        self.commits = 0  # transactions committed (tests, the benchmark)
        self._queue: list[Unit] = []
        self._queued_rows = 0
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._conn: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._delays = self.backoff.delays()
        self._retry_at = 0.0
        # connection.blocked for every client while publishes cannot be written (the
        # database is unreachable) or wait above the high-water mark; None: unblocked
        self.on_blocked: Callable[[str | None], None] = lambda _: None
        # after a commit: the dispatcher's loop (in this process) has new rows to claim,
        # so many in these stages (None: not known how many)
        self.on_committed: Callable[[dict[str, int | None]], None] = lambda rows: None
        self._down = False
        self._blocked: str | None = None
        # direct delivery: rows for waiting consumers written running (None: never)
        self.direct: DirectTarget | None = None
        # after a lost connection while rows were written running (they may be)
        self.on_orphans: Callable[[], None] = lambda: None
        self._routes: dict[str, tuple[str, str] | None] = {}  # properties JSON -> route
        self._direct_paused = 0
        self._direct_idle = asyncio.Event()  # no commit with direct rows under way
        self._direct_idle.set()
        self._submitted = 0  # units submitted ...
        self._reported = 0  # ... and reported, in the same (FIFO) order
        self._barriers: list[tuple[int, asyncio.Future[None]]] = []

    def _tell_blocked(self) -> None:
        reason = (
            "the database is unavailable"
            if self._down
            else "publishes are waiting for the database"
            if not self._room.is_set()
            else None
        )
        if reason != self._blocked:
            self._blocked = reason
            try:
                self.on_blocked(reason)
            except Exception:
                log.exception("amqp: telling clients about back-pressure failed")

    async def flush(self) -> None:
        """Return once every unit submitted so far is committed or refused (a channel's
        methods are ordered: a get after a publish must see the message)."""
        if self._reported >= self._submitted:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._barriers.append((self._submitted, waiter))
        await waiter

    def submit(self, unit: Unit) -> None:
        if self._closing:
            unit.done(unit.items, RuntimeError("the listener is stopping"))
            return
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="amqp publish batcher"
            )
        self._queue.append(unit)
        self._submitted += 1
        self._queued_rows += unit.rows
        self._queued_bytes += unit.size
        if self._room.is_set() and (
            self._queued_rows > HIGH_WATER_ROWS or self._queued_bytes > HIGH_WATER_BYTES
        ):
            self._room.clear()
            self._tell_blocked()
        self._wake.set()

    @contextlib.asynccontextmanager
    async def direct_paused(self, timeout: float) -> AsyncIterator[None]:
        """No rows written running meanwhile, and none under way (waited for at most
        `timeout` seconds, else TimeoutError): the dispatcher puts back the running rows
        nobody holds."""
        self._direct_paused += 1
        try:
            async with asyncio.timeout(timeout):
                await self._direct_idle.wait()
            yield
        finally:
            self._direct_paused -= 1

    async def stop_direct(self) -> None:
        """No more rows written running for consumers; those under way handed over (the
        deliverer closes next, and puts back what it holds)."""
        self._direct_paused += 1
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.connect_timeout):
                await self._direct_idle.wait()

    @property
    def has_room(self) -> bool:
        """False while publishers must wait in `room()` (lets them skip the await)."""
        return self._room.is_set()

    async def room(self) -> None:
        """Return when the queue is under its high-water mark (a publisher waits here)."""
        await self._room.wait()

    async def close(self) -> None:
        """Commit what is queued, then stop."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._drop()

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                await conn.close()

    def _take(self) -> list[Unit]:
        queue = self._queue
        rows = size = count = 0
        for unit in queue:
            if count and (rows + unit.rows > MAX_BATCH_ROWS or size + unit.size > MAX_BATCH_BYTES):
                break
            count += 1
            rows += unit.rows
            size += unit.size
        # one slice, not pop(0) per unit (quadratic in a long queue)
        taken = queue[:count]
        del queue[:count]
        self._queued_rows -= rows
        self._queued_bytes -= size
        if (
            not self._room.is_set()
            and self._queued_rows <= HIGH_WATER_ROWS
            and self._queued_bytes <= HIGH_WATER_BYTES
        ):
            self._room.set()
            self._tell_blocked()
        return taken

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            wait = self._retry_at - loop.time()
            if wait > 0 and not self._closing:
                await asyncio.sleep(wait)
            await self._write(self._take())

    async def _write(self, units: list[Unit]) -> None:
        """Commit `units` together and report; if the database refused the batch itself
        (not a lost connection), each unit again alone, so that one publish the
        database cannot take does not cost the others their confirm."""
        try:
            sent = await self._commit(units)
        except psycopg.Error as error:
            if len(units) > 1 and not isinstance(error, psycopg.OperationalError):
                log.warning("amqp: a publish batch was refused (%s); retrying it unit by unit",
                            one_line(error))  # fmt: skip
                for unit in units:
                    await self._write([unit])
                return
            await self._failed(units, error)
        except (PepsiError, OSError) as error:
            await self._failed(units, error)
        except Exception as error:  # a bug: the publishers are told, the task goes on
            log.exception("amqp: the publish batch failed")
            await self._drop()
            for unit in units:
                self._report(unit, error)
        else:
            self._delays = self.backoff.delays()
            if self._down:
                self._down = False
                self._tell_blocked()
            self.commits += 1
            if sent is not None:
                self._deliver(sent)  # the consumers first: they wait for these rows
            for unit in units:
                self._report(unit, None)
            pending = rows_per_stage(units, None if sent is None else sent.taken)
            if pending:
                try:
                    self.on_committed(pending)
                except Exception:
                    log.exception("amqp: waking the dispatcher after a publish failed")

    def _deliver(self, sent: Direct) -> None:
        """Rows committed running go to their consumers."""
        target = self.direct
        assert target is not None
        try:
            target.release_direct(sent.taken)
            target.deliver_direct(sent.rows, sent.epochs)
        except Exception:  # a bug: the rows are running and held by no one
            log.exception("amqp: handing published rows to their consumers failed")
            self.on_orphans()
        finally:
            self._direct_idle.set()

    async def _failed(self, units: list[Unit], error: BaseException) -> None:
        log.error(
            "amqp: %d publishes not committed: %s", sum(len(u.items) for u in units),
            one_line(error),
        )  # fmt: skip
        if isinstance(error, psycopg.OperationalError | PepsiError | OSError):
            # the connection is gone or going: reconnect, with the backoff's pace
            await self._drop()
            if not self._down:
                self._down = True
                self._tell_blocked()
            self._retry_at = asyncio.get_running_loop().time() + next(self._delays)
        for unit in units:
            self._report(unit, error)

    def _report(self, unit: Unit, error: BaseException | None) -> None:
        try:
            unit.done(unit.items, error)
        except Exception:
            log.exception("amqp: settling a publish failed")
        self._reported += 1
        if self._barriers and self._barriers[0][0] <= self._reported:
            keep = []
            for upto, waiter in self._barriers:
                if upto > self._reported:
                    keep.append((upto, waiter))
                elif not waiter.done():
                    waiter.set_result(None)
            self._barriers = keep

    async def _commit(self, units: list[Unit]) -> Direct | None:
        """Write `units` in one transaction; the rows written running for consumers."""
        items = [item for unit in units for item in unit.items]
        if not any(item.rows for item in items):
            return None  # only unroutable publishes: nothing to write, settled in order
        if self._conn is None or self._conn.closed:
            self._conn = await connect_async(
                self.dsn, application_name=APPLICATION_NAME, timeout=self.connect_timeout
            )
            arrays.register(self._conn)
        conn = self._conn
        free, free_limits, guarded = split(items)
        if not guarded:
            # One statement is its own transaction (the connection is in autocommit): one
            # round trip per batch instead of BEGIN, the call and COMMIT.
            if not free_limits:
                written = await self._write_lean(conn, free)
                if written is not False:
                    return written
            await conn.execute(PUBLISH_SQL, call_params(free, free_limits))
            return None
        async with conn.transaction():
            if free:
                await conn.execute(PUBLISH_SQL, call_params(free, free_limits))
            for stage, pairs in guarded.items():
                limit = {stage: pairs[0][0].limits[stage]}
                if await self._try(conn, [row for _, row in pairs], limit):
                    continue
                for item, row in pairs:  # the stage is full: as much as fits, in order
                    if not await self._try(conn, [row], limit):
                        item.refused = True
        return None

    async def _write_lean(
        self, conn: psycopg.AsyncConnection[tuple[Any, ...]], rows: list[Row]
    ) -> Direct | Literal[False] | None:
        """`rows` by `pepsi.amqp_publish`, those consumers wait for written running (the
        Direct to hand them over after the commit); False when a row needs the general
        function (nothing written)."""
        target = None if self._direct_paused else self.direct
        room = target.direct_room({row.stage for row in rows}) if target is not None else {}
        flags, taken = direct.choose(rows, room, self._routes) if room else ([], {})
        lean = lean_params(rows, flags if taken else None)
        if lean is None:
            return False
        params = arrays.pack_columns(lean, keep=LEAN_BODIES)
        if target is None or not taken:
            await conn.execute(LEAN_SQL, params)
            return None
        epochs = target.reserve_direct(taken)
        self._direct_idle.clear()
        try:
            cur = await conn.execute(LEAN_SQL, params)
            ids = [int(r[0]) for r in await cur.fetchall()]
            chosen = [row for row, flag in zip(rows, flags, strict=True) if flag]
            sent: list[tuple[int, str, tuple[Any, ...]]] = []
            for wid, row in zip(ids, chosen, strict=True):
                exchange, key = direct.route(row.properties, self._routes) or ("", row.stage)
                sent.append((wid, row.stage, direct.delivery(wid, row, exchange, key)))
        except BaseException as error:
            target.release_direct(taken)
            self._direct_idle.set()
            if not isinstance(error, psycopg.Error) or isinstance(error, psycopg.OperationalError):
                self.on_orphans()  # the commit's outcome is not known: rows may be running
            raise
        return Direct(taken, epochs, sent)

    @staticmethod
    async def _try(
        conn: psycopg.AsyncConnection[tuple[Any, ...]], rows: list[Row], limit: dict[str, Limit]
    ) -> bool:
        """Write `rows` under a savepoint; False if the stage's limit refused them."""
        try:
            async with conn.transaction():
                await conn.execute(PUBLISH_SQL, call_params(rows, limit))
        except psycopg.Error as error:
            if error.sqlstate == REJECTED:
                return False
            raise
        return True


__all__ = ["Batcher"]
