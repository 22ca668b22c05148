"""The failure bouncer: the dead-letter sink of stages without a BOUNCE_STAGE.

Their failed and timed-out messages move to `[pepsi-failure-bouncer] SINK`:
a stage (pending there, with `state.bounced_from`) or, by default, the table
`pepsi.dead_letter`, where an operator finds the whole message. A service in
the dispatcher's style: `run_once()` is one pass, `run()` repeats it every
INTERVAL until stopped, riding out a database that comes and goes: while it
is away, passes are retried on the reconnect backoff (`pepsi.db.backoff`,
capped by RECONNECT_MAX_DELAY or INTERVAL, whichever is shorter), so the
first pass after a failover comes within that cap.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from pepsi.config import Config
from pepsi.db import connect, schema
from pepsi.db.backoff import DEFAULT_CAP, Backoff
from pepsi.db.queries import query
from pepsi.durations import format_seconds
from pepsi.errors import DatabaseUnavailable, classify

log = logging.getLogger("pepsi.failure-bouncer")
APPLICATION_NAME = "pepsi-failure-bouncer"
BATCH = 1000  # rows per statement: a large backlog moves in short transactions


def bounce_once(
    conn: psycopg.Connection[Any], stages: Sequence[str], sink: str | None, batch: int = BATCH
) -> int:
    """Move everything there is, `batch` rows at a time; return how many moved."""
    total = 0
    while True:
        row = conn.execute(
            query("workqueue_bounce_failed"),
            {"stages": list(stages), "sink": sink, "max_rows": batch},
        ).fetchone()
        moved = int(row[0]) if row else 0
        total += moved
        if moved < batch:
            return total


@dataclass(frozen=True)
class BouncerSettings:
    stages: tuple[str, ...]  # whose failures move: no BOUNCE_STAGE, and not the sink itself
    sink: str | None  # a stage, or None: the table pepsi.dead_letter
    interval: float  # seconds between passes
    batch: int = BATCH
    reconnect_max: float = DEFAULT_CAP  # [pepsi-dispatch] RECONNECT_MAX_DELAY

    @classmethod
    def from_config(cls, config: Config) -> BouncerSettings:
        sink = config.bouncer.sink
        stages = (s.name for s in config.stages.values() if s.bounce_stage is None)
        return cls(
            tuple(s for s in stages if s != sink),
            sink,
            config.bouncer.interval,
            reconnect_max=config.dispatch.reconnect_max_delay,
        )

    @property
    def backoff(self) -> Backoff:
        """Retries while the database is away: never slower than a pass every INTERVAL."""
        return Backoff(min(self.reconnect_max, self.interval))

    @property
    def where(self) -> str:
        return f"stage {self.sink}" if self.sink else "table pepsi.dead_letter"


class Bouncer:
    """One connection per pass, so a restarted server costs one pass, not the service."""

    def __init__(self, settings: BouncerSettings, dsn: str, *, connect_timeout: float) -> None:
        self.settings = settings
        self.dsn = dsn
        self.connect_timeout = connect_timeout

    def check(self) -> None:
        """At start: the database answers and has this build's schema (else its error)."""
        with connect.connect(
            self.dsn, timeout=self.connect_timeout, application_name=APPLICATION_NAME
        ) as conn:
            schema.require_current(conn)

    def run_once(self) -> int:
        """One pass: how many messages moved; DatabaseUnavailable if it could not run."""
        try:
            with connect.connect(
                self.dsn, timeout=self.connect_timeout, application_name=APPLICATION_NAME
            ) as conn:
                moved = bounce_once(
                    conn, self.settings.stages, self.settings.sink, self.settings.batch
                )
        except psycopg.Error as exc:  # the connect's own errors are domain errors already
            error = classify(exc)
            if error is None:
                raise
            raise error from None
        if moved:
            log.warning("moved %d failed messages to %s", moved, self.settings.where)
        return moved

    def run(self, stop: threading.Event, rng: Callable[[], float] = random.random) -> None:
        """A pass every interval until `stop` is set; while the database is away, sooner."""
        retries: Iterator[float] | None = None  # the backoff of the outage under way
        while True:
            try:
                self.run_once()
            except DatabaseUnavailable as exc:
                if retries is None:
                    retries = self.settings.backoff.delays(rng)
                wait = next(retries)
                log.warning("database unavailable (%s); retrying in %s", exc, format_seconds(wait))
            else:
                if retries is not None:
                    log.info("database connection restored")
                retries, wait = None, self.settings.interval
            if stop.wait(wait):
                return
