"""The dispatcher's own writes to rows, queued by events and flushed by the loop.

Events from workers (a requeue, a status 74, a crash or hang) arrive in
callbacks; the loop applies them before it claims ("drain internal events
first", P-4), on its one connection. When the database is away they stay
queued: requeues and strikes until it returns, 74 pauses for about
DB_ERROR_PAUSE, after which the row is left running for the reset that
follows a reconnect or a restart (W-4).

A 74 pause (DB_ERROR_PAUSE, the manual's 30 s) keeps a stage from hammering
a database that is down. Once the dispatcher has seen the database back (its
own reconnect), that reason is gone: the pauses it still holds become
requeues, the 74 pauses already written are resumed (`database_back`), and
for DB_ERROR_PAUSE after it a 74 pauses only RECONNECT_MAX_DELAY
(`pause_after_74`): a worker that lost its connection in the failover
reconnects before its next batch. Pepsi's share of a failover is then about a
second, not DB_ERROR_PAUSE.
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
DB_LOST = "database connection lost while processing"  # a 74 pause's last_error
AConn = psycopg.AsyncConnection[tuple[Any, ...]]


def pause_after_74(options: DispatchOptions, now: float, back_at: float | None) -> float:
    """How long a message whose worker lost the database pauses: DB_ERROR_PAUSE, or
    RECONNECT_MAX_DELAY within DB_ERROR_PAUSE of the dispatcher seeing the database back."""
    if back_at is not None and now - back_at < options.db_error_pause:
        return min(options.reconnect_max_delay, options.db_error_pause)
    return options.db_error_pause


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
    back_at: float | None = None  # when the dispatcher last saw the database come back

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
            seconds = pause_after_74(self.options, now, self.back_at)
            try:
                await conn.execute(
                    query("workqueue_pause_if_running"),
                    {"ids": [p.wid for p in items], "stage": stage, "seconds": seconds,
                     "reason": DB_LOST},
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

    async def database_back(self, conn: AConn, now: float) -> None:
        """The dispatcher has the database again (a reconnect): what paused for its absence
        goes on now. Queued 74 pauses become requeues; written ones are resumed."""
        self.back_at = now
        held, self.pauses = self.pauses, []
        for pause in held:
            self.requeues[pause.stage].append(pause.wid)
        cur = await conn.execute(
            query("workqueue_resume_db_paused"),
            {"reason": DB_LOST, "within": self.options.db_error_pause},
        )
        resumed = len(held) + max(cur.rowcount, 0)
        if resumed:
            log.info(
                "%d messages whose workers lost the database go on now (the database is back)",
                resumed,
            )

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
