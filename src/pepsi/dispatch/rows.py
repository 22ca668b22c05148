"""The dispatcher's own writes to rows, queued by events and flushed by the loop.

Events from workers (a requeue, a status 74, a crash or hang) arrive in
callbacks; the loop applies them before it claims ("drain internal events
first", P-4), on its one connection. When the database is away they stay
queued: requeues and strikes until it returns, 74 pauses for about
DB_ERROR_PAUSE, after which the row is left running for the reset that
follows a reconnect or a restart (W-4).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import psycopg

from pepsi.config import DispatchOptions
from pepsi.db.queries import query
from pepsi.durations import format_seconds

log = logging.getLogger("pepsi.dispatch")

MAX_STRIKES = 3  # R-8's delivery limit: the third crash or hang ends the message
AConn = psycopg.AsyncConnection[tuple[Any, ...]]


def strike_delays(first: float, max_strikes: int = MAX_STRIKES) -> list[float]:
    """The pause after each strike but the last: STRIKE_DELAY, then twice as long …"""
    return [first * 2**n for n in range(max_strikes - 1)]


@dataclass(frozen=True)
class Strike:
    stage: str
    wid: int
    kind: str  # crashed | timed-out
    reason: str


@dataclass(frozen=True)
class DbPause:
    stage: str
    wid: int
    since: float  # monotonic time of the 74


@dataclass
class RowWriter:
    options: DispatchOptions
    requeues: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    pauses: list[DbPause] = field(default_factory=list)
    strikes: list[Strike] = field(default_factory=list)

    def requeue(self, stage: str, ids: Any) -> None:
        self.requeues[stage].extend(ids)

    def pause_db(self, stage: str, wid: int, now: float) -> None:
        self.pauses.append(DbPause(stage, wid, now))

    def strike(self, stage: str, wid: int, kind: str, reason: str) -> None:
        self.strikes.append(Strike(stage, wid, kind, reason))

    def held(self) -> list[int]:
        """Rows still running that this writer will settle."""
        return [i for ids in self.requeues.values() for i in ids] + [p.wid for p in self.pauses]

    def __bool__(self) -> bool:
        return bool(self.requeues or self.pauses or self.strikes)

    async def flush(self, conn: AConn, now: float) -> float | None:
        """Apply what is queued; return the soonest pause written (seconds), if any.

        Each batch is taken off the queues before its write is awaited, so
        events that arrive meanwhile wait for the next flush instead of being
        dropped; a batch whose write fails goes back to its queue.
        """
        soonest: float | None = None
        delays = strike_delays(self.options.strike_delay)
        while self.strikes:
            strike = self.strikes.pop(0)
            try:
                row = await (
                    await conn.execute(
                        query("workqueue_strike"),
                        {"id": strike.wid, "stage": strike.stage, "kind": strike.kind,
                         "reason": strike.reason, "delays": delays, "max_strikes": MAX_STRIKES},
                    )
                ).fetchone()  # fmt: skip
            except BaseException:  # unwritten: it waits for the next flush
                self.strikes.insert(0, strike)
                raise
            n = int(row[0]) if row else 0
            if n >= MAX_STRIKES:
                log.error(
                    "stage %s: message %d %s three times: %s",  # docs/failures.md
                    strike.stage,
                    strike.wid,
                    strike.kind,
                    "failed" if strike.kind == "crashed" else "timeout",
                )
            elif n:
                log.warning(
                    "stage %s: message %d strike %d (%s); retry in %s",
                    strike.stage,
                    strike.wid,
                    n,
                    strike.reason,
                    format_seconds(delays[n - 1]),
                )
                soonest = delays[n - 1] if soonest is None else min(soonest, delays[n - 1])
        pauses, self.pauses = self.pauses, []
        by_stage: dict[str, list[DbPause]] = defaultdict(list)
        for pause in pauses:
            by_stage[pause.stage].append(pause)
        for stage, items in by_stage.items():
            seconds = self.options.db_error_pause
            try:
                await conn.execute(
                    query("workqueue_pause_if_running"),
                    {"ids": [p.wid for p in items], "stage": stage, "seconds": seconds,
                     "reason": "database connection lost while processing"},
                )  # fmt: skip
            except BaseException:
                self.pauses.extend(pauses)  # this stage's and those not yet written
                raise
            pauses = [p for p in pauses if p.stage != stage]
            log.warning(
                "stage %s: %d messages paused %s (database connection lost)",
                stage,
                len(items),
                format_seconds(seconds),
            )
            soonest = seconds if soonest is None else min(soonest, seconds)
        while self.requeues:
            stage, ids = self.requeues.popitem()
            try:
                await conn.execute(query("workqueue_requeue_running"), {"ids": ids, "stage": stage})
            except BaseException:
                self.requeues[stage].extend(ids)
                raise
        return soonest

    def give_up_pauses(self, now: float) -> None:
        """While the database is away: forget 74 pauses older than about DB_ERROR_PAUSE."""
        expired = [p for p in self.pauses if now - p.since > self.options.db_error_pause]
        if expired:
            log.error(
                "could not pause %d messages while the database was away; they stay "
                "running until the dispatcher reconnects or restarts",
                len(expired),
            )
            self.pauses = [p for p in self.pauses if p not in expired]
