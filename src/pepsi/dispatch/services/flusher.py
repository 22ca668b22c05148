"""The stats flusher: the counted deltas go to the database in one statement (P-9).

Due every STATS_INTERVAL, or when the pipeline has gone idle (at most once
every IDLE_FLUSH_GAP), and once more at shutdown. With nothing counted it
writes nothing, so an idle dispatcher does no statistics work.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import psycopg

from pepsi.db.queries import query
from pepsi.dispatch.stats import Stats

AConn = psycopg.AsyncConnection[tuple[Any, ...]]

IDLE_FLUSH_GAP = 1.0  # seconds: an idle pipeline's counters are written this soon


class StatsFlusher:
    def __init__(
        self, stats: Stats, interval: float, started_at: datetime, clock: Callable[[], float]
    ) -> None:
        self.stats = stats
        self.interval = interval
        self.started_at = started_at
        self.clock = clock
        self.last_flush = 0.0
        self.next_flush = clock() + interval

    def due(self, idle: bool) -> bool:
        """Something was counted, and the tick came or the pipeline went idle."""
        now = self.clock()
        return bool(self.stats) and (
            now >= self.next_flush or (idle and now - self.last_flush >= IDLE_FLUSH_GAP)
        )

    def deadlines(self, idle: bool) -> list[float]:
        if not self.stats:
            return []
        if idle:  # while busy, that deadline would wake the loop in a spin
            return [self.next_flush, self.last_flush + IDLE_FLUSH_GAP]
        return [self.next_flush]

    async def run_once(self, conn: AConn, *, final: bool = False) -> None:
        """One statement; nothing at all when nothing was counted.

        Wakeups alone make no flush due, but the final one writes them too.
        """
        now = self.clock()
        self.last_flush = now
        self.next_flush = now + self.interval
        if self.stats.empty() if final else not self.stats:
            return
        params = self.stats.take()
        await conn.execute(query("stats_flush"), {**params, "started": self.started_at})
