"""The overview's data: what the database, the dispatcher and its live feed say now.

One `OverviewState` per console app (`OVERVIEW`), with two tasks started and
stopped with the app (`lifecycle`):

- the live listener: an autocommit async connection of its own LISTENs on
  `pepsi_live` (`pepsi.admin.watch.live_listener.AsyncLiveListener`) and feeds the state's
  `LiveRates`; it reconnects after a failure, every RECONNECT_AFTER seconds;
- (no second task for the chart: the dispatcher's statistics flushes keep
  the last day's per-minute counts in `pepsi.stage_stats_minute`, which the
  overview reads at most every CHART_EVERY seconds, in bars of BAR_MINUTES
  (`pepsi.web.overview_chart`); so the chart shows the last day whenever the console started.)

`build` makes one `Overview`: counts per stage and status (a scan of the
queue: redone at most as often as `pepsi top` would, `counts_due`), the
oldest pending row per stage (an index probe each), workers and in-flight
messages (the dispatcher's pools when the console runs inside it, else its
live snapshot, else pg_stat_activity and the running rows), rates
(`current_rates`: the live snapshots, else the last two statistics flushes,
as `pepsi top` takes them), warnings (back-pressure, the MVCC horizon:
`pepsi.web.overview_notices`).
Results are shared for CACHE_FOR seconds between the requests of all browsers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from aiohttp import web

from pepsi.admin.watch import top
from pepsi.admin.watch.activity import Counted, count_queue, read_sample
from pepsi.admin.watch.live import LiveRates, LiveView
from pepsi.admin.watch.live_listener import AsyncLiveListener
from pepsi.config import Config
from pepsi.config.values import is_amqp_stage
from pepsi.db.connect import connect_async
from pepsi.db.queries import query
from pepsi.durations import format_duration
from pepsi.errors import PepsiError, one_line
from pepsi.web import graph
from pepsi.web.overview_chart import Chart, chart_bars, read_chart
from pepsi.web.overview_notices import Notice, warnings

log = logging.getLogger("pepsi.web")

CHART_EVERY = 15.0  # seconds between two reads of the chart's counts
RECONNECT_AFTER = 5.0  # seconds before the live listener connects again
CACHE_FOR = 2.0  # seconds an overview is shared between requests: the page's refresh
MAX_QUEUES = 40  # AMQP queues drawn in the graph beyond those the stages name
COUNT_INTERVAL = 2.0  # how often the page refreshes: the budget of the queue's count
LIVE_APPLICATION_NAME = "pepsi-web-live"

Conn = psycopg.Connection[Any]


# ---- what the page shows ----------------------------------------------------------------

LIVE, STATS, NONE = "live", "stats", "none"  # where the rates come from
FROM_DISPATCHER, FROM_LIVE, FROM_DATABASE = "dispatcher", "live", "database"  # workers


@dataclass(frozen=True)
class Rates:
    """Per-stage rates (counter -> per second; None: not known) and their source."""

    source: str  # LIVE, STATS or NONE
    window: float | None  # seconds they average over
    stages: Mapping[str, Mapping[str, float | None]]

    def of(self, stage: str, counter: str) -> float | None:
        return self.stages.get(stage, {}).get(counter)

    @property
    def describe(self) -> str:
        if self.source == LIVE:
            return f"live: the dispatcher's snapshots, over the last {self.window or 0:.0f}s"
        window = self.window
        if self.source == STATS and window is None:
            return "statistics tables: nothing counted since the last flush (no dispatcher)"
        if self.source == STATS and window is not None:
            return f"statistics tables: over the last {format_duration(window)}"
        return "no rates yet: no live snapshot, and fewer than two statistics flushes seen"


def current_rates(stats: top.Frame, live: LiveView) -> Rates:
    """The freshest rates: the live snapshots while the dispatcher is heard from, else
    those of the statistics flushes (`pepsi.admin.watch.top.frame`)."""
    chosen = top.with_live(stats, live)
    source = LIVE if chosen.rates_source == top.LIVE else STATS
    known = any(v is not None for row in chosen.stages for v in row.rates.values())
    if source == STATS and not known:
        source = NONE
    return Rates(source, chosen.window, {row.stage: row.rates for row in chosen.stages})


@dataclass(frozen=True)
class StageLine:
    name: str
    href: str
    configured: bool
    amqp: bool
    pending: int
    running: int
    paused: int
    failed: int
    timeout: int
    in_flight: int | None
    workers: int | None
    worker_limit: int | None
    processed_rate: float | None
    failed_rate: float | None
    oldest_pending_s: float | None


@dataclass(frozen=True)
class Overview:
    now: datetime
    stages: tuple[StageLine, ...]
    graph_svg: str
    chart_svg: str
    chart_processed: int
    chart_failed: int
    rates: Rates
    live_state: str
    workers_source: str
    dispatcher_pid: int | None
    counts_age: float
    warnings: tuple[Notice, ...]
    queues_more: int = 0  # AMQP queues not drawn
    live_error: str | None = None  # why the live feed is not listened to


# ---- reading ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DbRead:
    sample: top.Sample
    counted: Counted
    oldest: Mapping[str, float]
    chart: Chart | None  # None: not read this time (CHART_EVERY)
    queues: tuple[str, ...]
    queue_total: int


def read_oldest_pending(conn: Conn, stages: Sequence[str]) -> dict[str, float]:
    """Stage -> seconds since its oldest pending row arrived (stages with none left out)."""
    rows = conn.execute(query("web_overview_oldest_pending"), {"stages": list(stages)})
    return {str(stage): max(0.0, float(age)) for stage, age, _ in rows}


def read_amqp_queues(conn: Conn, limit: int = MAX_QUEUES) -> tuple[tuple[str, ...], int]:
    """The declared AMQP queues' stages (the first `limit` by name) and how many in all."""
    rows = conn.execute(query("web_overview_amqp_queues"), {"limit": limit}).fetchall()
    return tuple(str(stage) for stage, _ in rows), int(rows[0][1]) if rows else 0


def read_db(
    conn: Conn, stages: Sequence[str], counted: Counted | None, *, chart: bool = True
) -> DbRead:
    """Everything the overview reads, on one connection (autocommit); the chart's counts
    only if `chart`."""
    if counted is None or top.counts_due(
        counted.at, counted.took, time.monotonic(), COUNT_INTERVAL
    ):
        counted = count_queue(conn)
    sample = read_sample(conn, counted.counts, time.monotonic() - counted.at)
    queues, total = read_amqp_queues(conn)
    names = sorted(set(stages) | set(counted.counts) | set(queues))
    oldest = read_oldest_pending(conn, names)
    return DbRead(sample, counted, oldest, read_chart(conn) if chart else None, queues, total)


# ---- the state of one console ------------------------------------------------------------


@dataclass
class OverviewState:
    rates: LiveRates = field(default_factory=LiveRates)
    chart: Chart | None = None  # the last read of the chart's counts
    chart_read: float = 0.0  # when (monotonic)
    seen: tuple[top.Sample, ...] = ()
    counted: Counted | None = None
    cached: tuple[float, Overview] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    listening: bool = False  # the live listener's LISTEN is in place
    listen_error: str | None = None

    def live_view(self) -> LiveView:
        return self.rates.view(time.monotonic())


OVERVIEW = web.AppKey("overview", OverviewState)


async def listen(state: OverviewState, dsn: str, timeout: float) -> None:
    """Feed `state.rates` from `pepsi_live` until cancelled, reconnecting after failures."""
    while True:
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            conn = await connect_async(dsn, application_name=LIVE_APPLICATION_NAME, timeout=timeout)
            listener = AsyncLiveListener(conn, state.rates)
            await listener.start()
            if state.listen_error is not None:
                log.info("web: live feed listening again")
            state.listening, state.listen_error = True, None
            await listener.run()
        except asyncio.CancelledError:
            raise
        except (psycopg.Error, PepsiError, OSError) as exc:  # the database went away: retry
            error = one_line(exc)
            if error != state.listen_error:  # once, not every RECONNECT_AFTER
                log.warning("web: live feed unavailable: %s", error)
            state.listen_error = error
        finally:
            state.listening = False
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
        await asyncio.sleep(RECONNECT_AFTER)


def lifecycle(console: Any) -> Any:
    """The app's cleanup context: the state and the live listener."""

    async def run(app: web.Application) -> AsyncIterator[None]:
        state = app[OVERVIEW]
        tasks = [
            asyncio.create_task(
                listen(state, console.dsn, console.config.postgres.connect_timeout),
                name="pepsi-web-live",
            ),
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    return run


# ---- one overview ----------------------------------------------------------------------


async def overview(state: OverviewState, console: Any) -> Overview:
    """The overview now, or one taken less than CACHE_FOR seconds ago."""
    async with state.lock:
        cached = state.cached
        if cached is not None and time.monotonic() - cached[0] < CACHE_FOR:
            return cached[1]
        config: Config = console.config
        chart_due = state.chart is None or time.monotonic() - state.chart_read >= CHART_EVERY
        read = await console.db(read_db, list(config.stages), state.counted, chart=chart_due)
        state.counted = read.counted
        if read.chart is not None:
            state.chart, state.chart_read = read.chart, time.monotonic()
        result = build(state, config, read, console.dispatcher)
        state.cached = (time.monotonic(), result)
        return result


def build(state: OverviewState, config: Config, read: DbRead, dispatcher: Any) -> Overview:
    sample = read.sample
    state.seen = top.anchors(state.seen, sample)
    stats_frame = top.frame(state.seen, sample, list(config.stages), config.dispatch.stats_interval)
    live = state.live_view()
    rates = current_rates(stats_frame, live)
    pools = _pools(dispatcher)
    workers_source = (
        FROM_DISPATCHER
        if pools is not None
        else FROM_LIVE
        if live.state == "live"
        else FROM_DATABASE
    )
    names = list(config.stages)
    for name in [*sorted(sample.counts), *read.queues]:
        if name not in names:
            names.append(name)
    lines = []
    for name in names:
        counts = sample.counts.get(name, {})
        in_flight: int | None
        workers: int | None
        limit: int | None = None
        if pools is not None:
            gauge = pools.get(name)
            in_flight, workers, limit = gauge if gauge else (0, 0, None)
        elif workers_source == FROM_LIVE and name in live.stages:
            in_flight, workers = live.stages[name].in_flight, live.stages[name].workers
        else:
            in_flight, workers = counts.get("running", 0), sample.workers.get(name, 0)
        if is_amqp_stage(name) and name not in config.stages:
            workers = limit = None  # a queue: consumers, not workers
        lines.append(
            StageLine(
                name=name,
                href=graph.stage_href(name),
                configured=name in config.stages,
                amqp=is_amqp_stage(name),
                pending=counts.get("pending", 0),
                running=counts.get("running", 0),
                paused=counts.get("paused", 0),
                failed=counts.get("failed", 0),
                timeout=counts.get("timeout", 0),
                in_flight=in_flight,
                workers=workers,
                worker_limit=limit,
                processed_rate=rates.of(name, "processed"),
                failed_rate=rates.of(name, "failed"),
                oldest_pending_s=read.oldest.get(name),
            )
        )
    extra = [q for q in read.queues if q not in config.stages]
    layout = graph.layout(config, extra)
    backlog = {
        line.name: graph.Backlog(line.pending, line.running, line.failed + line.timeout)
        for line in lines
    }
    chart = read.chart or state.chart
    bars = chart_bars(chart.rows, chart.now) if chart is not None else []
    return Overview(
        now=sample.now,
        stages=tuple(lines),
        graph_svg=graph.render_graph(layout, backlog),
        chart_svg=graph.render_chart(bars),
        chart_processed=sum(b.processed for b in bars),
        chart_failed=sum(b.failed for b in bars),
        rates=rates,
        live_state=live.state,
        workers_source=workers_source,
        dispatcher_pid=sample.dispatcher_pid,
        counts_age=sample.counts_age,
        warnings=tuple(warnings(sample, dispatcher)),
        queues_more=max(0, read.queue_total - len(read.queues)),
        live_error=None if state.listening else state.listen_error,
    )


def _pools(dispatcher: Any) -> dict[str, tuple[int, int, int | None]] | None:
    """stage -> (in flight, workers, worker limit) from the dispatcher serving this console
    (read on its loop, as its metrics are); None without one."""
    if dispatcher is None:
        return None
    try:
        supervisor = dispatcher.supervisor
        now = supervisor.clock()
        return {
            name: (
                sum(len(w.inflight) for w in pool.workers.values()),
                len(pool.workers),
                pool.limit(supervisor.cap(name, now)),
            )
            for name, pool in supervisor.pools.items()
        }
    except AttributeError:  # not a dispatcher as this console knows it
        return None
