"""`pepsi top`'s reads: what the pipeline is doing, one `Sample` per refresh.

Each refresh reads the stats tables, pg_stat_activity (workers, and the
oldest transaction holding back vacuum), pg_prepared_xacts and pg_locks (well
under a millisecond) and counts the queue; a count that is slow (a large
queue) is redone only after ten times its duration, and the frame says how
old it is (`pepsi.admin.watch.top.counts_due`). The arithmetic from samples to a
frame is `pepsi.admin.watch.top`, pure; this module is its I/O.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from pepsi.admin import serving
from pepsi.admin.connection import open_current
from pepsi.admin.horizon import read_oldest
from pepsi.admin.queue import count_by_stage_status
from pepsi.admin.watch.top import (
    DispatchCounters,
    Frame,
    Sample,
    StageCounters,
    anchors,
    counts_due,
    frame,
)
from pepsi.config import Config
from pepsi.db.queries import query
from pepsi.errors import DatabaseUnavailable, classify, one_line

WORKER_PREFIX = "pepsi-worker:"  # each worker's connection is named after its stage
APPLICATION_NAME = "pepsi-top"  # not a worker: the view does not count itself


@dataclass(frozen=True)
class Counted:
    counts: dict[str, dict[str, int]]  # stage -> status -> rows
    at: float  # time.monotonic() when read
    took: float  # seconds the count took


def count_queue(conn: psycopg.Connection[Any]) -> Counted:
    """Rows per stage and status: a scan of the queue, the one costly read."""
    started = time.monotonic()
    counts = count_by_stage_status(conn)
    return Counted(counts, started, time.monotonic() - started)


def read_sample(
    conn: psycopg.Connection[Any], counts: dict[str, dict[str, int]], counts_age: float = 0.0
) -> Sample:
    """One read of the rest of a frame (autocommit: each query its own snapshot)."""
    stage_stats: dict[str, StageCounters] = {}
    for stage, *values in conn.execute(query("stats_stage_all")):
        processed, failed, finished, advanced, retries, strikes = map(int, values)
        stage_stats[str(stage)] = StageCounters(
            processed=processed, failed=failed, finished=finished,
            advanced=advanced, retries=retries, strikes=strikes,
        )  # fmt: skip
    row = conn.execute(query("stats_dispatch_latest")).fetchone()
    assert row is not None  # one row even when the table is empty
    now, claims, claimed, updated = row
    dispatch = DispatchCounters(int(claims or 0), int(claimed or 0), updated)
    workers: dict[str, int] = {}
    for name, n in conn.execute(query("activity_count_workers")):
        stage = str(name).removeprefix(WORKER_PREFIX)
        workers[stage] = workers.get(stage, 0) + int(n)
    recent = {
        str(stage): (int(p), int(f))
        for stage, p, f in conn.execute(query("stats_stage_recent")).fetchall()
        if stage is not None
    }
    since_row = conn.execute(query("stats_recent_since")).fetchone()
    holder = conn.execute(query("dispatcher_lock_holder")).fetchone()  # reads pg_locks only
    _, serves = serving.served(conn) if holder is not None else (None, None)
    return Sample(
        now=now,
        counts=counts,
        stage_stats=stage_stats,
        dispatch=dispatch,
        workers=workers,
        dispatcher_pid=None if holder is None else int(holder[0]),
        dispatcher_since=None if holder is None else holder[4],
        counts_age=counts_age,
        horizon=read_oldest(conn),
        serves=serves,
        recent=recent,
        recent_since=since_row[0] if since_row and recent else None,
    )


class TopReader:
    """Successive frames over one connection; between refreshes it keeps the samples
    of the last two flushes (the rate window) and the last count of the queue."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        stages: Sequence[str],
        *,
        interval: float,
        stats_interval: float,
    ) -> None:
        self.conn = conn
        self.stages = list(stages)  # configured: shown first, in this order
        self.interval = interval
        self.stats_interval = stats_interval
        self.seen: tuple[Sample, ...] = ()
        self.counted: Counted | None = None

    def refresh(self) -> Frame:
        """Read one sample (counting the queue when due) and compute its frame."""
        counted = self.counted
        try:
            if counted is None or counts_due(
                counted.at, counted.took, time.monotonic(), self.interval
            ):
                counted = self.counted = count_queue(self.conn)
            current = read_sample(self.conn, counted.counts, time.monotonic() - counted.at)
        except psycopg.Error as exc:
            raise _unavailable(exc) from None
        self.seen = anchors(self.seen, current)
        return frame(self.seen, current, self.stages, self.stats_interval)


def open_top(config: Config) -> psycopg.Connection[tuple[object, ...]]:
    """The view's connection, named so that it is not taken for a worker."""
    try:
        return open_current(config, application_name=APPLICATION_NAME)
    except psycopg.Error as exc:
        raise _unavailable(exc) from None


def frames(
    conn: psycopg.Connection[Any],
    stages: Sequence[str],
    interval: float,
    count: int | None,
    stats_interval: float,
) -> Iterator[Frame]:
    """A frame every `interval` seconds, `count` of them (None: until the caller stops)."""
    reader = TopReader(conn, stages, interval=interval, stats_interval=stats_interval)
    deadline = time.monotonic()
    shown = 0
    while True:
        yield reader.refresh()
        shown += 1
        if count is not None and shown >= count:
            return
        # Keep to the interval's grid, but never try to catch up after a slow read.
        deadline = max(deadline + interval, time.monotonic())
        time.sleep(max(0.0, deadline - time.monotonic()))


def _unavailable(exc: psycopg.Error) -> DatabaseUnavailable:
    """The read's failure as one line, of the class the classifier gives (lost: 74)."""
    kind = type(classify(exc) or DatabaseUnavailable(""))
    return kind(f"reading the queue failed: {one_line(exc)}", sqlstate=exc.sqlstate)
