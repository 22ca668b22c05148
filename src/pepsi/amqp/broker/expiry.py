"""Expiry for AMQP queues: expired messages are dead-lettered, unused queues deleted.

`Expiry` is a task of the broker with a database connection of its own (application
name `pepsi-amqp-expiry`, reconnecting with the usual backoff). Every
`EXPIRY_INTERVAL` it makes a pass:

- **queue expiry** (`x-expires`, ms): a queue unused for that long is deleted with
  `Broker.delete_queue` (its consumers cancelled, its rows gone). Unused as in
  RabbitMQ: no consumer, no basic.get, no redeclare. Consumers are the deliverer's
  registry, seen at each pass; declares and gets call `touch`. Last use is kept in
  memory only, so the timer starts again when the broker starts (as in RabbitMQ);
  a queue it has not seen used counts from its declaration, or from the start.
- **message expiry** (the `expiration` property, `x-message-ttl`, both in the
  row's `expires`, see `ttl.ttl_expires`): at most `EXPIRY_BATCH` pending rows whose
  expiry has passed, oldest first, are set to running in one statement
  (`amqp_expiry_claim`) and handed to `Deliverer.dead_letter` with reason
  `expired`: routed through the queue's dead-letter exchange with x-death, or kept
  as failed when there is no route (RabbitMQ would drop them). A full batch waits
  for the deliverer to write it, then the next pass follows at once.
- **overflow** (`x-overflow` drop-head, `x-max-length`): the publish function keeps
  the rows it pushed out as failed (reason `overflow`); those of a queue with a
  dead-letter exchange are set to running (`amqp_expiry_claim_overflowed`) and
  dead-lettered the same way, with reason `maxlen`.
- **x-max-length-bytes** (RabbitMQ counts the body octets of the ready messages; here
  the `pending` rows of the queue's stage, read-ahead and unacked ones not counted,
  dead letters that arrived counted). There is no byte counter: each pass reads, for
  each queue with the argument, its newest `BYTES_SCAN` pending rows, newest first,
  with a running sum of their body octets (`amqp_bytes_over`, one statement per
  queue). That is the bound on the work of a pass: a queue deeper than that is
  measured by its newest `BYTES_SCAN` rows only, and older rows behind them that
  fit within the limit are neither counted nor dropped.
  - `drop-head`: the rows past the limit (all pending rows from the newest one
    whose running sum exceeds it down to the oldest, at most `EXPIRY_BATCH`, oldest
    first) are set to running in the same statement and dead-lettered with reason
    `maxlen` (kept as failed without a route). The limit therefore holds within
    about a pass (a second), not at publish: between passes the queue may hold more.
  - `reject-publish`: the broker refuses at publish a message whose body would take
    the queue over the limit (`admit`), by an estimate kept in memory: the bytes the
    last pass measured plus the body bytes admitted since. A pass marks the bytes
    admitted so far, waits for the batcher to commit them, then measures; the
    estimate is exact but for what was consumed since the pass (which makes it err
    towards refusing) and for a deep queue's rows beyond the scan (see above), and
    a queue counts as empty until a pass has measured it.

A pass that fails on the database is retried after the backoff's delay; rows it set
to running and did not hand over are reset to pending by the dispatcher's restart
(they are not in `Deliverer.held()`), and swept again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, Protocol

import psycopg

from pepsi.amqp.broker.catalogue import Queue
from pepsi.amqp.broker.ttl import QueueKey, expired_queues, first_use
from pepsi.amqp.model.queues import QueueDeclaration
from pepsi.amqp.wire.replies import AMQPError
from pepsi.db.backoff import Backoff
from pepsi.db.connect import connect_async
from pepsi.db.queries import query
from pepsi.errors import PepsiError, one_line

if TYPE_CHECKING:
    from pepsi.amqp.broker.consume.delivery import Deliverer
    from pepsi.amqp.broker.publish.batcher import Batcher


class Broker(Protocol):
    """What the expiry pass needs of the broker (`broker.Broker`, which runs it: this
    module does not import it back)."""

    deliverer: Deliverer
    batcher: Batcher

    async def delete_queue(self, vhost: str, name: str) -> int: ...


log = logging.getLogger("pepsi.amqp")

APPLICATION_NAME: Final = "pepsi-amqp-expiry"
EXPIRY_INTERVAL: Final = 1.0  # seconds between passes
EXPIRY_BATCH: Final = 1000  # expired rows handed to the deliverer per pass
BYTES_SCAN: Final = 10_000  # pending rows read per x-max-length-bytes queue per pass
CLOSE_TIMEOUT: Final = 5.0  # seconds a pass may take to finish when the broker closes
EXPIRED: Final = "expired"  # RabbitMQ's dead-letter reasons
MAXLEN: Final = "maxlen"

AConn = psycopg.AsyncConnection[tuple[Any, ...]]


class Expiry:
    """The broker's expiry passes (see the module doc).

    Started at once when made on a running event loop, else by the first `touch`;
    `close` stops it. `passes` counts the passes completed, `expired` the rows handed
    to dead-lettering, `dropped` those over x-max-length-bytes and `deleted` the
    queues deleted (tests wait on them).
    """

    def __init__(
        self,
        broker: Broker,
        dsn: str,
        connect_timeout: float,
        *,
        interval: float = EXPIRY_INTERVAL,
        batch: int = EXPIRY_BATCH,
        bytes_scan: int = BYTES_SCAN,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.broker = broker
        self.dsn = dsn
        self.connect_timeout = connect_timeout
        self.interval = interval
        self.batch = batch
        self.bytes_scan = bytes_scan
        self.backoff = backoff or Backoff()
        self.clock = clock
        self.started = clock()
        self.passes = 0
        self.expired = 0
        self.deleted = 0
        self.dropped = 0  # rows over x-max-length-bytes handed to dead-lettering
        # x-max-length-bytes with reject-publish, per stage: the pending body bytes the
        # last pass measured, and the body bytes admitted since (see `admit`)
        self.measured: dict[str, int] = {}
        self.admitted: dict[str, int] = {}
        self.last_use: dict[QueueKey, float] = {}
        self._queues: dict[QueueKey, Queue] = {}  # parsed once per declaration
        self._conn: AConn | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._closing = False
        with contextlib.suppress(RuntimeError):  # no running loop: the first touch starts it
            asyncio.get_running_loop()
            self.start()

    # ---- what the broker tells it ----------------------------------------------------

    def touch(self, vhost: str, name: str) -> None:
        """The queue was used now (declared, redeclared, or read with basic.get)."""
        self.last_use[(vhost, name)] = self.clock()
        self.start()

    def admit(self, stage: str, max_bytes: int, size: int) -> bool:
        """A publish of a `size`-octet body to a reject-publish queue with x-max-length-bytes
        `max_bytes`: whether it fits by the estimate (counted in it if so)."""
        admitted = self.admitted.get(stage, 0)
        if self.measured.get(stage, 0) + admitted + size > max_bytes:
            return False
        self.admitted[stage] = admitted + size
        return True

    def start(self) -> None:
        """Run the passes (on the running loop) unless they run already or it closed."""
        if self._task is not None or self._closing:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="amqp expiry")

    async def close(self) -> None:
        """Stop after the pass under way (the listener has stopped)."""
        self._closing = True
        self._stop.set()
        task, self._task = self._task, None
        if task is not None:
            _, pending = await asyncio.wait([task], timeout=CLOSE_TIMEOUT)
            for late in pending:
                late.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await late
        await self._drop()

    # ---- the passes ------------------------------------------------------------------

    async def _run(self) -> None:
        delays = self.backoff.delays()
        while not self._closing:
            try:
                full = await self.sweep()
            except (psycopg.Error, PepsiError, OSError) as error:
                log.error("amqp: the expiry pass failed: %s", one_line(error))
                await self._drop()
                wait = next(delays)
            except Exception:
                log.exception("amqp: the expiry pass failed; continuing")
                wait = self.interval
            else:
                delays = self.backoff.delays()
                if full:  # more are due: after the deliverer has written these
                    await self.broker.deliverer.flush()
                    wait = 0.0
                else:
                    wait = self.interval
            if wait and not self._closing:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), wait)

    async def sweep(self) -> bool:
        """One pass; whether the expired rows filled its batch (more may be due)."""
        conn = await self._connection()
        cur = await conn.execute(query("amqp_expiry_queues"))
        found = await cur.fetchall()
        now = self.clock()
        queues = self._read(found, now)
        gone = await self._delete_unused(queues, now)
        stages = {q.stage: q for q in queues if (q.declaration.vhost, q.name) not in gone}
        full = False
        if stages:
            cur = await conn.execute(
                query("amqp_expiry_claim"), {"stages": list(stages), "max_rows": self.batch}
            )
            claimed = await cur.fetchall()
            by_stage: dict[str, list[int]] = {}
            for wid, stage in claimed:
                by_stage.setdefault(str(stage), []).append(int(wid))
            deliverer = self.broker.deliverer
            for stage, ids in by_stage.items():  # at once: running, and held by nobody yet
                deliverer.link.changed(stage)  # pending rows taken: a count known is not
                deliverer.dead_letter(stages[stage], ids, EXPIRED)
            self.expired += len(claimed)
            full = len(claimed) >= self.batch
        full = await self._overflowed(conn, stages) or full
        full = await self._over_bytes(conn, stages) or full
        self.passes += 1
        return full

    async def _overflowed(self, conn: AConn, stages: Mapping[str, Queue]) -> bool:
        """x-overflow drop-head pushed the oldest rows out (the publish function keeps them
        as failed, reason overflow): through the queue's dead-letter exchange, if it has one."""
        routed = {s: q for s, q in stages.items() if q.arguments.dead_letter_exchange is not None}
        if not routed:
            return False
        cur = await conn.execute(
            query("amqp_expiry_claim_overflowed"),
            {"stages": list(routed), "max_rows": self.batch},
        )
        claimed = await cur.fetchall()
        by_stage: dict[str, list[int]] = {}
        for wid, stage in claimed:
            by_stage.setdefault(str(stage), []).append(int(wid))
        for stage, ids in by_stage.items():
            self.broker.deliverer.dead_letter(routed[stage], ids, MAXLEN)
        return len(claimed) >= self.batch

    async def _over_bytes(self, conn: AConn, stages: Mapping[str, Queue]) -> bool:
        """x-max-length-bytes (see the module doc): drop-head queues lose their oldest rows
        past the limit (reason maxlen); reject-publish queues are measured for `admit`."""
        limited = {s: q for s, q in stages.items() if q.arguments.max_length_bytes is not None}
        rejecting = {s for s, q in limited.items() if q.arguments.effective_overflow != "drop-head"}
        # The mark: what was admitted so far joins the last measure until this pass's
        # replaces it, once the batcher has committed it (what is admitted from now on
        # stays in `admitted`: counted twice if committed before the measure, never less).
        marked, self.admitted = self.admitted, {}
        self.measured = {s: self.measured.get(s, 0) + marked.get(s, 0) for s in rejecting}
        if rejecting:
            await self.broker.batcher.flush()
        full = False
        for stage, queue in limited.items():
            drop = stage not in rejecting
            cur = await conn.execute(
                query("amqp_bytes_over"),
                {
                    "stage": stage,
                    "max_bytes": queue.arguments.max_length_bytes,
                    "max_scan": self.bytes_scan,
                    "max_rows": self.batch,
                    "drop": drop,
                },
            )
            found = await cur.fetchone()
            assert found is not None
            _, octets, claimed = found
            if not drop:
                self.measured[stage] = int(octets)
            elif claimed:
                ids = [int(wid) for wid in claimed]
                self.broker.deliverer.link.changed(stage)
                self.broker.deliverer.dead_letter(queue, ids, MAXLEN)
                self.dropped += len(ids)
                full = full or len(ids) >= self.batch
        return full

    def _read(self, found: Iterable[tuple[Any, ...]], now: float) -> list[Queue]:
        """The queues as read (`amqp_expiry_queues`); their last use, where not known, from
        their declaration; what is known of queues that are gone, forgotten."""
        queues: dict[QueueKey, Queue] = {}
        ages: dict[QueueKey, int] = {}
        for vhost, name, stage, durable, exclusive, auto_delete, arguments, age in found:
            key = (str(vhost), str(name))
            declaration = QueueDeclaration(
                key[1], key[0], bool(durable), bool(exclusive), bool(auto_delete), arguments or {}
            )
            queue = self._queues.get(key)
            if queue is None or queue.declaration != declaration or queue.stage != stage:
                queue = Queue(declaration, str(stage))
            queues[key] = queue
            ages[key] = int(age or 0)
        self._queues = queues
        for key in [k for k in self.last_use if k not in queues]:
            del self.last_use[key]  # deleted (a touch of a queue not committed yet: its age)
        registry = self.broker.deliverer.registry
        for key, queue in queues.items():
            if queue.arguments.expires is None:
                continue
            if registry.count(queue.stage):
                self.last_use[key] = now  # consumed: in use
            elif key not in self.last_use:
                self.last_use[key] = first_use(self.started, now, ages[key])
        return list(queues.values())

    async def _delete_unused(self, queues: list[Queue], now: float) -> set[QueueKey]:
        """Delete the queues unused for their x-expires; the ones deleted."""
        gone: set[QueueKey] = set()
        registry = self.broker.deliverer.registry
        for queue in expired_queues(queues, self.last_use, now):
            key = (queue.declaration.vhost, queue.name)
            # deletes await: a queue may have been used meanwhile
            if registry.count(queue.stage) or not expired_queues(
                [queue], self.last_use, self.clock()
            ):
                continue
            try:
                count = await self.broker.delete_queue(*key)
            except AMQPError:
                log.warning("amqp: could not delete expired queue %r in %r", key[1], key[0])
                continue
            log.info(
                "amqp: deleted queue %r in %r, unused for %d ms (x-expires, %d messages)",
                key[1], key[0], queue.arguments.expires, count,
            )  # fmt: skip
            self.last_use.pop(key, None)
            gone.add(key)
            self.deleted += 1
        return gone

    # ---- the connection ----------------------------------------------------------------

    async def _connection(self) -> AConn:
        if self._conn is None or self._conn.closed:
            self._conn = await connect_async(
                self.dsn, application_name=APPLICATION_NAME, timeout=self.connect_timeout
            )
            await self._conn.set_autocommit(True)
        return self._conn

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                await conn.close()


__all__ = [
    "BYTES_SCAN",
    "EXPIRY_BATCH",
    "EXPIRY_INTERVAL",
    "Expiry",
]
