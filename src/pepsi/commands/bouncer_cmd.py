"""`pepsi failure-bouncer` (alias `pepsi-failure-bouncer`): the dead-letter sink.

Failed and timed-out messages of stages without a BOUNCE_STAGE are moved to
`[pepsi-failure-bouncer] SINK`: a stage (they become pending there, with
`state.bounced_from`) or, by default, the table `pepsi.dead_letter`, where
an operator finds the whole message. Runs every INTERVAL until SIGINT or
SIGTERM, or once with --once.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

import psycopg

from pepsi.commands import summary
from pepsi.db import connect, schema
from pepsi.db.queries import query
from pepsi.errors import EX_OK, DatabaseUnavailable

if TYPE_CHECKING:
    from pepsi.cli import Context

log = logging.getLogger("pepsi.failure-bouncer")
BATCH = 1000


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "failure-bouncer",
        help=summary("failure-bouncer"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--once", action="store_true", help="one pass, then exit")
    parser.set_defaults(handler=run_bouncer)


def bounce_once(conn: Any, stages: list[str], sink: str | None) -> int:
    """Move everything there is, BATCH at a time; return how many moved."""
    total = 0
    while True:
        row = conn.execute(
            query("workqueue_bounce_failed"), {"stages": stages, "sink": sink, "max_rows": BATCH}
        ).fetchone()
        moved = int(row[0]) if row else 0
        total += moved
        if moved < BATCH:
            return total


def run_bouncer(args: argparse.Namespace, ctx: Context) -> int:
    config = ctx.config()
    stages = [s.name for s in config.stages.values() if s.bounce_stage is None]
    sink = config.bouncer.sink
    where = f"stage {sink}" if sink else "table pepsi.dead_letter"
    stop = threading.Event()
    if not args.once:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
    target = connect.resolve(config)
    timeout = config.postgres.connect_timeout
    with connect.connect(target.dsn, timeout=timeout) as first:
        schema.require_current(first)
    while True:
        try:
            with connect.connect(target.dsn, timeout=timeout) as conn:
                moved = bounce_once(conn, [s for s in stages if s != sink], sink)
        except (DatabaseUnavailable, psycopg.OperationalError) as exc:
            if args.once:
                raise DatabaseUnavailable(str(exc)) from None
            log.warning(
                "database unavailable (%s); retrying in %.0fs", exc, config.bouncer.interval
            )
            moved = 0
        if moved:
            log.warning("moved %d failed messages to %s", moved, where)
        if args.once:
            print(f"moved {moved} failed messages to {where}")
            return EX_OK
        if stop.wait(config.bouncer.interval):
            return EX_OK
