"""`pepsi top`: a live view of the pipeline, refreshed every --interval.

Per stage: backlog, in flight, paused, failed and timed-out rows, connected
workers, and per-second rates of the dispatcher's counters; a header with the
dispatcher's state. On a terminal the view redraws in place until Ctrl-C;
piped, or with --json, it prints one frame per refresh (--json: one object
per line). --count N stops after N refreshes.

Each refresh reads the stats tables, pg_stat_activity and pg_locks (well
under a millisecond) and counts the queue; a count that is slow (a large
queue) is redone only after ten times its duration, and the header says how
old it is. Rates are per second over the last 10 seconds, from the snapshots
the running dispatcher notifies every second (NOTIFY pepsi_live, no table
write); when none come (no dispatcher, or an older one), between its last two
statistics flushes (every STATS_INTERVAL and when idle). The header says which
source it shows. The header also shows the oldest
transaction holding back vacuum, highlighted with a warning past 60s
($PEPSI_HORIZON_WARN_AFTER). See docs/operations.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import psycopg

from pepsi.admin import horizon, serving
from pepsi.admin.watch import activity
from pepsi.admin.watch.live import WINDOW
from pepsi.admin.watch.live_listener import LiveListener
from pepsi.admin.watch.top import LIVE, RATED, RECENT, Frame, with_live
from pepsi.commands import Context, summary
from pepsi.durations import format_duration, parse_duration
from pepsi.errors import EX_OK, DatabaseUnavailable, UsageError, classify, one_line

if TYPE_CHECKING:
    from rich.console import RenderableType

    from pepsi.config import Config

NO_RATE = "–"  # first frame, or a counter that was reset


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "top",
        help=summary("top"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--interval",
        default="1",
        metavar="SECONDS",
        help="time between refreshes (a number of seconds or a duration: 500ms, 2s; default 1)",
    )
    parser.add_argument("--count", type=int, metavar="N", help="stop after N refreshes")
    parser.add_argument("--json", action="store_true", help="one JSON object per line per refresh")
    parser.set_defaults(handler=run_top)


def _interval(text: str) -> float:
    # Parsed here rather than by argparse so a mistake is one line, like other usage errors.
    try:
        seconds = parse_duration(text)
    except ValueError:
        raise UsageError(f"--interval wants a positive number of seconds, got {text!r}") from None
    if seconds <= 0:
        raise UsageError(f"--interval must be greater than 0, got {text!r}")
    return seconds


def run_top(args: argparse.Namespace, ctx: Context) -> int:
    interval = _interval(args.interval)
    if args.count is not None and args.count < 1:
        raise UsageError(f"--count must be at least 1, got {args.count}")
    config = ctx.config()
    stages = list(config.stages)
    stats_interval = config.dispatch.stats_interval
    warn_after = horizon.warn_after()
    try:
        with activity.open_top(config) as conn:
            frames = live_frames(conn, stages, interval, args.count, stats_interval)
            if args.json:
                _print_json(frames, config, warn_after)
            elif sys.stdout.isatty():
                _show_live(frames, config, warn_after)
            else:
                _print_frames(frames, config, warn_after)
    except KeyboardInterrupt:
        return EX_OK  # Ctrl-C is how a live view is meant to end
    return EX_OK


def live_frames(
    conn: psycopg.Connection[Any],
    stages: Sequence[str],
    interval: float,
    count: int | None,
    stats_interval: float,
) -> Iterator[Frame]:
    """`activity.frames` with the live rates: between refreshes the view reads the
    dispatcher's notifications rather than sleeping."""
    reader = activity.TopReader(conn, stages, interval=interval, stats_interval=stats_interval)
    live = LiveListener(conn)
    try:
        live.start()
    except psycopg.Error as exc:
        raise _unavailable(exc) from None
    deadline = time.monotonic()
    shown = 0
    while True:
        item = reader.refresh()
        try:
            live.wait(0)  # what came during the reads
        except psycopg.Error as exc:
            raise _unavailable(exc) from None
        yield with_live(item, live.view())
        shown += 1
        if count is not None and shown >= count:
            return
        # Keep to the interval's grid, but never try to catch up after a slow read.
        deadline = max(deadline + interval, time.monotonic())
        try:
            live.wait(deadline - time.monotonic())
        except psycopg.Error as exc:
            raise _unavailable(exc) from None


def _unavailable(exc: psycopg.Error) -> DatabaseUnavailable:
    kind = type(classify(exc) or DatabaseUnavailable(""))
    return kind(f"reading the queue failed: {one_line(exc)}", sqlstate=exc.sqlstate)


def _print_json(frames: Iterator[Frame], config: Config, warn_after: float) -> None:
    for item in frames:
        data = item.as_dict()
        data["stats_interval_s"] = config.dispatch.stats_interval
        if data["oldest_transaction"] is not None:
            data["oldest_transaction"]["late"] = horizon.is_late(item.horizon, warn_after)
        sys.stdout.write(json.dumps(data) + "\n")
        sys.stdout.flush()  # a reader at the other end of a pipe sees each frame at once


def _print_frames(frames: Iterator[Frame], config: Config, warn_after: float) -> None:
    from pepsi.terminal import console  # noqa: PLC0415  # rich loads slowly

    out = console()
    for item in frames:
        out.print(render(item, config.dispatch.stats_interval, warn_after=warn_after))
        sys.stdout.flush()


def _show_live(frames: Iterator[Frame], config: Config, warn_after: float) -> None:
    from rich.live import Live  # noqa: PLC0415

    from pepsi.terminal import console  # noqa: PLC0415

    stats_interval = config.dispatch.stats_interval
    first = render(next(frames), stats_interval, live=True, warn_after=warn_after)
    with Live(first, console=console(), auto_refresh=False) as live:
        for item in frames:
            live.update(
                render(item, stats_interval, live=True, warn_after=warn_after), refresh=True
            )


def _rate(value: float | None) -> str:
    if value is None:
        return NO_RATE
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"  # tenths only where they matter


def header(item: Frame) -> str:
    """The dispatcher line: whether it runs, how fast it claims, when it last flushed."""
    if item.dispatcher_pid is None:
        state = "dispatcher: not running (no session holds its lock)"
    else:
        state = f"dispatcher: running (pid {item.dispatcher_pid})"
    parts = [
        state,
        f"claims/s {_rate(item.claims_rate)}",
        f"rows claimed/s {_rate(item.claimed_rate)}",
    ]
    age = item.flush_age
    if item.last_flush is None or age is None:
        parts.append("last stats flush: never")
    else:
        when = item.last_flush.astimezone().strftime("%H:%M:%S")
        parts.append(f"last stats flush {when} ({format_duration(age)} ago)")
    source = {LIVE: "live", RECENT: "the last minutes' statistics"}.get(
        item.rates_source, "statistics flushes"
    )
    if item.window is not None:
        parts.append(f"rates: {source}, over {format_duration(item.window)}")
    else:
        parts.append(f"rates: {source}")
    if item.counts_age >= 1.0:  # the queue is large: counted less often (see pepsi.admin.watch.top)
        parts.append(f"queue counted {format_duration(item.counts_age)} ago")
    if item.horizon is not None:
        parts.append(horizon_part(item))
    return " · ".join(parts)


def horizon_part(item: Frame) -> str:
    """The header's part for the oldest transaction holding back vacuum."""
    holder = item.horizon
    assert holder is not None
    who = f"pid {holder.pid}" if holder.pid is not None else f"prepared {holder.gid!r}"
    return f"oldest transaction {format_duration(holder.age_s)} ({who})"


def footer(stats_interval: float, *, live: bool, source: str = "stats") -> str:
    if source == RECENT:
        text = (
            "rates: per second over the last minute and this one, from the counts each "
            "statistics flush adds to its minute (STATS_INTERVAL: "
            f"{format_duration(stats_interval)} here), until two flushes or live snapshots "
            "give a closer window; processed and "
            f"failed only ({NO_RATE}: the others)."
        )
        return text + (" Ctrl-C quits." if live else "")
    if source == LIVE:
        text = (
            f"rates: per second over the last {format_duration(WINDOW)}, from the snapshots "
            "the dispatcher notifies every second while busy (pepsi_live)."
        )
        return text + (" Ctrl-C quits." if live else "")
    text = (
        "rates: per second between the dispatcher's last two statistics flushes, which come "
        f"every STATS_INTERVAL ({format_duration(stats_interval)} here) and when the pipeline "
        f"goes idle; 0 when none came for longer than that. {NO_RATE}: no second flush seen yet."
    )
    return text + (" Ctrl-C quits." if live else "")


# Short headings for the rates, to keep the table narrow.
RATE_HEADINGS = {"processed": "proc/s", "failed": "fail/s", "finished": "fin/s",
                 "advanced": "adv/s", "retries": "retry/s"}  # fmt: skip


def render(
    item: Frame,
    stats_interval: float,
    *,
    live: bool = False,
    warn_after: float = horizon.HORIZON_WARN_AFTER,
) -> RenderableType:
    from rich.console import Group  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    from pepsi.terminal import table  # noqa: PLC0415

    counts = ("backlog", "running", "paused", "failed", "timeout", "workers")
    grid = table("", "stage", *counts, *(RATE_HEADINGS[name] for name in RATED), "strikes",
                 "retries")  # fmt: skip
    # The box's blank divider alone separates the 14 columns: about 100 characters wide.
    grid.padding = (0, 0)
    grid.show_edge = False
    for column in grid.columns[1:]:
        column.justify = "right"
        column.no_wrap = False  # a narrow terminal shortens these headings, not stage names
    for row in item.stages:
        grid.add_row(
            Text(row.stage),  # as Text: a stage name is not rich markup
            *(str(n) for n in (row.backlog, row.running, row.paused, row.failed, row.timeout)),
            str(row.workers),
            *(_rate(row.rates.get(name)) for name in RATED),
            str(row.strikes),
            str(row.retries),
        )
    body: RenderableType = grid if item.stages else Text("no stages: none configured, queue empty")
    top = Text(header(item), style="bold")
    warning = horizon.warning(item.horizon, warn_after)
    if warning is not None:  # highlight the age in the header, and say what to do
        top.highlight_words([horizon_part(item)], style="bold reverse red")
        top.append("\n" + warning, style="bold red")
    for stage, pending in item.unserved:
        top.append("\nwarning: " + serving.describe(stage, pending), style="bold yellow")
    return Group(
        top,
        body,
        Text(footer(stats_interval, live=live, source=item.rates_source), style="dim"),
    )
