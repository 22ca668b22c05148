"""`pepsi db start|stop|status|url`: the database in use, embedded or not."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pepsi.commands import summary
from pepsi.db import connect, schema
from pepsi.db.embedded import EmbeddedServer
from pepsi.db.queries import query
from pepsi.errors import EX_OK, PepsiError

if TYPE_CHECKING:
    from rich.console import Console

    from pepsi.cli import Context


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


def _embedded_only(ctx: Context, action: str) -> EmbeddedServer:
    config = ctx.config()
    if connect.configured_dsn(config):
        raise PepsiError(
            f"cannot {action} the embedded server: a DSN is configured "
            f"({connect.Target(connect.configured_dsn(config) or '', None).source}), "
            "so Pepsi uses that server"
        )
    return EmbeddedServer(config.postgres.data_dir)


def run_start(args: argparse.Namespace, ctx: Context) -> int:
    server = _embedded_only(ctx, "start")
    server.start()
    status = server.status()
    print(f"embedded PostgreSQL running in {status.data_dir} (pid {status.pid})")
    return EX_OK


def run_stop(args: argparse.Namespace, ctx: Context) -> int:
    server = _embedded_only(ctx, "stop")
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

    config = ctx.config()
    console = make_console()
    facts = grid()
    dsn = connect.configured_dsn(config)
    if dsn is None:
        status = EmbeddedServer(config.postgres.data_dir).status()
        state = f"running, pid {status.pid}" if status.running else "stopped"
        facts.add_row("database", f"embedded server in {status.data_dir} ({state})")
        if not status.running:
            console.print(facts)
            console.print("start it with `pepsi db start` (any command needing it starts it)")
            return EX_OK
        dsn = EmbeddedServer(config.postgres.data_dir).uri()
        assert dsn is not None
    else:
        facts.add_row("database", connect.Target(dsn, None).source)
    facts.add_row("url", connect.redact(dsn))
    with connect.connect(dsn, timeout=config.postgres.connect_timeout) as conn:
        version = conn.execute(query("server_version")).fetchone()
        facts.add_row("server", f"PostgreSQL {version[0] if version else '?'}")
        check = schema.check(conn)
        facts.add_row("schema", check.message())
        console.print(facts)
        if check.state is schema.SchemaState.CURRENT:
            rows = conn.execute(query("workqueue_count_by_stage_status")).fetchall()
            render_queue(console, rows)
    return EX_OK


def render_queue(console: Console, rows: list[tuple[object, ...]]) -> None:
    from pepsi.terminal import table as make_table  # noqa: PLC0415

    if not rows:
        console.print("queue: empty")
        return
    statuses = ("pending", "running", "paused", "failed", "timeout")
    counts: dict[str, dict[str, int]] = {}
    for stage, status, messages in rows:
        counts.setdefault(str(stage), {})[str(status)] = int(str(messages))
    table = make_table("queue", "stage", *statuses)
    for stage, by_status in counts.items():
        table.add_row(stage, *(str(by_status.get(s, 0)) for s in statuses))
    console.print(table)
