"""The pool supervisor: every stage's elastic pool of worker processes (P-6, W-5…W-7).

It says how many ids each stage can take, packs claimed ids onto workers
(starting one when the pool may grow), hands suspects to workers one at a
time, tends the pools (hung, idle, spent and surplus workers) and turns what
workers report into ledger entries. What to do is decided by the pure
`pools`, `backpressure` and `decisions` modules; this class only carries it
out on processes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Callable, Sequence
from typing import Protocol

from pepsi.config import Config
from pepsi.dispatch.ledger import Claimed, InFlight
from pepsi.dispatch.policy import backpressure, decisions, pools
from pepsi.dispatch.policy.known_pending import answer_is_news
from pepsi.dispatch.pools.pool import PoolOptions, StagePool, worker_argv
from pepsi.dispatch.pools.workers import WorkerProcess
from pepsi.dispatch.stats import Stats
from pepsi.durations import format_seconds
from pepsi.protocol import Answer

log = logging.getLogger("pepsi.dispatch")


class Wake(Protocol):
    """The dispatcher's wakeup (`Dispatcher.wake`): `news` False when nothing can have
    become pending."""

    def __call__(self, cause: str, *, news: bool = True) -> None: ...


class PoolSupervisor:
    def __init__(
        self,
        config: Config,
        options: PoolOptions,
        ledger: InFlight,
        stats: Stats,
        *,
        wake: Wake,
        clock: Callable[[], float],
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.options = options
        self.rng = rng  # the start backoff's jitter
        self.ledger = ledger
        self.stats = stats
        self.wake = wake
        self.clock = clock
        self.pools = {name: StagePool(stage) for name, stage in config.stages.items()}
        # Stages a reload removed, until their retired workers have exited.
        self.retired: dict[str, StagePool] = {}
        self.caps: dict[str, backpressure.Cap] = {}
        self.tempfail_from: str | None = None  # a stage whose worker said 75 this cycle
        self.next_key = 0
        self._reaping: set[asyncio.Task[None]] = set()

    # ---- capacity and feeding -------------------------------------------------

    def cap(self, stage: str, now: float) -> int | None:
        return backpressure.limit_for(self.caps, stage, now)

    def capacities(self) -> dict[str, int]:
        """Ids each stage can take now (P-6): room in its workers, a worker it may start."""
        now = self.clock()
        self.caps = backpressure.active(self.caps, now)
        return {name: pool.free(now, self.cap(name, now)) for name, pool in self.pools.items()}

    def rows_for(self) -> list[str]:
        """Stages with a worker that takes rows with its ids ("ready rows"): a small claim
        returns their rows (see `Claimer`)."""
        return [
            name
            for name, pool in self.pools.items()
            if any(w.takes_rows for w in pool.workers.values())
        ]

    async def feed(self, claimed: Sequence[Claimed]) -> None:
        """Pack claimed ids onto the busiest workers with room, then a new one."""
        by_stage: dict[str, list[int]] = {}
        rows: dict[int, bytes] = {}  # those the claim returned (small claims)
        for row in claimed:
            by_stage.setdefault(row.stage, []).append(row.wid)
            if row.row is not None:
                rows[row.wid] = row.row
        for stage, ids in by_stage.items():
            if stage in self.pools:
                await self._feed_stage(self.pools[stage], ids, rows)
            else:  # removed by a reload while the claim ran
                self.ledger.requeue(stage, ids)

    async def _feed_stage(self, pool: StagePool, ids: list[int], rows: dict[int, bytes]) -> None:
        stage = pool.config.name
        window = pool.claim_window or pool.window()
        plan = pools.assign(
            ids, pool.loads(window), pool.limit(self.cap(stage, self.clock())), window
        )
        if plan.leftover:  # capacity shrank while the claim ran (a worker died)
            self.ledger.requeue(stage, plan.leftover)
        for key, batch in plan.to_existing.items():
            pool.workers[key].send(batch, rows)
        for batch in plan.to_new:
            await self._start_worker(pool, batch)

    async def isolate(self) -> None:
        """Hand each held suspect, alone, to an empty worker (or a new one) (W-6)."""
        now = self.clock()
        for name, pool in self.pools.items():
            if not pool.isolate or now < pool.cooldown_until:
                continue
            can_start = bool(pools.startable(pool.loads(), pool.limit(self.cap(name, now))))
            plan = decisions.isolate(list(pool.isolate), pool.facts(), can_start)
            for key, wid in plan.to_existing:
                pool.isolate.popleft()
                pool.workers[key].solo = True
                pool.workers[key].send([wid])
            if plan.to_new is not None:
                pool.isolate.popleft()
                worker = await self._start_worker(pool, [plan.to_new])
                if worker is not None:
                    worker.solo = True

    async def _start_worker(self, pool: StagePool, ids: Sequence[int]) -> WorkerProcess | None:
        stage = pool.config
        self.next_key += 1
        try:
            argv = worker_argv(stage, self.options)
        except FileNotFoundError as exc:
            log.error("stage %s: cannot start its worker: %s", stage.name, exc)
            self._cool_down(pool)
            self.ledger.requeue(stage.name, ids)
            return None
        env = {
            **os.environ,
            "PEPSI_STAGE": stage.name,
            "PEPSI_DSN": self.options.dsn,
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
            on_ready=self.on_ready,
            on_statuses=self.on_statuses,
            on_answers=self.on_answers,
            on_exit=self.on_exit,
            clock=self.clock,
            kill_grace=self.options.kill_grace,
        )
        try:
            await worker.start(ids)
        except OSError as exc:
            log.error("stage %s: cannot start %s: %s", stage.name, argv[0], exc)
            self._cool_down(pool)
            self.ledger.requeue(stage.name, ids)
            return None
        pool.workers[worker.key] = worker
        self.stats.count("workers_started")
        log.debug("stage %s: started worker pid %s", stage.name, worker.pid)
        return worker

    def _cool_down(self, pool: StagePool, *, database: bool = False) -> float:
        """Rest the stage: START_COOLDOWN, or the reconnect backoff if the database was away."""
        if database:
            if pool.start_delays is None:
                pool.start_delays = self.options.start_backoff.delays(self.rng)
            delay = next(pool.start_delays)
        else:
            delay = self.options.start_cooldown
        pool.cooldown_until = self.clock() + delay
        return delay

    # ---- tending ----------------------------------------------------------------

    def tend(self) -> None:
        """Back-pressure from the last cycle; kill hung workers; stop idle, spent, surplus."""
        if self.tempfail_from is not None:
            self._tempfail(self.tempfail_from)
            self.tempfail_from = None
        now = self.clock()
        for name, pool in self.pools.items():
            rules = pool.rules(self.cap(name, now), self.options)
            for action in decisions.tend(pool.facts(), rules, now):
                worker = pool.workers[action.key]
                if isinstance(action, decisions.Kill):
                    worker.timed_out = worker.timed_out or action.timed_out
                    worker.kill(action.reason)
                else:
                    self._stop(worker)

    def _stop(self, worker: WorkerProcess) -> None:
        worker.close_input()
        task = asyncio.get_running_loop().create_task(self._reap(worker))
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    async def _reap(self, worker: WorkerProcess) -> None:
        """A worker asked to finish gets WORKER_STOP_TIMEOUT, then is killed."""
        try:
            await asyncio.wait_for(worker.wait_closed(), self.options.stop_timeout)
        except TimeoutError:
            worker.kill("did not stop when asked", expected=True)

    def _tempfail(self, stage: str) -> None:
        now = self.clock()
        running = {name: len(pool.workers) for name, pool in self.pools.items()}
        parallelism = {name: pool.config.parallelism for name, pool in self.pools.items()}
        window = self.options.tempfail_window
        self.caps, halved = backpressure.on_tempfail(
            self.caps, running, parallelism, now=now, window=window
        )
        self.stats.count("backpressure_events")
        if halved is not None:
            log.warning(
                "stage %s: worker out of database connections (75); stage %s limited to %d "
                "workers for %s", stage, halved, self.caps[halved].workers, format_seconds(window),
            )  # fmt: skip

    def deadlines(self) -> list[float]:
        """When tending or a cooled-down stage may next have something to do."""
        now = self.clock()
        times: list[float] = []
        for name, pool in self.pools.items():
            times += decisions.deadlines(
                pool.facts(), pool.rules(self.cap(name, now), self.options)
            )
            if pool.cooldown_until > now:
                times.append(pool.cooldown_until)
        return times

    def idle(self) -> bool:
        """No worker holds a message: the pipeline has gone idle (P-9)."""
        return not any(w.inflight for p in self._all_pools() for w in p.workers.values())

    def held(self) -> list[int]:
        """Claimed ids a worker holds or that wait to run alone."""
        return [
            wid
            for pool in self._all_pools()
            for ids in (*(w.inflight for w in pool.workers.values()), pool.isolate)
            for wid in ids
        ]

    async def shutdown(self) -> None:
        """Stop every worker (SIGTERM, then SIGKILL); what they held goes back."""
        await self.terminate([w for pool in self._all_pools() for w in pool.workers.values()])
        for name, pool in self.pools.items():
            self.ledger.requeue(name, list(pool.isolate))
            pool.isolate.clear()

    # ---- reconfiguration (P-10, P-11) -------------------------------------------

    def reconfigure(self, config: Config) -> list[WorkerProcess]:
        """Take the new stage table; every live worker is to be retired (returned).

        A kept stage keeps its pace and fair-share history; a removed one's
        suspects go back to pending, and its pool stays reachable until its
        workers have exited.
        """
        retiring = [w for pool in self._all_pools() for w in pool.workers.values()]
        for worker in retiring:
            worker.stopping = True  # no new ids from now on
        pools: dict[str, StagePool] = {}
        for name, stage in config.stages.items():
            pool = self.pools.get(name) or self.retired.pop(name, None) or StagePool(stage)
            pool.config = stage
            pools[name] = pool
        for name, pool in self.pools.items():
            if name not in pools:
                self.ledger.requeue(name, list(pool.isolate))
                pool.isolate.clear()
                if pool.workers:
                    self.retired[name] = pool
        self.pools = pools
        return retiring

    def retire_all(self) -> int:
        """Ask every live worker to finish and exit (a new one reads the file afresh)."""
        live = [w for pool in self._all_pools() for w in pool.workers.values() if not w.stopping]
        for worker in live:
            self._stop(worker)
        return len(live)

    async def terminate(self, workers: Sequence[WorkerProcess]) -> None:
        """SIGTERM (then SIGKILL) and wait: what they held is requeued by their exits."""
        await asyncio.gather(*(w.terminate() for w in workers), return_exceptions=True)
        await asyncio.gather(*(w.wait_closed() for w in workers), return_exceptions=True)

    def _pool(self, stage: str) -> StagePool:
        return self.pools.get(stage) or self.retired[stage]

    def _all_pools(self) -> list[StagePool]:
        return [*self.pools.values(), *self.retired.values()]

    # ---- events from workers ----------------------------------------------------

    def on_ready(self, worker: WorkerProcess) -> None:
        log.debug("stage %s: worker pid %s ready", worker.stage, worker.pid)
        self._pool(worker.stage).start_delays = None  # it reached the database: backoff over
        self.wake("worker")  # the stage may start its next worker

    def on_statuses(self, worker: WorkerProcess, answers: list[Answer]) -> None:
        """The status lines of one read of a worker's answers, in order."""
        for _, status in answers:
            if status.report_error:
                log.warning(
                    "stage %s: worker pid %s: %s", worker.stage, worker.pid, status.report_error
                )
        if self.ledger.answered(worker.stage, answers):
            self.tempfail_from = worker.stage  # one halving per cycle, not per id
        # a message finished, paused or failed is no news for a stage found empty
        self.wake("worker", news=any(answer_is_news(status) for _, status in answers))

    def on_answers(self, worker: WorkerProcess, seconds_each: float) -> None:
        """A read of its answers: the stage's pace, which sizes its window (P-6)."""
        self._pool(worker.stage).pace.observe(seconds_each)

    def on_exit(self, worker: WorkerProcess, exit_: decisions.Exit) -> None:
        pool = self._pool(worker.stage)
        pool.workers.pop(worker.key, None)
        if not pool.workers and self.retired.get(worker.stage) is pool:
            del self.retired[worker.stage]  # a removed stage's last worker is gone
        self.stats.count("workers_retired" if exit_.expected else "workers_crashed")
        stage, pid = worker.stage, worker.pid
        match decisions.on_exit(exit_):
            case decisions.Retired(requeue):
                self.ledger.requeue(stage, requeue)
                log.debug("stage %s: worker pid %s stopped", stage, pid)
            case decisions.FailedStart(requeue, cause, database):
                self.ledger.requeue(stage, requeue)
                delay = self._cool_down(pool, database=database)
                log.error(
                    "stage %s: worker pid %s died before ready: %s; %d messages requeued, "
                    "retrying in %s", stage, pid, cause, len(requeue), format_seconds(delay),
                )  # fmt: skip
            case decisions.Struck(wid, kind, requeue):
                reason = f"worker {exit_.reason}"
                self.ledger.struck(stage, wid, kind, reason, pool.config.max_runtime)
                self.ledger.requeue(stage, requeue)
                log.error(
                    "stage %s: worker pid %s %s holding message %d", stage, pid, exit_.reason, wid
                )
            case decisions.Isolate(ids):
                pool.isolate.extend(ids)
                log.error(
                    "stage %s: worker pid %s %s holding %d messages; running each alone",
                    stage, pid, exit_.reason, len(ids),
                )  # fmt: skip
            case decisions.Lost():
                log.warning("stage %s: worker pid %s %s", stage, pid, exit_.reason)
        self.wake("worker")
