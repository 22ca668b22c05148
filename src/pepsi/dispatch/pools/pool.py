"""A stage's pool as the supervisor keeps it: its options, workers, suspects and pace.

`worker_argv` is the command line its workers run (`PROGRAM [-c FILE] worker`).
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pepsi.config import Config, StageConfig
from pepsi.db.backoff import Backoff
from pepsi.dispatch.policy import decisions, pools
from pepsi.dispatch.pools.workers import WorkerProcess, resolve_program


@dataclass(frozen=True)
class PoolOptions:
    dsn: str  # handed to workers as PEPSI_DSN: [pepsi-postgres] WORKER_DSN, else the dispatcher's
    config_file: Path | None  # [pepsi-dispatch] CONFIG_FILE: passed to external programs
    config_path: Path | None  # the file the dispatcher read: the unified program reads it too
    idle_timeout: float  # WORKER_IDLE_TIMEOUT
    ready_timeout: float  # WORKER_READY_TIMEOUT
    stop_timeout: float  # WORKER_STOP_TIMEOUT
    kill_grace: float  # WORKER_KILL_GRACE
    start_cooldown: float  # START_COOLDOWN
    tempfail_window: float  # TEMPFAIL_WINDOW
    reconnect_max: float  # RECONNECT_MAX_DELAY: caps the retries of a worker that found no database

    @classmethod
    def from_config(cls, config: Config, dsn: str) -> PoolOptions:
        d = config.dispatch
        return cls(
            config.postgres.worker_dsn or dsn,  # what workers get as PEPSI_DSN
            d.config_file,
            config.path,
            d.worker_idle_timeout,
            d.worker_ready_timeout,
            d.worker_stop_timeout,
            d.worker_kill_grace,
            d.start_cooldown,
            d.tempfail_window,
            d.reconnect_max_delay,
        )

    @property
    def start_backoff(self) -> Backoff:
        """Retries after a worker died before `ready` for want of a database (exit 74)."""
        return Backoff(min(self.reconnect_max, self.start_cooldown))


@dataclass
class StagePool:
    config: StageConfig
    workers: dict[int, WorkerProcess] = field(default_factory=dict)
    cooldown_until: float = 0.0
    # The delays after workers that found no database (74 before ready), until one is ready.
    start_delays: Iterator[float] | None = None
    # Claimed ids whose worker died with several of them in flight: which one
    # killed it is unknown, so each runs alone on an empty worker (W-6).
    isolate: deque[int] = field(default_factory=deque)
    pace: pools.Pace = field(default_factory=pools.Pace)
    # The window the last claim was sized with. The feed packs with it: answers
    # read while the claim ran may have moved the pace, and a window shrunk in
    # between would send claimed ids straight back (a requeue and a claim more).
    claim_window: int | None = None

    def loads(self, window: int | None = None) -> list[pools.WorkerLoad]:
        """Loads of every live worker: a stopping one still counts toward PARALLELISM."""
        window, budget = window or self.window(), self.config.max_messages
        return [w.load(window, budget) for w in self.workers.values()]

    def facts(self) -> list[decisions.WorkerFacts]:
        return [w.facts() for w in self.workers.values()]

    def window(self) -> int:
        return self.pace.window(self.config.queue_limit)

    def limit(self, cap: int | None) -> int:
        return pools.worker_limit(self.config.parallelism, cap)

    def rules(self, cap: int | None, options: PoolOptions) -> decisions.PoolRules:
        return decisions.PoolRules(
            limit=self.limit(cap),
            max_runtime=self.config.max_runtime,
            max_messages=self.config.max_messages,
            ready_timeout=options.ready_timeout,
            idle_timeout=options.idle_timeout,
        )

    def free(self, now: float, cap: int | None) -> int:
        if now < self.cooldown_until:
            return 0
        self.claim_window = window = self.window()
        free = pools.free_capacity(self.loads(window), self.limit(cap), window)
        return max(0, free - len(self.isolate))


def worker_argv(stage: StageConfig, options: PoolOptions) -> list[str]:
    """`PROGRAM [-c FILE] worker`; FileNotFoundError if PROGRAM is not on PATH."""
    if stage.handler is not None:
        # The unified program; it needs the configuration to find the handler.
        path = options.config_file or options.config_path
        conf = ["-c", str(path)] if path else []
        return [sys.executable, "-m", "pepsi", *conf, "worker"]
    assert stage.program is not None
    conf = ["-c", str(options.config_file)] if options.config_file else []
    return [resolve_program(stage.program), *conf, "worker"]
