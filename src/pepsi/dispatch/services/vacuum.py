"""Vacuuming the queue at the pace of its traffic.

Every message leaves dead tuples behind: the old version of its claim and its
finished (or advanced) row. Autovacuum visits a database at most once per
`autovacuum_naptime` (a minute by default), so at thousands of messages a
second a million dead tuples piled up between its passes: claims walked dead
index entries and throughput sawed between 9.5 k and 5.7 k msg/s over two
minutes (docs/performance.md). The dispatcher knows how much traffic passed:
after VACUUM_AFTER stage passes it runs `VACUUM (SKIP_LOCKED)` on the queue
tables, in the background on a connection of its own, so frequent small
passes keep the tables and their indexes small. Nothing runs while the
pipeline is idle (P-9), and a pass autovacuum is already making is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import psycopg

from pepsi.db.connect import connect_async
from pepsi.db.queries import query
from pepsi.errors import DatabaseUnavailable, one_line

log = logging.getLogger("pepsi.dispatch")
AConn = psycopg.AsyncConnection[tuple[Any, ...]]


@dataclass
class Vacuum:
    """Runs one VACUUM at a time, every `after` stage passes (0: never)."""

    dsn: str
    after: int
    connect_timeout: float  # [pepsi-postgres] CONNECT_TIMEOUT
    started_at: int = 0  # the pass count when the last run started
    runs: int = 0
    task: asyncio.Task[None] | None = None
    conn: AConn | None = None

    def due(self, passes: int) -> bool:
        return self.after > 0 and self.task is None and passes - self.started_at >= self.after

    def maybe_start(self, passes: int) -> None:
        """Start a run in the background if `passes` make one due."""
        if self.due(passes):
            self.started_at = passes
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            seconds = await self.run_once()
            log.debug("vacuumed the queue tables in %.0f ms", seconds * 1000)
        except (psycopg.Error, DatabaseUnavailable) as exc:  # the next run reconnects
            log.warning("vacuum of the queue tables failed: %s", one_line(exc))
            await self._close_connection()
        finally:
            self.task = None

    async def run_once(self) -> float:
        """One VACUUM of the queue tables; its duration in seconds."""
        if self.conn is None or self.conn.closed:
            self.conn = await connect_async(
                self.dsn, application_name="pepsi-dispatch-vacuum", timeout=self.connect_timeout
            )
        started = time.monotonic()
        # a utility statement: never prepared
        await self.conn.execute(query("workqueue_vacuum"), prepare=False)
        self.runs += 1
        return time.monotonic() - started

    async def close(self) -> None:
        """At shutdown: let a run in progress finish (it is short), then disconnect."""
        if self.task is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError, psycopg.Error):
                await asyncio.wait_for(asyncio.shield(self.task), 10.0)
        await self._close_connection()

    async def _close_connection(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(psycopg.Error):
                await self.conn.close()
            self.conn = None
