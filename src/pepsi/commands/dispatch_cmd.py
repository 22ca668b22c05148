"""`pepsi dispatch serve` (alias `pepsi-dispatch serve`): run the dispatcher."""

from __future__ import annotations

import argparse
import asyncio
from typing import TYPE_CHECKING

from pepsi.commands import summary
from pepsi.config import Config, read_overlay, with_overlay
from pepsi.db import connect, schema
from pepsi.dispatch.coordinator import Dispatcher

if TYPE_CHECKING:
    from pepsi.commands import Context


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("dispatch", help=summary("dispatch"))
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    serve = actions.add_parser(
        "serve",
        help="claim pending messages and run their stages until interrupted",
        description="Run the dispatcher until SIGINT/SIGTERM. Exactly one runs per "
        "database (a second one waits LOCK_WAIT, 10s, for the lock, then exits 1). Exit 0 on a "
        "clean stop, 1 on an error, 78 if the database schema is not this build's. "
        "With [pepsi-dispatch] METRICS_ADDRESS set it also serves Prometheus metrics "
        "at http://ADDRESS/metrics (docs/operations.md). Every VACUUM_AFTER (20000) "
        "stage passes it vacuums the queue tables in the background (docs/dispatcher.md).",
    )
    serve.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace, ctx: Context) -> int:
    target = connect.resolve(ctx.config())
    return asyncio.run(Dispatcher(_with_overlay(ctx.config(), target.dsn), target.dsn).serve())


def _with_overlay(config: Config, dsn: str) -> Config:
    """The file's configuration with the database overlay's stages (checked schema first)."""
    timeout = config.postgres.connect_timeout
    with connect.connect(dsn, timeout=timeout, application_name="pepsi-dispatch") as conn:
        schema.require_current(conn)
        return with_overlay(config, read_overlay(conn))
