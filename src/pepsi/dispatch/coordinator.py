"""The dispatcher's loop: wake, drain events, claim once for every stage, feed pools.

Wakeups (P-3): a NOTIFY on `workqueue` (payload ignored; a burst is one
wakeup), a worker answering or dying, the POLL_INTERVAL heartbeat, the
listener (re)connecting, the earliest paused row falling due. Each wakeup
first applies what happened meanwhile (requeues, idle and recycled workers),
then runs ONE claim statement for all stages with free capacity (P-4), and
hands the claimed ids to the stages' pools (P-6).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from pepsi.config import Config, StageConfig
from pepsi.db import schema
from pepsi.db.connect import one_line
from pepsi.db.queries import query
from pepsi.dispatch import backpressure, fairness, pools
from pepsi.dispatch.metrics import Gauges, MetricsServer, Snapshot
from pepsi.dispatch.rows import RowWriter
from pepsi.dispatch.stats import Stats
from pepsi.dispatch.vacuum import Vacuum
from pepsi.dispatch.workers import Exit, WorkerProcess, resolve_program
from pepsi.errors import (
    EX_CONFIG,
    EX_IOERR,
    EX_OK,
    EX_TEMPFAIL,
    ConfigError,
    DatabaseUnavailable,
    PepsiError,
)
from pepsi.protocol import StatusLine

log = logging.getLogger("pepsi.dispatch")

LOCK_WAIT = 10.0  # seconds a second dispatcher waits for the singleton lock (P-1)
STOP_WAIT = 10.0  # seconds a worker asked to finish may take before it is killed
RECONNECT_MAX = 30.0
READY_TIMEOUT = 60.0  # seconds a new worker may take to print `ready`


class _StopRequested(Exception):
    """SIGINT/SIGTERM arrived before the dispatcher had started."""


AConn = psycopg.AsyncConnection[tuple[Any, ...]]


class AlreadyRunning(PepsiError):
    """Another dispatcher holds the singleton lock."""


@dataclass
class StagePool:
    config: StageConfig
    workers: dict[int, WorkerProcess] = field(default_factory=dict)
    cooldown_until: float = 0.0
    # Claimed ids whose worker died with several of them in flight: which one
    # killed it is unknown, so each runs alone on an empty worker (W-6).
    isolate: deque[int] = field(default_factory=deque)
    pace: pools.Pace = field(default_factory=pools.Pace)

    def loads(self) -> list[pools.WorkerLoad]:
        """Loads of the workers not already on their way out."""
        return [self._load(w) for w in self.workers.values() if not w.stopping]

    def all_loads(self) -> list[pools.WorkerLoad]:
        """Loads of every live worker: a stopping one still counts toward PARALLELISM."""
        return [self._load(w) for w in self.workers.values()]

    def _load(self, worker: WorkerProcess) -> pools.WorkerLoad:
        return worker.load(self.window(), self.config.max_messages)

    def window(self) -> int:
        return self.pace.window(self.config.queue_limit)

    def limit(self, cap: int | None) -> int:
        return pools.worker_limit(self.config.parallelism, cap)

    def free(self, now: float, cap: int | None) -> int:
        if now < self.cooldown_until:
            return 0
        free = pools.free_capacity(self.all_loads(), self.limit(cap), self.window())
        return max(0, free - len(self.isolate))


class Dispatcher:
    def __init__(self, config: Config, dsn: str) -> None:
        self.config = config
        self.dsn = dsn
        self.pools = {name: StagePool(stage) for name, stage in config.stages.items()}
        self.wake = asyncio.Event()
        self.wake_causes: set[str] = set()  # since the loop last slept (P-9)
        self.stopping = False
        self.rows = RowWriter(config.dispatch)
        options = config.dispatch
        self.fair = (
            fairness.FairShare(options.fair_half_life, options.fair_fifo_percent, time.monotonic)
            if options.fair_scheduling
            else None
        )
        self.caps: dict[str, backpressure.Cap] = {}
        self.exiting: set[WorkerProcess] = set()
        self.conn: AConn | None = None
        self.next_key = 0
        self.next_due: float | None = None  # monotonic time the earliest paused row is due
        self.next_poll = 0.0
        self.next_housekeeping = 0.0
        self.body_cursor = 0
        self.claimed_total = 0
        self.claims_total = 0
        self.stats = Stats()
        self.started_at = datetime.now(UTC)
        self.last_stats_flush = 0.0
        self.next_stats = time.monotonic() + config.dispatch.stats_interval
        self.tempfail_from: str | None = None
        self.completed_total = 0
        self.vacuum = Vacuum(dsn, config.dispatch.vacuum_after)

    # ---- start and stop ---------------------------------------------------

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self.request_stop)
        try:
            self.conn = await self._connect_locked(initial=True)
        except _StopRequested:
            return EX_OK
        metrics = None
        try:
            await self._start_checks(self.conn)
            metrics = self._serve_metrics()
            listener = loop.create_task(self._listen())
            try:
                await self._run()
            finally:
                listener.cancel()
                await self._shutdown()
                await self.vacuum.close()
        finally:
            if metrics is not None:
                metrics.close()
            if self.conn is not None:
                await self.conn.close()
        log.info(
            "stopped: %d claimed, %d completed since start (%d claim statements)",
            self.claimed_total,
            self.completed_total,
            self.claims_total,
        )
        return EX_OK

    def _serve_metrics(self) -> MetricsServer | None:
        address = self.config.dispatch.metrics_address
        if address is None:
            return None
        try:
            server = MetricsServer(address, self._metrics_snapshot, list(self.pools))
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {address[0]}:{address[1]}: {exc.strerror or exc}",
                section="pepsi-dispatch",
                key="METRICS_ADDRESS",
            ) from None
        log.info("metrics at %s", server.url)
        return server

    def _metrics_snapshot(self) -> Snapshot:
        """Counters since start and the pools' gauges, taken on the loop."""
        now = time.monotonic()
        return Snapshot(
            self.stats.snapshot(),
            Gauges(
                workers={name: len(pool.workers) for name, pool in self.pools.items()},
                in_flight={
                    name: sum(len(w.inflight) for w in pool.workers.values())
                    for name, pool in self.pools.items()
                },
                worker_limit={
                    name: pool.limit(backpressure.limit_for(self.caps, name, now))
                    for name, pool in self.pools.items()
                },
                started=self.started_at.timestamp(),
            ),
        )

    def request_stop(self) -> None:
        if not self.stopping:
            log.info("stopping: no more claims; stopping workers and requeueing their messages")
        self.stopping = True
        self.wake.set()

    async def _connect_locked(self, *, initial: bool) -> AConn:
        """Connect the claim connection and take the singleton lock on it (P-1)."""
        try:
            conn = await psycopg.AsyncConnection.connect(
                self.dsn, autocommit=True, application_name="pepsi-dispatch"
            )
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable(f"cannot connect to the database: {one_line(exc)}") from None
        deadline = time.monotonic() + LOCK_WAIT
        announced = False
        while True:
            row = await (await conn.execute(query("dispatcher_lock_try"))).fetchone()
            if row and row[0]:
                return conn
            if not announced and initial:
                log.warning("another dispatcher holds the lock; waiting up to %ds", LOCK_WAIT)
                announced = True
            if self.stopping:
                await conn.close()
                raise _StopRequested
            if time.monotonic() >= deadline:
                holder = await (await conn.execute(query("dispatcher_lock_holder"))).fetchone()
                await conn.close()
                raise AlreadyRunning(_holder_text(holder))
            await asyncio.sleep(0.5)

    async def _start_checks(self, conn: AConn) -> None:
        await asyncio.to_thread(_require_schema, self.dsn)
        cur = await conn.execute(query("workqueue_reset_running"))
        if cur.rowcount:
            log.warning("reset %d leftover running rows to pending (P-2)", cur.rowcount)
        log.info("dispatching %d stages: %s", len(self.pools), ", ".join(self.pools) or "(none)")

    async def _shutdown(self) -> None:
        workers = [w for pool in self.pools.values() for w in pool.workers.values()]
        await asyncio.gather(*(w.terminate() for w in workers), return_exceptions=True)
        await asyncio.gather(*(w.wait_closed() for w in workers), return_exceptions=True)
        for name, pool in self.pools.items():
            self._requeue(name, list(pool.isolate))
            pool.isolate.clear()
        if self.conn is not None:
            try:
                if self.rows:
                    await self.rows.flush(self.conn, time.monotonic())
                await self._flush_stats(final=True)
            except psycopg.OperationalError:
                log.error("could not requeue in-flight rows; the next start resets them")

    # ---- the loop ------------------------------------------------------------

    async def _run(self) -> None:
        while not self.stopping:
            try:
                await self._cycle()
            except psycopg.OperationalError as exc:
                log.warning("database connection lost: %s", one_line(exc))
                self.rows.give_up_pauses(time.monotonic())
                await self._reconnect()
                continue
            except Exception:  # a bug must not strand every claimed row: log it, go on
                log.exception("dispatcher cycle failed; continuing in 1s")
                await asyncio.sleep(1.0)
                continue
            timeout = self._sleep_time()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout)
            self.wake.clear()
            self._count_wakeup()

    def _count_wakeup(self) -> None:
        """P-9: each cause of this wakeup once; no cause means a deadline passed."""
        causes, self.wake_causes = self.wake_causes, set()
        if self.stopping:
            return  # woken to stop: not a wakeup of the pipeline's
        if not causes:
            causes = {"poll" if time.monotonic() >= self.next_poll else "timer"}
        for cause in causes:
            self.stats.wakeup(cause)

    async def _cycle(self) -> None:
        now = time.monotonic()
        if self.tempfail_from is not None:
            self._tempfail(self.tempfail_from)
            self.tempfail_from = None
        self._tend_workers(now)
        if self.rows and self.conn is not None:
            soonest = await self.rows.flush(self.conn, now)
            if soonest is not None:
                self._due_in(soonest)
        if now >= self.next_poll or (self.next_due is not None and now >= self.next_due):
            await self._resume_due()
            await self._expire()
            self.next_poll = now + self.config.dispatch.poll_interval
        if now >= self.next_housekeeping:
            await self._housekeeping()
            self.next_housekeeping = now + self.config.dispatch.stats_interval
        await self._isolate()
        await self._claim()
        self.vacuum.maybe_start(self.completed_total)
        if self.stats and (
            now >= self.next_stats or (self._idle() and now - self.last_stats_flush >= 1.0)
        ):
            await self._flush_stats()

    def _idle(self) -> bool:
        """No worker holds a message: the pipeline has gone idle (P-9)."""
        return not any(w.inflight for p in self.pools.values() for w in p.workers.values())

    def _sleep_time(self) -> float:
        now = time.monotonic()
        deadlines = [self.next_poll]
        if self.stats:  # flush at the tick, or when idle (at most once a second)
            deadlines.append(self.next_stats)
            if self._idle():  # while busy, that deadline would wake the loop in a spin
                deadlines.append(self.last_stats_flush + 1.0)
        for pool in self.pools.values():
            for w in pool.workers.values():
                if w.stopping:
                    continue
                if not w.ready:
                    deadlines.append(w.started_at + READY_TIMEOUT)
                elif w.inflight and w.head_since is not None:
                    deadlines.append(w.head_since + pool.config.max_runtime)
        if self.next_due is not None:
            deadlines.append(self.next_due)
        idle_timeout = self.config.dispatch.worker_idle_timeout
        for pool in self.pools.values():
            due = pools.next_idle_deadline(pool.loads(), idle_timeout)
            if due is not None:
                deadlines.append(due)
            if pool.cooldown_until > now:
                deadlines.append(pool.cooldown_until)
        return max(0.0, min(deadlines) - now)

    async def _resume_due(self) -> None:
        assert self.conn is not None
        row = await (await self.conn.execute(query("workqueue_resume_due"))).fetchone()
        assert row is not None
        resumed, next_due_in = int(row[0]), row[1]
        if resumed:
            log.info("resumed %d paused rows", resumed)
            self.stats.count("paused_resumed", resumed)
        self.next_due = None
        if next_due_in is not None:
            self._due_in(float(next_due_in))

    def _due_in(self, seconds: float) -> None:
        """A paused row falls due in `seconds`: wake then (P-8)."""
        due = time.monotonic() + max(0.0, seconds)
        self.next_due = due if self.next_due is None else min(self.next_due, due)

    async def _flush_stats(self, *, final: bool = False) -> None:
        """P-9: one statement; nothing at all when nothing was counted.

        Wakeups alone make no flush due, but the final one writes them too.
        """
        assert self.conn is not None
        now = time.monotonic()
        self.last_stats_flush = now
        self.next_stats = now + self.config.dispatch.stats_interval
        if self.stats.empty() if final else not self.stats:
            return
        params = self.stats.take()
        await self.conn.execute(query("stats_flush"), {**params, "started": self.started_at})

    async def _expire(self) -> None:
        """R-10: the TTL sweep, on the poll tick rather than in every claim."""
        assert self.conn is not None
        stages = list(self.config.stages.values())
        row = await (
            await self.conn.execute(
                query("workqueue_expire"),
                {
                    "stages": [s.name for s in stages],
                    "ttls": [s.ttl for s in stages],
                    "bounces": [s.bounce_stage for s in stages],
                    "max_rows": 1000,
                },
            )
        ).fetchone()
        if row and row[0]:
            log.warning("dead-lettered %d expired messages (TTL)", row[0])

    async def _housekeeping(self) -> None:
        """Every STATS_INTERVAL: sweep the dedup window and orphaned bodies."""
        assert self.conn is not None
        window = self.config.ingress.dedup_window
        await self.conn.execute(query("publish_dedup_sweep"), {"window": window, "max_rows": 10000})
        row = await (
            await self.conn.execute(
                query("workqueue_body_gc"), {"after_id": self.body_cursor, "max_examined": 10000}
            )
        ).fetchone()
        if row is not None:
            if row[0]:
                log.info("collected %d orphaned message bodies", row[0])
                self.stats.count("bodies_collected", int(row[0]))
            self.body_cursor = int(row[1])

    async def _claim(self) -> None:
        assert self.conn is not None
        now = time.monotonic()
        self.caps = backpressure.active(self.caps, now)
        caps = {
            name: pool.free(now, backpressure.limit_for(self.caps, name, now))
            for name, pool in self.pools.items()
        }
        caps = {name: cap for name, cap in caps.items() if cap > 0}
        if not caps:
            return
        self.claims_total += 1
        if self.fair is None:
            rows = await (
                await self.conn.execute(
                    query("workqueue_claim_fifo"),
                    {"stages": list(caps), "caps": list(caps.values())},
                )
            ).fetchall()
        else:
            rows = await self._claim_fair(caps)
        if not rows:
            return
        self.claimed_total += len(rows)
        # Only claims that took rows are counted: an idle poll tick must not
        # leave a delta behind, or every tick would be followed by a flush.
        self.stats.count("claims")
        self.stats.count("claimed", len(rows))
        by_stage: dict[str, list[int]] = defaultdict(list)
        for wid, stage, *_ in sorted(rows):
            by_stage[stage].append(int(wid))
        for stage, ids in by_stage.items():
            await self._feed(self.pools[stage], ids)

    async def _isolate(self) -> None:
        """Hand each held suspect, alone, to an empty worker (or a new one)."""
        now = time.monotonic()
        for name, pool in self.pools.items():
            while pool.isolate and now >= pool.cooldown_until:
                empty = [
                    w for w in pool.workers.values()
                    if w.ready and not w.stopping and not w.inflight
                ]  # fmt: skip
                wid = pool.isolate[0]
                if empty:
                    pool.isolate.popleft()
                    empty[0].solo = True
                    empty[0].send([wid])
                    continue
                cap = backpressure.limit_for(self.caps, name, now)
                if pools.startable(pool.all_loads(), pool.limit(cap)):
                    pool.isolate.popleft()
                    worker = await self._start_worker(pool, [wid])
                    if worker is not None:
                        worker.solo = True
                break

    async def _claim_fair(self, caps: dict[str, int]) -> list[tuple[Any, ...]]:
        """P-5: one statement; the ledgers are debited for what it claimed."""
        assert self.conn is not None
        assert self.fair is not None
        params = self.fair.claim_params(caps)
        row = await (
            await self.conn.execute(
                query("workqueue_claim_fair"),
                {**params, "lags": Jsonb(params["lags"]), "max_senders": 64},
            )
        ).fetchone()
        assert row is not None
        ids, stages, senders, starts = row
        for stage, start in zip(params["stages"], starts, strict=True):
            self.fair.window[str(stage)] = str(start)
        for wid, stage, sender in zip(ids, stages, senders, strict=True):
            self.fair.ledger(stage).claim(int(wid), str(sender))
        return list(zip(ids, stages, strict=True))

    def _requeue(self, stage: str, ids: Sequence[int]) -> None:
        """Back to pending without having run: the sender's debit is refunded."""
        self.rows.requeue(stage, ids)
        self.stats.stage(stage, "requeued", len(ids))
        if self.fair is not None:
            ledger = self.fair.ledger(stage)
            for wid in ids:
                ledger.refund(wid)

    async def _feed(self, pool: StagePool, ids: list[int]) -> None:
        stage = pool.config
        cap = backpressure.limit_for(self.caps, stage.name, time.monotonic())
        plan = pools.assign(ids, pool.all_loads(), pool.limit(cap), pool.window())
        if plan.leftover:  # capacity shrank while the claim ran (a worker died)
            self._requeue(stage.name, plan.leftover)
        for key, batch in plan.to_existing.items():
            pool.workers[key].send(batch)
        for batch in plan.to_new:
            await self._start_worker(pool, batch)

    async def _start_worker(self, pool: StagePool, ids: Sequence[int]) -> WorkerProcess | None:
        stage = pool.config
        self.next_key += 1
        try:
            argv = self._worker_argv(stage)
        except FileNotFoundError as exc:
            log.error("stage %s: cannot start its worker: %s", stage.name, exc)
            self._cool_down(pool)
            self._requeue(stage.name, ids)
            return None
        env = {
            **os.environ,
            "PEPSI_STAGE": stage.name,
            "PEPSI_DSN": self.dsn,
            "PEPSI_NEXT": stage.next or "",
            # libpq's default application_name: a program's connections show as its
            # stage's in pg_stat_activity and in `pepsi top` without it doing anything
            "PGAPPNAME": f"pepsi-worker:{stage.name}",
        }
        worker = WorkerProcess(
            self.next_key,
            stage.name,
            argv,
            env,
            on_ready=self._on_ready,
            on_status=self._on_status,
            on_answers=self._on_answers,
            on_exit=self._on_exit,
        )
        try:
            await worker.start(ids)
        except OSError as exc:
            log.error("stage %s: cannot start %s: %s", stage.name, argv[0], exc)
            self._cool_down(pool)
            self._requeue(stage.name, ids)
            return None
        pool.workers[worker.key] = worker
        self.stats.count("workers_started")
        log.debug("stage %s: started worker pid %s", stage.name, worker.pid)
        return worker

    def _worker_argv(self, stage: StageConfig) -> list[str]:
        config_file = self.config.dispatch.config_file
        if stage.handler is not None:
            # The unified program; it needs the configuration to find the handler.
            path = config_file or self.config.path
            conf = ["-c", str(path)] if path else []
            return [sys.executable, "-m", "pepsi", *conf, "worker"]
        assert stage.program is not None
        conf = ["-c", str(config_file)] if config_file else []
        return [resolve_program(stage.program), *conf, "worker"]

    # ---- events from workers -------------------------------------------------

    def _wake(self, cause: str) -> None:
        self.wake_causes.add(cause)
        self.wake.set()

    def _on_ready(self, worker: WorkerProcess) -> None:
        log.debug("stage %s: worker pid %s ready", worker.stage, worker.pid)
        self._wake("worker")  # the stage may start its next worker

    def _on_status(self, worker: WorkerProcess, wid: int, status: StatusLine) -> None:
        self.completed_total += 1
        if status.report_error:
            log.warning(
                "stage %s: worker pid %s: %s", worker.stage, worker.pid, status.report_error
            )
        if self.fair is not None:
            micros = sum(p.micros for p in status.report) if status.report else None
            self.fair.ledger(worker.stage).report(
                wid, None if micros is None else micros / 1_000_000
            )
        self._count_status(worker.stage, status)
        if status.status == EX_IOERR:  # W-4: the worker lost the database
            self.rows.pause_db(worker.stage, wid, time.monotonic())
        elif status.status == EX_TEMPFAIL:  # W-5: connection limit exhausted
            self._requeue(worker.stage, [wid])
            self.tempfail_from = worker.stage  # one halving per cycle, not per id
        elif not status.ok:
            log.info("stage %s: message %d ended with status %d", worker.stage, wid, status.status)
        self._wake("worker")

    def _on_answers(self, worker: WorkerProcess, seconds_each: float) -> None:
        """A read of its answers: the stage's pace, which sizes its window (P-6)."""
        self.pools[worker.stage].pace.observe(seconds_each)

    def _count_status(self, stage: str, status: StatusLine) -> None:
        """P-9: a worker pass; fused stages count one by one from its report."""
        self.stats.count("stages_executed")
        if status.status not in (EX_IOERR, EX_TEMPFAIL):  # those were not processed
            self.stats.passes(stage, status.ok, status.report)

    def _tempfail(self, stage: str) -> None:
        now = time.monotonic()
        running = {name: len(pool.workers) for name, pool in self.pools.items()}
        parallelism = {name: pool.config.parallelism for name, pool in self.pools.items()}
        self.caps, halved = backpressure.on_tempfail(
            self.caps, running, parallelism, now=now,
            window=self.config.dispatch.tempfail_window,
        )  # fmt: skip
        self.stats.count("backpressure_events")
        if halved is not None:
            log.warning(
                "stage %s: worker out of database connections (75); stage %s limited to %d "
                "workers for %.0fs", stage, halved, self.caps[halved].workers,
                self.config.dispatch.tempfail_window,
            )  # fmt: skip

    def _on_exit(self, worker: WorkerProcess, exit_: Exit) -> None:
        pool = self.pools[worker.stage]
        pool.workers.pop(worker.key, None)
        self.stats.count("workers_retired" if exit_.expected else "workers_crashed")
        if exit_.expected:
            self._requeue(worker.stage, exit_.unanswered)
            log.debug("stage %s: worker pid %s stopped", worker.stage, worker.pid)
        elif not exit_.was_ready:
            # W-7: it failed its own start; nothing is charged to the messages.
            self._requeue(worker.stage, exit_.unanswered)
            cause = exit_.last_words or exit_.reason
            if exit_.returncode == EX_CONFIG:
                cause = f"refused to run (exit 78): {cause}"
            log.error(
                "stage %s: worker pid %s died before ready: %s; %d messages requeued, "
                "retrying in %.0fs", worker.stage, worker.pid, cause, len(exit_.unanswered),
                self.config.dispatch.start_cooldown,
            )  # fmt: skip
            self._cool_down(pool)
        elif exit_.unanswered and (len(exit_.unanswered) == 1 or worker.solo or worker.garbled):
            # W-6: the message it held (or answered with garbage) gets a strike.
            (head,) = exit_.unanswered[:1]
            kind = "timed-out" if worker.timed_out else "crashed"
            self._charge_timeout(worker.stage, head, timed_out=worker.timed_out)
            self.rows.strike(worker.stage, head, kind, f"worker {exit_.reason}")
            self.stats.stage(worker.stage, "strikes")
            if worker.timed_out:
                self.stats.stage(worker.stage, "timed_out")
            self._requeue(worker.stage, exit_.unanswered[1:])
            log.error(
                "stage %s: worker pid %s %s holding message %d",
                worker.stage, worker.pid, exit_.reason, head,
            )  # fmt: skip
        elif exit_.unanswered:
            # Several ids in flight: a batched worker answers them together, so
            # the head is not necessarily the culprit. Nobody is charged yet;
            # each runs alone, and a strike lands where the crash recurs.
            pool.isolate.extend(exit_.unanswered)
            log.error(
                "stage %s: worker pid %s %s holding %d messages; running each alone",
                worker.stage, worker.pid, exit_.reason, len(exit_.unanswered),
            )  # fmt: skip
        else:
            log.warning("stage %s: worker pid %s %s", worker.stage, worker.pid, exit_.reason)
        self._wake("worker")

    def _charge_timeout(self, stage: str, wid: int, *, timed_out: bool) -> None:
        """A struck message used its worker: MAX_RUNTIME if it hung, else its debit (P-5)."""
        if self.fair is None:
            return
        ledger = self.fair.ledger(stage)
        if timed_out:
            ledger.timed_out(wid, self.pools[stage].config.max_runtime)
        else:
            ledger.report(wid, None)

    def _cool_down(self, pool: StagePool) -> None:
        pool.cooldown_until = time.monotonic() + self.config.dispatch.start_cooldown

    def _tend_workers(self, now: float) -> None:
        """Kill hung workers; stop idle, spent and surplus ones (P-6, W-5, W-6, W-7)."""
        idle_timeout = self.config.dispatch.worker_idle_timeout
        for name, pool in self.pools.items():
            live = [w for w in pool.workers.values() if not w.stopping]
            for worker in live:
                if not worker.ready and now - worker.started_at > READY_TIMEOUT:
                    worker.kill(f"not ready after {READY_TIMEOUT:.0f}s")
                elif (
                    worker.ready
                    and worker.inflight
                    and worker.head_since is not None
                    and now - worker.head_since > pool.config.max_runtime
                ):
                    worker.timed_out = True
                    worker.kill(f"gave no answer within MAX_RUNTIME ({pool.config.max_runtime:g}s)")
            idle = set(pools.idle_to_stop(pool.loads(), now, idle_timeout))
            surplus = len(live) - pool.limit(backpressure.limit_for(self.caps, name, now))
            for worker in sorted(live, key=lambda w: len(w.inflight)):
                spent = worker.handled >= pool.config.max_messages and not worker.inflight
                if worker.key in idle or spent or surplus > 0:
                    surplus -= 1
                    worker.close_input()
                    asyncio.get_running_loop().create_task(self._reap(worker))

    async def _reap(self, worker: WorkerProcess) -> None:
        """A worker asked to finish gets STOP_WAIT seconds, then is killed."""
        try:
            await asyncio.wait_for(worker.wait_closed(), STOP_WAIT)
        except TimeoutError:
            worker.kill("did not stop when asked", expected=True)

    # ---- the listener and reconnection ----------------------------------------

    async def _listen(self) -> None:
        delay = 1.0
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self.dsn, autocommit=True, application_name="pepsi-dispatch-listen"
                )
                async with conn:
                    await conn.execute(query("workqueue_listen"))
                    delay = 1.0
                    self._wake("notify")  # a (re)connection may have missed notifications
                    async for _ in conn.notifies():
                        self._wake("notify")
            except psycopg.OperationalError as exc:
                log.warning("listener: %s; reconnecting in %.0fs", one_line(exc), delay)
                await asyncio.sleep(delay)
                delay = min(RECONNECT_MAX, delay * 2)

    async def _reset_orphans(self) -> None:
        """After a reconnect: rows left running that no worker holds go back to pending.

        A claim whose answer was lost with the connection committed rows that
        no worker was given; holding the lock again, this dispatcher is the
        only one that can know which running rows are really in flight.
        """
        assert self.conn is not None
        held = (
            [
                wid
                for pool in self.pools.values()
                for w in pool.workers.values()
                for wid in w.inflight
            ]
            + self.rows.held()
            + [wid for pool in self.pools.values() for wid in pool.isolate]
        )
        cur = await self.conn.execute(query("workqueue_reset_running_except"), {"held": held})
        if cur.rowcount:
            log.warning("reset %d claimed rows no worker holds to pending", cur.rowcount)

    async def _reconnect(self) -> None:
        delay = 1.0
        if self.conn is not None:
            await self.conn.close()
            self.conn = None
        while not self.stopping:
            try:
                self.conn = await self._connect_locked(initial=False)
                await self.rows.flush(self.conn, time.monotonic())
                await self._reset_orphans()
                log.info("database connection restored")
                self.wake.set()
                return
            except _StopRequested:
                return
            except DatabaseUnavailable as exc:
                log.warning("%s; retrying in %.0fs", exc, delay)
            except psycopg.OperationalError as exc:
                log.warning("database: %s; retrying in %.0fs", one_line(exc), delay)
            await asyncio.sleep(delay)
            delay = min(RECONNECT_MAX, delay * 2)


def _require_schema(dsn: str) -> None:
    """The start-up schema check (P-13), on a short-lived sync connection."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        schema.require_current(conn)


def _holder_text(row: tuple[Any, ...] | None) -> str:
    if row is None:
        return "another dispatcher is running on this database (lock held for 10s)"
    pid, addr, host, app, _since = row
    where = host or addr or "local socket"
    return (
        f"another dispatcher is running on this database "
        f"(backend pid {pid}, client {where}, {app or 'unknown program'})"
    )
