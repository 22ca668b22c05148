"""`pepsi top`'s arithmetic: from successive reads to one frame of the view.

Pure: no I/O and no rich, so the rates are tested without a database.
`pepsi.admin.watch.activity` reads a `Sample` per refresh and turns it into the
`Frame` this module computes; `pepsi.commands.operate.top_cmd` (and, later, the web
console) renders it.

Counts are read live at each refresh; rates cannot be. The dispatcher writes
its counters every STATS_INTERVAL and when it goes idle, so a difference
between two refreshes reads 0/s for a minute and then a whole minute's work
at once. A rate is therefore taken between the last two flushes the view has
seen, by their own timestamps (`dispatch_stats.updated`, the server's clock):
an average over the last flush window, steady under steady load. A busy
dispatcher flushes at least every STATS_INTERVAL, so when no flush came for
longer than that while it ran (or it does not run), nothing was counted
since: the rates are 0.

Fresher rates come from the dispatcher's live snapshots (`NOTIFY pepsi_live`,
read by `pepsi.admin.watch.live`): while it is heard from, `with_live` puts their
rates (over the last 10 s, taken every second) in place of the flush rates, and
the frame says which source it shows (`rates_source`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pepsi.admin import serving

if TYPE_CHECKING:
    from pepsi.admin.horizon import Holder
    from pepsi.admin.watch.live import LiveView

FLUSH_SLACK = 2.0  # seconds past STATS_INTERVAL before a missing flush means "idle"
# Counting a large queue is a scan (about 0.3 s for a million rows): it may take at
# most a tenth of the time between two counts, so the view never loads the database.
COUNTS_BUDGET = 10


@dataclass(frozen=True)
class StageCounters:
    """One row of `pepsi.stage_stats`; a stage without a row counts zero."""

    processed: int = 0
    failed: int = 0
    finished: int = 0
    advanced: int = 0
    retries: int = 0
    strikes: int = 0


RATED = ("processed", "failed", "finished", "advanced", "retries")  # shown per second
STATS = "stats"  # Frame.rates_source: between the last two statistics flushes
LIVE = "live"  # from the dispatcher's live snapshots
RECENT = "recent"  # before a second flush: the last minutes' counts (stage_stats_minute)


@dataclass(frozen=True)
class DispatchCounters:
    """The row of `pepsi.dispatch_stats`; zeros and no `updated` before the first flush."""

    claims: int = 0
    claimed: int = 0
    updated: datetime | None = None


@dataclass(frozen=True)
class Sample:
    """What one refresh read."""

    now: datetime  # the server's clock, so the flush age does not depend on the client's
    counts: Mapping[str, Mapping[str, int]]  # stage -> status -> rows
    stage_stats: Mapping[str, StageCounters]
    dispatch: DispatchCounters
    workers: Mapping[str, int]  # stage -> connected worker processes
    dispatcher_pid: int | None  # the backend holding the dispatcher's lock, None: not running
    dispatcher_since: datetime | None = None  # when that backend connected
    counts_age: float = 0.0  # seconds since `counts` were read (a slow count is not redone)
    horizon: Holder | None = None  # the oldest transaction holding back vacuum
    serves: frozenset[str] | None = None  # the stages the dispatcher serves; None: not known
    # the last minutes' (processed, failed) per stage, and since when: rates before two flushes
    recent: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    recent_since: datetime | None = None


@dataclass(frozen=True)
class StageRow:
    stage: str
    backlog: int  # pending
    running: int  # in flight: claimed by the dispatcher, at a worker
    paused: int
    failed: int
    timeout: int
    workers: int
    rates: Mapping[str, float | None]  # RATED -> per second; None: not known (yet)
    strikes: int  # cumulative, from stage_stats
    retries: int


@dataclass(frozen=True)
class Frame:
    now: datetime
    window: float | None  # seconds the rates average over; None: no rates yet
    dispatcher_pid: int | None
    claims_rate: float | None  # claim statements per second
    claimed_rate: float | None  # rows claimed per second
    last_flush: datetime | None
    stages: tuple[StageRow, ...] = field(default=())
    counts_age: float = 0.0
    horizon: Holder | None = None  # the oldest transaction holding back vacuum
    rates_source: str = STATS  # STATS or LIVE
    unserved: tuple[tuple[str, int], ...] = ()  # (stage, pending) the dispatcher does not serve

    @property
    def dispatcher_running(self) -> bool:
        return self.dispatcher_pid is not None

    @property
    def flush_age(self) -> float | None:
        """Seconds since the dispatcher last wrote its counters."""
        if self.last_flush is None:
            return None
        return max(0.0, (self.now - self.last_flush).total_seconds())

    def as_dict(self) -> dict[str, Any]:
        """The frame as JSON-ready data (datetimes as ISO 8601 text)."""
        age = self.flush_age
        return {
            "time": self.now.isoformat(),
            "rate_window_s": _round(self.window),
            "rates_source": self.rates_source,
            "counts_age_s": _round(self.counts_age),
            "dispatcher": {
                "running": self.dispatcher_running,
                "pid": self.dispatcher_pid,
                "claims_per_s": _round(self.claims_rate),
                "claimed_per_s": _round(self.claimed_rate),
                "last_flush": None if self.last_flush is None else self.last_flush.isoformat(),
                "flush_age_s": _round(age),
            },
            "unserved": [{"stage": stage, "pending": n} for stage, n in self.unserved],
            "stages": [
                {
                    "stage": row.stage,
                    "backlog": row.backlog,
                    "running": row.running,
                    "paused": row.paused,
                    "failed": row.failed,
                    "timeout": row.timeout,
                    "workers": row.workers,
                    "rates": {name: _round(value) for name, value in row.rates.items()},
                    "strikes": row.strikes,
                    "retries": row.retries,
                }
                for row in self.stages
            ],
            "oldest_transaction": None if self.horizon is None else self.horizon.as_dict(),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def rate(before: int, after: int, elapsed: float | None) -> float | None:
    """Per-second change of a counter; None when unknown.

    A counter that went backwards was reset (the stats row deleted or the
    table truncated): how much it rose since is unknown, so no rate rather
    than a negative one.
    """
    if elapsed is None or elapsed <= 0 or after < before:
        return None
    return (after - before) / elapsed


def all_stages(current: Sample, configured: list[str]) -> list[str]:
    """The configured stages in their order, then any other stage the tables name."""
    seen = set(configured)
    found = set(current.counts) | set(current.stage_stats) | set(current.workers)
    return [*configured, *sorted(found - seen)]


def counts_due(read_at: float | None, took: float, now: float, interval: float) -> bool:
    """Whether this refresh counts the queue again: every refresh while counting is
    cheap, else once COUNTS_BUDGET times its last duration has passed."""
    if read_at is None or COUNTS_BUDGET * took <= interval:
        return True
    return now - read_at >= COUNTS_BUDGET * took


def anchors(seen: Sequence[Sample], current: Sample) -> tuple[Sample, ...]:
    """The last two samples that saw distinct flushes: the rates' window."""
    flushed = current.dispatch.updated
    if flushed is None or (seen and seen[-1].dispatch.updated == flushed):
        return tuple(seen)
    return (*seen[-1:], current)


def frame(
    seen: Sequence[Sample], current: Sample, stages: list[str], stats_interval: float
) -> Frame:
    """One view: counts from `current`, rates over the flush window in `seen` (see above)."""
    quiet = _quiet_for(current)
    idle = quiet is not None and quiet > stats_interval + FLUSH_SLACK
    first, last = (seen[-2], seen[-1]) if len(seen) >= 2 else (current, current)
    window: float | None = None
    if idle:
        window = quiet if quiet is not None and quiet != float("inf") else None
    elif len(seen) >= 2:
        window = (_flushed(last) - _flushed(first)).total_seconds()

    def per_second(counter: Callable[[Sample], int]) -> float | None:
        if idle:
            return 0.0  # nothing was counted since the last flush
        return None if len(seen) < 2 else rate(counter(first), counter(last), window)

    # Before a second flush (top just started, or the dispatcher flushed once after a
    # burst): the last minutes' counts, so that something useful shows at once.
    recent = not idle and len(seen) < 2 and current.recent_since is not None
    if recent:
        assert current.recent_since is not None
        window = max((current.now - current.recent_since).total_seconds(), 1.0)

    def stage_rate(stage: str, name: str) -> float | None:
        if not recent:
            return per_second(_stage_counter(stage, name))
        if name not in ("processed", "failed"):
            return None  # the minutes keep these two
        processed, failed = current.recent.get(stage, (0, 0))
        assert window is not None
        return (processed if name == "processed" else failed) / window

    rows = []
    for stage in all_stages(current, stages):
        counts = current.counts.get(stage, {})
        now = current.stage_stats.get(stage, StageCounters())
        rows.append(
            StageRow(
                stage=stage,
                backlog=counts.get("pending", 0),
                running=counts.get("running", 0),
                paused=counts.get("paused", 0),
                failed=counts.get("failed", 0),
                timeout=counts.get("timeout", 0),
                workers=current.workers.get(stage, 0),
                rates={name: stage_rate(stage, name) for name in RATED},
                strikes=now.strikes,
                retries=now.retries,
            )
        )
    return Frame(
        now=current.now,
        window=window,
        dispatcher_pid=current.dispatcher_pid,
        claims_rate=per_second(lambda item: item.dispatch.claims),
        claimed_rate=per_second(lambda item: item.dispatch.claimed),
        last_flush=current.dispatch.updated,
        stages=tuple(rows),
        counts_age=current.counts_age,
        horizon=current.horizon,
        rates_source=RECENT if recent else STATS,
        unserved=tuple(
            serving.unserved(
                {stage: c.get("pending", 0) for stage, c in current.counts.items()},
                current.serves,
                running=current.dispatcher_pid is not None,
            )
        ),
    )


def with_live(item: Frame, live: LiveView) -> Frame:
    """The frame with the live snapshots' rates, when they have some; else as it is."""
    if not live.available:
        return item
    rows = tuple(
        replace(row, rates={name: live.rate(row.stage, name) for name in RATED})
        for row in item.stages
    )
    return replace(
        item,
        window=live.window,
        claims_rate=live.dispatch.get("claims"),
        claimed_rate=live.dispatch.get("claimed"),
        stages=rows,
        rates_source=LIVE,
    )


def _stage_counter(stage: str, name: str) -> Callable[[Sample], int]:
    def read(item: Sample) -> int:
        return int(getattr(item.stage_stats.get(stage, StageCounters()), name))

    return read


def _flushed(item: Sample) -> datetime:
    assert item.dispatch.updated is not None  # anchors() keeps only flushed samples
    return item.dispatch.updated


def _quiet_for(current: Sample) -> float | None:
    """Seconds the running dispatcher has gone without a flush; None: cannot tell.

    A flush older than the dispatcher's start was its predecessor's: the
    silence counts from the start. With no dispatcher, nothing is counted at all.
    """
    flushed = current.dispatch.updated
    if current.dispatcher_pid is None:
        return float("inf")
    if current.dispatcher_since is None:
        return None
    since = current.dispatcher_since if flushed is None else max(flushed, current.dispatcher_since)
    return (current.now - since).total_seconds()
