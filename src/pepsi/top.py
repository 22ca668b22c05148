"""`pepsi top`'s arithmetic: from two successive reads to one frame of the view.

Pure: no I/O and no rich, so the rates are tested without a database. The
shell (`pepsi.commands.top_cmd`) reads a `Sample` per refresh and renders
the `Frame` this module computes from the previous sample and the current one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

STATUSES = ("pending", "running", "paused", "failed", "timeout")


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


@dataclass(frozen=True)
class DispatchCounters:
    """The row of `pepsi.dispatch_stats`; zeros and no `updated` before the first flush."""

    claims: int = 0
    claimed: int = 0
    updated: datetime | None = None


@dataclass(frozen=True)
class Sample:
    """What one refresh read."""

    at: float  # time.monotonic() when read: the elapsed time between samples
    now: datetime  # the server's clock, so the flush age does not depend on the client's
    counts: Mapping[str, Mapping[str, int]]  # stage -> status -> rows
    stage_stats: Mapping[str, StageCounters]
    dispatch: DispatchCounters
    workers: Mapping[str, int]  # stage -> connected worker processes
    dispatcher_pid: int | None  # the backend holding the dispatcher's lock, None: not running


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
    elapsed: float | None  # seconds since the previous sample; None on the first frame
    dispatcher_pid: int | None
    claims_rate: float | None  # claim statements per second
    claimed_rate: float | None  # rows claimed per second
    last_flush: datetime | None
    stages: tuple[StageRow, ...] = field(default=())

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
            "elapsed_s": _round(self.elapsed),
            "dispatcher": {
                "running": self.dispatcher_running,
                "pid": self.dispatcher_pid,
                "claims_per_s": _round(self.claims_rate),
                "claimed_per_s": _round(self.claimed_rate),
                "last_flush": None if self.last_flush is None else self.last_flush.isoformat(),
                "flush_age_s": _round(age),
            },
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


def frame(previous: Sample | None, current: Sample, stages: list[str]) -> Frame:
    """One view: counts from `current`, rates from its difference to `previous`."""
    elapsed = None if previous is None else current.at - previous.at
    rows = []
    for stage in all_stages(current, stages):
        counts = current.counts.get(stage, {})
        now = current.stage_stats.get(stage, StageCounters())
        if previous is None:
            rates: dict[str, float | None] = dict.fromkeys(RATED)
        else:
            then = previous.stage_stats.get(stage, StageCounters())
            rates = {name: rate(getattr(then, name), getattr(now, name), elapsed) for name in RATED}
        rows.append(
            StageRow(
                stage=stage,
                backlog=counts.get("pending", 0),
                running=counts.get("running", 0),
                paused=counts.get("paused", 0),
                failed=counts.get("failed", 0),
                timeout=counts.get("timeout", 0),
                workers=current.workers.get(stage, 0),
                rates=rates,
                strikes=now.strikes,
                retries=now.retries,
            )
        )
    before = previous.dispatch if previous is not None else None
    return Frame(
        now=current.now,
        elapsed=elapsed,
        dispatcher_pid=current.dispatcher_pid,
        claims_rate=None
        if before is None
        else rate(before.claims, current.dispatch.claims, elapsed),
        claimed_rate=(
            None if before is None else rate(before.claimed, current.dispatch.claimed, elapsed)
        ),
        last_flush=current.dispatch.updated,
        stages=tuple(rows),
    )
