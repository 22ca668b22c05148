"""The in-flight ledger: every claimed row is settled here, in one call.

A claimed row ends in one of four ways as far as the dispatcher is
concerned: its worker answers it, it goes back to pending without running
(requeued), its worker dies or hangs holding it (a strike), or its worker
lost the database (74: paused). Each way touches three books at once: the
row itself (queued in the row writer for the loop to flush), the statistics
(P-9) and the sender's fair-share charge (P-5). Keeping the three together
here is what lets every caller settle a row with one call and no book be
forgotten.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from pepsi.dispatch.policy.fairness import FairShare
from pepsi.dispatch.rows import RowWriter
from pepsi.dispatch.stats import Stats
from pepsi.errors import EX_IOERR, EX_TEMPFAIL
from pepsi.protocol import Answer

log = logging.getLogger("pepsi.dispatch")


class Claimed(NamedTuple):
    """One row a claim took (a tuple: built per claimed row)."""

    wid: int
    stage: str
    sender: str | None = None  # known to the fair claim only
    row: bytes | None = None  # the row itself, for a worker that takes rows (small claims)
    delivery: tuple[Any, ...] | None = None  # an AMQP row as basic.deliver sends it (same)


class InFlight:
    def __init__(
        self, rows: RowWriter, stats: Stats, fair: FairShare | None, clock: Callable[[], float]
    ) -> None:
        self.rows = rows
        self.stats = stats
        self.fair = fair
        self.clock = clock
        self.claimed_total = 0
        self.answered_total = 0  # status lines: the stage passes, for the vacuum's pace

    def claimed(self, rows: Iterable[Claimed]) -> None:
        """A claim took these rows: counted, and each sender debited (P-5)."""
        n = 0
        for row in rows:
            n += 1
            if self.fair is not None and row.sender is not None:
                self.fair.ledger(row.stage).claim(row.wid, row.sender)
        if n:
            # Only claims that took rows are counted: an idle poll tick must not
            # leave a delta behind, or every tick would be followed by a flush.
            self.claimed_total += n
            self.stats.count("claims")
            self.stats.count("claimed", n)

    def claimed_direct(self, count: int) -> None:
        """An AMQP publish wrote `count` rows running for waiting consumers: claimed
        without a claim (no sender debited: nothing was pending for the stage)."""
        self.claimed_total += count
        self.stats.count("claimed", count)

    def requeue(self, stage: str, ids: Iterable[int]) -> None:
        """Back to pending without having run: the sender's debit is refunded."""
        ids = list(ids)
        if not ids:
            return
        self.rows.requeue(stage, ids)
        self.stats.stage(stage, "requeued", len(ids))
        if self.fair is not None:
            ledger = self.fair.ledger(stage)
            for wid in ids:
                ledger.refund(wid)

    def returned(self, stage: str, ids: list[int]) -> None:
        """AMQP consumers gave these back (or never got them): pending again, refunded."""
        self.stats.stage(stage, "requeued", len(ids))
        if self.fair is not None:
            ledger = self.fair.ledger(stage)
            for wid in ids:
                ledger.refund(wid)

    def consumed(self, stage: str, ids: list[int]) -> None:
        """AMQP consumers settled these for good (acked or dead-lettered): a stage pass
        each, charged what the claim debited (a consumer reports no time)."""
        self.answered_total += len(ids)
        self.stats.stage(stage, "processed", len(ids))
        if self.fair is not None:
            ledger = self.fair.ledger(stage)
            for wid in ids:
                ledger.report(wid, None)

    def answered(self, stage: str, answers: Iterable[Answer]) -> bool:
        """Its worker's status lines for these ids; True if one said 75 (W-5:
        back-pressure). Handed over a read at a time: one call, not one per message."""
        tempfail = False
        fair = None if self.fair is None else self.fair.ledger(stage)
        n = 0
        for wid, status in answers:
            n += 1
            report = status.report
            if fair is not None:
                if report is None:
                    fair.report(wid, None)
                else:
                    fair.report(wid, sum(p.micros for p in report) / 1_000_000)
            code = status.status
            if code == EX_IOERR:  # W-4: the worker lost the database; not a pass
                self.rows.pause_db(stage, wid, self.clock())
            elif code == EX_TEMPFAIL:  # W-5: connection limit exhausted; not a pass
                self.requeue(stage, [wid])
                tempfail = True
            else:
                self.stats.passes(stage, code == 0, report)
                if code != 0:
                    log.info("stage %s: message %d ended with status %d", stage, wid, code)
        self.answered_total += n
        self.stats.count("stages_executed", n)
        return tempfail

    def struck(self, stage: str, wid: int, kind: str, reason: str, max_runtime: float) -> None:
        """Its worker crashed or hung holding it (W-6): a strike, and the charge for it.

        A hung message used its worker for MAX_RUNTIME; a crashed one keeps
        the debit it was claimed with.
        """
        if self.fair is not None:
            ledger = self.fair.ledger(stage)
            if kind == "timed-out":
                ledger.timed_out(wid, max_runtime)
            else:
                ledger.report(wid, None)
        self.rows.strike(stage, wid, kind, reason)
        self.stats.stage(stage, "strikes")
        if kind == "timed-out":
            self.stats.stage(stage, "timed_out")

    def held(self) -> list[int]:
        """Rows still running that the row writer will settle."""
        return self.rows.held()
