"""`pepsi db start|stop|status|url`: the database in use, embedded or not."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pepsi.admin.database import database_status, embedded_server
from pepsi.commands import Context, summary
from pepsi.db import connect
from pepsi.errors import EX_OK

if TYPE_CHECKING:
    from rich.console import Console


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "db",
        help=summary("db"),
        description="Without a DSN ($PEPSI_DSN or [pepsi-postgres] DSN) Pepsi uses an "
        "embedded PostgreSQL in DATA_DIR, started on demand and left running.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("start", help="start the embedded server").set_defaults(handler=run_start)
    actions.add_parser("stop", help="stop the embedded server").set_defaults(handler=run_stop)
    actions.add_parser(
        "status", help="show the database in use, its schema and queue"
    ).set_defaults(handler=run_status)
    actions.add_parser(
        "url", help="print the libpq URI of the database in use (starts the embedded server)"
    ).set_defaults(handler=run_url)


def run_start(args: argparse.Namespace, ctx: Context) -> int:
    server = embedded_server(ctx.config(), "start")
    server.start()
    status = server.status()
    print(f"embedded PostgreSQL running in {status.data_dir} (pid {status.pid})")
    return EX_OK


def run_stop(args: argparse.Namespace, ctx: Context) -> int:
    server = embedded_server(ctx.config(), "stop")
    if server.stop():
        print(f"embedded PostgreSQL in {server.data_dir} stopped")
    else:
        print(f"embedded PostgreSQL in {server.data_dir} was not running")
    return EX_OK


def run_url(args: argparse.Namespace, ctx: Context) -> int:
    print(connect.resolve(ctx.config()).dsn)
    return EX_OK


def run_status(args: argparse.Namespace, ctx: Context) -> int:
    from pepsi.terminal import console as make_console  # noqa: PLC0415  # rich loads slowly
    from pepsi.terminal import grid  # noqa: PLC0415

    found = database_status(ctx.config())
    console = make_console()
    facts = grid()
    facts.add_row("database", found.source)
    if not found.running:
        console.print(facts)
        console.print("start it with `pepsi db start` (any command needing it starts it)")
        return EX_OK
    facts.add_row("url", found.url or "")
    facts.add_row("server", f"PostgreSQL {found.server_version or '?'}")
    if found.schema is not None:
        facts.add_row("schema", found.schema.message())
    console.print(facts)
    if found.queue is not None:
        render_queue(console, found.queue)
    return EX_OK


def render_queue(console: Console, counts: Mapping[str, Mapping[str, int]]) -> None:
    from pepsi.terminal import table as make_table  # noqa: PLC0415

    if not counts:
        console.print("queue: empty")
        return
    statuses = ("pending", "running", "paused", "failed", "timeout")
    table = make_table("queue", "stage", *statuses)
    for stage, by_status in counts.items():
        table.add_row(stage, *(str(by_status.get(s, 0)) for s in statuses))
    console.print(table)
