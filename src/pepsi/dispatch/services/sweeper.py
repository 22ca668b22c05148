"""The sweeper: paused rows falling due, expiry, and housekeeping (P-8, R-10).

On the poll tick, or when the earliest paused row falls due, it flips the due
paused rows back to pending (and learns when the next one is due) and
dead-letters rows past their TTL. Every STATS_INTERVAL it sweeps the
deduplication window and orphaned message bodies, a bounded slice at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from pepsi.config import Config, StageConfig
from pepsi.db.queries import query
from pepsi.dispatch.stats import Stats

log = logging.getLogger("pepsi.dispatch")
AConn = psycopg.AsyncConnection[tuple[Any, ...]]

EXPIRE_BATCH = 1000  # expired rows dead-lettered per poll tick
DEDUP_BATCH = 10_000  # deduplication entries swept per housekeeping pass
BODY_BATCH = 10_000  # message bodies examined per housekeeping pass


@dataclass(frozen=True)
class SweepOptions:
    poll_interval: float  # POLL_INTERVAL
    housekeeping_interval: float  # STATS_INTERVAL
    dedup_window: float  # [pepsi-ingress] DEDUP_WINDOW
    stages: tuple[StageConfig, ...]
    expire_batch: int = EXPIRE_BATCH
    dedup_batch: int = DEDUP_BATCH
    body_batch: int = BODY_BATCH

    @classmethod
    def from_config(cls, config: Config) -> SweepOptions:
        return cls(
            config.dispatch.poll_interval,
            config.dispatch.stats_interval,
            config.ingress.dedup_window,
            tuple(config.stages.values()),
        )


class Sweeper:
    def __init__(self, options: SweepOptions, stats: Stats, clock: Callable[[], float]) -> None:
        self.options = options
        self.stats = stats
        self.clock = clock
        self.next_poll = 0.0
        self.next_due: float | None = None  # when the earliest paused row is due
        self.next_housekeeping = 0.0
        self.body_cursor = 0  # where the next body sweep starts

    def due_in(self, seconds: float) -> None:
        """A paused row falls due in `seconds`: sweep then (P-8)."""
        due = self.clock() + max(0.0, seconds)
        self.next_due = due if self.next_due is None else min(self.next_due, due)

    def deadlines(self) -> list[float]:
        return [self.next_poll] if self.next_due is None else [self.next_poll, self.next_due]

    async def run_once(self, conn: AConn) -> bool:
        """Whatever is due now: the paused and TTL sweeps, the housekeeping. Whether
        it polled (what no NOTIFY announced, a row deleted by hand, shows then) or rows
        may have become pending (resumed, or dead-lettered to a stage): news for the
        claim, whatever woke the loop (`policy.known_pending`)."""
        now = self.clock()
        made_pending = 0
        polled = now >= self.next_poll
        if polled or (self.next_due is not None and now >= self.next_due):
            made_pending += await self.resume_due(conn)
            made_pending += await self.expire(conn)
            self.next_poll = now + self.options.poll_interval
        if now >= self.next_housekeeping:
            await self.housekeeping(conn)
            self.next_housekeeping = now + self.options.housekeeping_interval
        return polled or made_pending > 0

    async def resume_due(self, conn: AConn) -> int:
        """Paused rows that are due made pending again; how many."""
        row = await (await conn.execute(query("workqueue_resume_due"))).fetchone()
        assert row is not None
        resumed, next_due_in = int(row[0]), row[1]
        if resumed:
            log.info("resumed %d paused rows", resumed)
            self.stats.count("paused_resumed", resumed)
        self.next_due = None
        if next_due_in is not None:
            self.due_in(float(next_due_in))
        return resumed

    async def expire(self, conn: AConn) -> int:
        """R-10: the TTL sweep, on the poll tick rather than in every claim; how many
        rows it dead-lettered."""
        stages = self.options.stages
        row = await (
            await conn.execute(
                query("workqueue_expire"),
                {
                    "stages": [s.name for s in stages],
                    "ttls": [s.ttl for s in stages],
                    "bounces": [s.bounce_stage for s in stages],
                    "max_rows": self.options.expire_batch,
                },
            )
        ).fetchone()
        if row and row[0]:
            log.warning("dead-lettered %d expired messages (TTL)", row[0])
            return int(row[0])
        return 0

    async def housekeeping(self, conn: AConn) -> None:
        """Sweep the dedup window and a slice of orphaned bodies."""
        await conn.execute(
            query("publish_dedup_sweep"),
            {"window": self.options.dedup_window, "max_rows": self.options.dedup_batch},
        )
        row = await (
            await conn.execute(
                query("workqueue_body_gc"),
                {"after_id": self.body_cursor, "max_examined": self.options.body_batch},
            )
        ).fetchone()
        if row is not None:
            if row[0]:
                log.info("collected %d orphaned message bodies", row[0])
                self.stats.count("bodies_collected", int(row[0]))
            self.body_cursor = int(row[1])
