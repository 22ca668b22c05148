"""`pepsi failure-bouncer` (alias `pepsi-failure-bouncer`): the dead-letter sink.

Failed and timed-out messages of stages without a BOUNCE_STAGE are moved to
`[pepsi-failure-bouncer] SINK`: a stage (they become pending there, with
`state.bounced_from`) or, by default, the table `pepsi.dead_letter`, where
an operator finds the whole message. Runs every INTERVAL until SIGINT or
SIGTERM, or once with --once.
"""

from __future__ import annotations

import argparse
import signal
import threading

from pepsi.admin.bouncer import Bouncer, BouncerSettings
from pepsi.commands import Context, summary
from pepsi.db import connect
from pepsi.errors import EX_OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "failure-bouncer",
        help=summary("failure-bouncer"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--once", action="store_true", help="one pass, then exit")
    parser.set_defaults(handler=run_bouncer)


def run_bouncer(args: argparse.Namespace, ctx: Context) -> int:
    config = ctx.config()
    settings = BouncerSettings.from_config(config)
    stop = threading.Event()
    if not args.once:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
    bouncer = Bouncer(
        settings, connect.resolve(config).dsn, connect_timeout=config.postgres.connect_timeout
    )
    bouncer.check()
    if args.once:
        moved = bouncer.run_once()
        print(f"moved {moved} failed messages to {settings.where}")
        return EX_OK
    bouncer.run(stop)
    return EX_OK
