"""Fair scheduling between senders (P-5). Pure: the clock is injected.

Per stage, each sender has a lag: the worker time its messages consumed
beyond the least-served waiting sender. A claimed message is debited the
stage's average time per message at once, corrected to the measured time
when its worker reports, refunded if it goes back without running; a
timed-out one is debited MAX_RUNTIME. Lags halve every FAIR_HALF_LIFE, a lag
under one message's worth is forgotten, and a sender the ledger does not
know starts level with the least served (lag 0): silence buys no credit.

The claim ranks the k-th oldest pending row of a sender with lag L at
L + k × average, lowest first (ties: oldest row first), after giving
FAIR_FIFO_PERCENT of the stage's slots to its oldest rows whatever the
sender. `rank` is that choice in Python; `pepsi.workqueue_claim_fair` makes
the same choice in SQL, and the tests hold the two to each other.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_AVERAGE = 0.01  # seconds per message before any report: a small start
AVERAGE_WEIGHT = 0.1  # weight of the newest measurement in the running average
DECAY_STEP = 0.1  # seconds: lags are decayed and levelled at most this often
LAGS_SENT = 256  # lags sent with a claim: those of the senders after the window's start


def rank(
    pending: Mapping[str, Sequence[int]],
    lags: Mapping[str, float],
    average: float,
    cap: int,
    fifo: int,
) -> list[int]:
    """Which pending ids a claim of `cap` slots takes; `pending` maps senders to ids."""
    every = sorted(i for ids in pending.values() for i in ids)
    chosen = every[: min(fifo, cap)]
    taken = set(chosen)
    candidates: list[tuple[float, int]] = []
    for sender, ids in pending.items():
        lag = lags.get(sender, 0.0)
        oldest = sorted(ids)[:cap]
        candidates.extend((lag + k * average, i) for k, i in enumerate(oldest, start=1))
    for _, i in sorted(candidates):
        if len(chosen) >= cap:
            break
        if i not in taken:
            chosen.append(i)
            taken.add(i)
    return chosen


@dataclass
class StageLedger:
    """The lags of one stage's senders, and what each claimed message was debited."""

    half_life: float
    average: float = DEFAULT_AVERAGE
    lags: dict[str, float] = field(default_factory=dict)
    debits: dict[int, tuple[str, float]] = field(default_factory=dict)
    decayed_at: float = 0.0
    fifo_credit: float = 0.0
    _sorted: list[str] = field(default_factory=list, repr=False)  # lags' keys, in order
    _sorted_for: dict[str, float] | None = field(default=None, repr=False)

    def decay(self, now: float) -> None:
        """Halve lags every half-life; forget those under one message; level the least.

        At most every DECAY_STEP: a claim every few milliseconds would rebuild
        thousands of senders' lags for factors of 0.9999. In between, debits
        only add up, which shifts no sender's rank against another's.
        """
        elapsed = now - self.decayed_at
        if elapsed < DECAY_STEP:
            return
        if self.lags:
            factor = 0.5 ** (elapsed / self.half_life)
            self.lags = {s: lag * factor for s, lag in self.lags.items()}
        self.decayed_at = now
        self._normalise()

    def _normalise(self) -> None:
        if not self.lags:
            return
        least = min(self.lags.values())
        self.lags = {s: lag - least for s, lag in self.lags.items() if lag - least >= self.average}

    def claim(self, wid: int, sender: str) -> None:
        self.lags[sender] = self.lags.get(sender, 0.0) + self.average
        self.debits[wid] = (sender, self.average)

    def report(self, wid: int, seconds: float | None) -> None:
        """The worker measured `seconds` for it (None: no report, the debit stands)."""
        if seconds is None:
            debit = self.debits.get(wid)
            seconds = debit[1] if debit else 0.0
        else:
            self.average += AVERAGE_WEIGHT * (max(seconds, 0.0) - self.average)
        self._settle(wid, seconds)

    def refund(self, wid: int) -> None:
        """It went back to pending without running."""
        self._settle(wid, 0.0)

    def timed_out(self, wid: int, max_runtime: float) -> None:
        self._settle(wid, max_runtime)

    def _settle(self, wid: int, seconds: float) -> None:
        debit = self.debits.pop(wid, None)
        if debit is None:
            return
        sender, charged = debit
        self.lags[sender] = self.lags.get(sender, 0.0) + seconds - charged

    def lags_after(self, start: str, count: int = LAGS_SENT) -> dict[str, float]:
        """The lags of the `count` senders that sort after `start` (wrapping around).

        The claim looks at most 64 pending senders from there on; with
        thousands of senders in the ledger, sending every lag with every claim
        was a quarter of the dispatcher's time. A pending sender further on
        than `count` lagged senders would rank as level with the least served
        for that claim.
        """
        if len(self.lags) <= count:
            return self.lags
        if self._sorted_for is not self.lags or len(self._sorted) != len(self.lags):
            self._sorted, self._sorted_for = sorted(self.lags), self.lags
        keys = self._sorted
        first = bisect.bisect_right(keys, start)
        chosen = keys[first : first + count]
        chosen += keys[: count - len(chosen)]
        return {key: self.lags[key] for key in chosen}

    def fifo_slots(self, cap: int, percent: int) -> int:
        """Slots of this claim reserved for the oldest rows; fractions carry over."""
        self.fifo_credit += cap * percent / 100
        slots = min(cap, math.floor(self.fifo_credit))
        self.fifo_credit -= slots
        return slots


@dataclass
class FairShare:
    """Every stage's ledger; what the claim statement needs, as arrays."""

    half_life: float
    fifo_percent: int
    clock: Callable[[], float]
    stages: dict[str, StageLedger] = field(default_factory=dict)
    window: dict[str, str] = field(default_factory=dict)  # sender window start per stage

    def ledger(self, stage: str) -> StageLedger:
        if stage not in self.stages:
            self.stages[stage] = StageLedger(self.half_life, decayed_at=self.clock())
        return self.stages[stage]

    def claim_params(self, caps: Mapping[str, int]) -> dict[str, Any]:
        now = self.clock()
        stages: list[str] = []
        fifo: list[int] = []
        averages: list[float] = []
        starts: list[str] = []
        lags: dict[str, dict[str, float]] = {}
        for stage, cap in caps.items():
            ledger = self.ledger(stage)
            ledger.decay(now)
            stages.append(stage)
            fifo.append(ledger.fifo_slots(cap, self.fifo_percent))
            averages.append(ledger.average)
            start = self.window.get(stage, "")
            starts.append(start)
            if ledger.lags:
                lags[stage] = ledger.lags_after(start)
        return {
            "stages": stages,
            "caps": [caps[s] for s in stages],
            "fifo": fifo,
            "averages": averages,
            "starts": starts,
            "lags": lags,  # {stage: {sender: seconds}}: sent as one JSON object
        }
