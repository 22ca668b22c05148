"""The dispatcher's loop: wake, let each service do what is due, claim once, feed.

Wakeups (P-3): a NOTIFY on `workqueue` (payload ignored; a burst is one
wakeup), a worker answering or dying, the POLL_INTERVAL heartbeat, the
listener (re)connecting, the earliest paused row falling due. Each wakeup
first applies what happened meanwhile (the supervisor tends its pools, the
row writer flushes requeues, strikes and pauses, the sweeper resumes due
rows), then runs ONE claim statement for all stages with free capacity
(P-4), and hands the claimed ids to the stages' pools (P-6). The services
are in their own modules; docs/architecture.md draws them. The listeners
it serves besides (metrics, AMQP, the web console) are in `endpoints`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import psycopg

from pepsi.amqp.broker.broker import Broker as AmqpBroker
from pepsi.amqp.session import server as amqp_server
from pepsi.config import Config
from pepsi.dispatch.endpoints import Endpoints
from pepsi.dispatch.ledger import Claimed, InFlight
from pepsi.dispatch.policy import decisions, fairness
from pepsi.dispatch.policy.known_pending import KnownPending
from pepsi.dispatch.pools.pool import PoolOptions
from pepsi.dispatch.pools.supervisor import PoolSupervisor
from pepsi.dispatch.rows import RowWriter
from pepsi.dispatch.services import reload
from pepsi.dispatch.services.claimer import Claimer
from pepsi.dispatch.services.flusher import StatsFlusher
from pepsi.dispatch.services.listener import Listener
from pepsi.dispatch.services.live import LivePublisher
from pepsi.dispatch.services.sweeper import Sweeper, SweepOptions
from pepsi.dispatch.services.vacuum import Vacuum
from pepsi.dispatch.session import Session, SessionOptions, StopRequested
from pepsi.dispatch.stats import Stats
from pepsi.durations import format_seconds
from pepsi.errors import (
    EX_CONFIG,
    EX_OK,
    AlreadyRunning,
    ConfigError,
    PepsiError,
    is_reconnect,
    one_line,
)

__all__ = ["AlreadyRunning", "Dispatcher"]

log = logging.getLogger("pepsi.dispatch")
AConn = psycopg.AsyncConnection[tuple[Any, ...]]

BUG_PAUSE = 1.0  # seconds the loop rests after an unexpected error in a cycle
AMQP_STAGE_PREFIX = "amqp:"  # an AMQP queue's stage (pepsi.amqp_queue_stage)


class Dispatcher(Endpoints):
    def __init__(
        self, config: Config, dsn: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.dsn = dsn
        self.clock = clock
        self.wake_event = asyncio.Event()
        self.wake_causes: set[str] = set()  # since the loop last slept (P-9)
        self.stopping = False
        self.exit_code = EX_OK
        self.reload_requested = False  # P-10: config_changed or SIGHUP
        self.reload_at = 0.0  # a failed overlay read is retried from then
        self.retire_requested = False  # P-11: telemetry_changed
        self.started_at = datetime.now(UTC)
        options = config.dispatch
        self.stats = Stats()
        fair = (
            fairness.FairShare(options.fair_half_life, options.fair_fifo_percent, clock)
            if options.fair_scheduling
            else None
        )
        self.rows = RowWriter(options)
        self.ledger = InFlight(self.rows, self.stats, fair, clock)
        session_options = SessionOptions.from_config(config, dsn)
        self.session = Session(session_options, lambda: self.stopping, clock)
        self.listener = Listener(session_options, self.wake, self.on_channel)
        self.claimer = Claimer(fair, synchronous=config.postgres.worker_synchronous_commit)
        self.known = KnownPending()  # what each stage holds pending, where known (P-4, A-1)
        self.claim_turns = 0  # odd while a claim runs: see _AmqpLink.claim_turn
        self.orphans_due = False  # running rows may be held by no one: reset them
        self.no_claim = asyncio.Event()  # set while no claim runs
        self.no_claim.set()
        self.sweeper = Sweeper(SweepOptions.from_config(config), self.stats, clock)
        self.flusher = StatsFlusher(self.stats, options.stats_interval, self.started_at, clock)
        # the live snapshot (NOTIFY pepsi_live): the metrics endpoint's numbers, every second
        self.live = LivePublisher(
            self._metrics_snapshot, clock, poll_interval=options.poll_interval
        )
        self.supervisor = PoolSupervisor(
            config,
            PoolOptions.from_config(config, dsn),
            self.ledger,
            self.stats,
            wake=self.wake,
            clock=clock,
        )
        self.vacuum = Vacuum(dsn, options.vacuum_after, config.postgres.connect_timeout)
        self.amqp: amqp_server.Server | None = None  # [pepsi-amqp] LISTEN; set_blocked hook
        self.amqp_broker: AmqpBroker | None = None
        self.web: Any = None  # the web console ([pepsi-web] LISTEN), when served here

    # ---- start and stop ---------------------------------------------------

    async def serve(self, *, signals: bool = True) -> int:
        """Run until stopped; `signals=False` (a dispatcher in a test's thread) leaves the
        process's signal handlers alone: stop it with `request_stop`."""
        loop = asyncio.get_running_loop()
        if signals:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, self.request_stop)
            loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        try:
            await self.session.open()
        except StopRequested:
            return EX_OK
        metrics = None
        try:
            await self.session.start_checks(list(self.supervisor.pools))
            metrics = self._serve_metrics()
            self.amqp = await self._serve_amqp()
            self.web = await self._serve_web()
            listener = loop.create_task(self.listener.run())
            try:
                await self._run()
            finally:
                listener.cancel()
                await self._shutdown()
                await self.vacuum.close()
        finally:
            if self.web is not None:
                await self.web.stop()
            if self.amqp is not None:
                await self.amqp.stop()
            if self.amqp_broker is not None:
                await self.amqp_broker.close()  # commits what the listener queued
            if metrics is not None:
                metrics.close()
            await self.session.close()
        # Two different counts, not a balance: a claim takes a row for one stage; an
        # answer ends one pass of a worker or a consumer (a retried row is claimed and
        # answered again; a split's new rows are answered without a claim of their own).
        log.info(
            "stopped: since start, %d rows claimed for a stage (%d claim statements), "
            "%d answers from workers and consumers",
            self.ledger.claimed_total,
            self.claimer.statements,
            self.ledger.answered_total,
        )
        return self.exit_code

    def request_reload(self) -> None:
        """P-10: rebuild the stage table at the next cycle (SIGHUP, config_changed)."""
        self.reload_requested = True
        self.reload_at = 0.0
        self._wake_bare()

    def on_channel(self, channel: str, payload: str = "") -> None:
        if channel == "config_changed":
            self.request_reload()
        elif channel == "telemetry_changed":
            self.retire_requested = True
            self._wake_bare()
        elif channel == "amqp_changed" and self.amqp is not None:
            self.known.heard()  # a queue deleted elsewhere (its vhost), say: counts unknown
            self.amqp.changed(payload)

    def request_stop(self) -> None:
        if not self.stopping:
            log.info("stopping: no more claims; stopping workers and requeueing their messages")
        self.stopping = True
        self._wake_bare()

    async def _shutdown(self) -> None:
        """Phase two of a stop: workers stopped, what they held requeued, stats written."""
        await self.supervisor.shutdown()
        conn = self.session.conn
        if conn is not None:
            try:
                if self.rows:
                    await self.rows.flush(conn, self.clock())
                await self.flusher.run_once(conn, final=True)
                await self.live.run_once(conn, final=True)
            except Exception as exc:
                if not is_reconnect(exc):
                    raise
                log.error("could not requeue in-flight rows; the next start resets them")

    # ---- the loop ------------------------------------------------------------

    def wake(self, cause: str, *, news: bool | Mapping[str, int | None] = True) -> None:
        """`news`: which stages may have rows pending now: all (True), these, with how
        many rows each if known (the AMQP listener's commit), or none (False: only
        credit was freed, an AMQP consumer's)."""
        self.wake_causes.add(cause)
        if news is True:
            self.known.heard()
        elif news:
            self.known.published(news)
        self.wake_event.set()

    def _wake_bare(self) -> None:
        """A wakeup that is not a pipeline event (stop, reload, reconnection)."""
        self.known.heard()
        self.wake_event.set()

    async def _run(self) -> None:
        while not self.stopping:
            try:
                await self.cycle()
            except Exception as exc:
                if is_reconnect(exc):  # lost, at the connection limit, or now a standby
                    log.warning("database connection lost: %s", one_line(exc))
                    self.rows.give_up_pauses(self.clock())
                    if await self.session.reconnect(self._restore):
                        self._wake_bare()
                    continue
                # a bug must not strand every claimed row: log it, go on
                log.exception("dispatcher cycle failed; continuing in %gs", BUG_PAUSE)
                await asyncio.sleep(BUG_PAUSE)
                self.known.heard()
                continue
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for runs the wait as a
            # task of its own, two more turns of the loop between a wakeup and the
            # cycle (41 -> 23 us from an Event's set to the waiter, a microbenchmark)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.sleep_time()):
                    await self.wake_event.wait()
            self.wake_event.clear()
            self._count_wakeup()

    async def cycle(self) -> None:
        """One pass: tend, settle, sweep, isolate, claim and feed, vacuum, flush."""
        conn = self.session.conn
        assert conn is not None
        if self.reload_requested and self.clock() >= self.reload_at:
            await self._reload()
            if self.stopping:
                return
        if self.retire_requested:
            self.retire_requested = False
            n = self.supervisor.retire_all()
            log.info("telemetry switch changed: %d live workers retired", n)
        self.supervisor.tend()
        if self.rows:
            # rows going back to pending: news for their stages
            self.known.changed(stage for stage, ids in self.rows.requeues.items() if ids)
            soonest = await self.rows.flush(conn, self.clock())
            if soonest is not None:
                self.sweeper.due_in(soonest)
        if self.orphans_due:
            self.orphans_due = False
            await self._reset_orphans()
        if await self.sweeper.run_once(conn):
            self.known.heard()  # its poll, or rows made pending: whatever woke the loop
        await self.supervisor.isolate()
        capacities = self.supervisor.capacities()
        broker = self.amqp_broker
        if broker is not None:  # AMQP consumers: one more kind of worker
            capacities.update(broker.deliverer.capacities())
        claimed = await self._claim(conn, self.known.room(capacities))
        if claimed:
            await self.supervisor.feed(claimed)
        self.vacuum.maybe_start(self.ledger.answered_total)
        if self.flusher.due(self.supervisor.idle()):
            await self.flusher.run_once(conn)
        if self.live.due(self.supervisor.idle()):
            await self.live.run_once(conn)

    async def _claim(self, conn: AConn, asked: dict[str, int]) -> list[Claimed]:
        """P-4: the one claim. Its AMQP rows go to their read-ahead; the rest are returned,
        for the workers. `claim_turns` is odd meanwhile (queue.declare's count of a queue
        must not overlap a claim that reads its rows ahead)."""
        self.claim_turns += 1
        self.no_claim.clear()
        try:
            claimed = await self.claimer.run_once(conn, asked, self.supervisor.rows_for())
            self.known.claimed(asked, (row.stage for row in claimed), self.claimer.drained)
            if not claimed:
                return claimed
            self.ledger.claimed(claimed)
            amqp = [row for row in claimed if row.stage.startswith(AMQP_STAGE_PREFIX)]
            if not amqp or self.amqp_broker is None:
                return claimed
            self.amqp_broker.deliverer.deliver((r.wid, r.stage, r.delivery) for r in amqp)
            return [r for r in claimed if not r.stage.startswith(AMQP_STAGE_PREFIX)]
        finally:
            self.claim_turns += 1
            self.no_claim.set()

    async def _reload(self) -> None:
        """P-10: the file and the overlay again; swap the stage table, retire every worker."""
        timeout = self.config.postgres.connect_timeout
        try:
            config = await asyncio.to_thread(reload.load, self.config.path, self.dsn, timeout)
        except ConfigError as exc:  # a graph that does not parse: stop, exit 78
            log.error("configuration reload failed: %s; stopping (exit 78)", exc)
            self.reload_requested = False
            self.exit_code = EX_CONFIG
            self.request_stop()
            return
        except Exception as exc:
            if not (isinstance(exc, PepsiError | psycopg.Error)):
                raise
            # an overlay that cannot be read is not a new configuration
            retry = self.config.dispatch.poll_interval
            log.warning(
                "cannot read the configuration overlay (%s); keeping the current stages, "
                "retrying in %s", one_line(exc), format_seconds(retry),
            )  # fmt: skip
            self.reload_at = self.clock() + retry
            return
        self.reload_requested = False
        changes = reload.diff(self.config.stages, config.stages)
        if config.dispatch != self.config.dispatch:
            log.warning("[pepsi-dispatch] changed: it takes effect at the next start")
        # [pepsi-dispatch] and [pepsi-amqp] are not reloaded: the services were built from them
        self.config = replace(config, dispatch=self.config.dispatch, amqp=self.config.amqp)
        self.sweeper.options = replace(self.sweeper.options, stages=tuple(config.stages.values()))
        retiring = self.supervisor.reconfigure(self.config)
        await self.supervisor.terminate(retiring)  # nothing runs the old table after this
        await self.session.record_stages(list(self.supervisor.pools))
        log.info(
            "configuration reloaded: %d stages (%s); %d workers retired",
            len(config.stages), changes.describe(), len(retiring),
        )  # fmt: skip

    async def _restore(self, conn: AConn) -> None:
        """On a new connection: what paused for the database goes on, what waited is
        written, then rows nobody holds are reset (P-2)."""
        await self.rows.database_back(conn, self.clock())
        await self.rows.flush(conn, self.clock())
        await self._reset_orphans()

    async def _reset_orphans(self) -> None:
        """Running rows that nobody here holds go back to pending (P-2). No AMQP publish
        writes rows running for consumers meanwhile (they are held only once committed)."""
        broker = self.amqp_broker
        async with contextlib.AsyncExitStack() as stack:
            if broker is not None:
                try:
                    await stack.enter_async_context(
                        broker.batcher.direct_paused(self.config.postgres.connect_timeout)
                    )
                except TimeoutError:  # a publish's commit hangs: at a later cycle
                    log.warning("an AMQP publish is still being written; orphans reset later")
                    self.orphans_due = True
                    return
            held = self.supervisor.held() + self.ledger.held()
            if broker is not None:
                held += broker.deliverer.held()
            await self.session.reset_orphans(held)
        self.known.heard()  # rows may be pending again: no stage's count is known

    def _orphans_possible(self) -> None:
        """An AMQP publish that wrote rows running lost its connection: they may be
        committed, and held by no one."""
        self.orphans_due = True
        self._wake_bare()

    def sleep_time(self) -> float:
        return decisions.sleep_time(
            self.clock(),
            [
                *([self.reload_at] if self.reload_requested else []),
                *self.sweeper.deadlines(),
                *self.flusher.deadlines(self.supervisor.idle()),
                *self.live.deadlines(self.supervisor.idle()),
                *self.supervisor.deadlines(),
            ],
        )

    def _count_wakeup(self) -> None:
        """P-9: each cause of this wakeup once; no cause means a deadline passed."""
        causes, self.wake_causes = self.wake_causes, set()
        if self.stopping:
            return  # woken to stop: not a wakeup of the pipeline's
        for cause in decisions.wakeup_causes(causes, self.clock(), self.sweeper.next_poll):
            self.stats.wakeup(cause)
