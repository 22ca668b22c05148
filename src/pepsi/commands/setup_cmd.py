"""`pepsi setup schema` (alias `pepsi-setup schema`): install or upgrade the schema."""

from __future__ import annotations

import argparse

from pepsi.commands import Context, summary
from pepsi.db import connect, schema
from pepsi.errors import EX_OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("setup", help=summary("setup"))
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    schema_parser = actions.add_parser(
        "schema",
        help="install the schema, or upgrade an older one (idempotent)",
        description="Install the pepsi schema in the database in use, or upgrade an older "
        "one to this build's version. Running it again changes nothing.",
    )
    schema_parser.set_defaults(handler=run_schema)


def run_schema(args: argparse.Namespace, ctx: Context) -> int:
    config = ctx.config()
    target = connect.resolve(config)
    with connect.connect(
        target.dsn, timeout=config.postgres.connect_timeout, application_name="pepsi-setup"
    ) as conn:
        print(schema.install(conn))
    return EX_OK
