"""`pepsi setup schema` (alias `pepsi-setup schema`): install or upgrade the schema;
`pepsi setup roles`: the database roles of least privilege (docs/security.md)."""

from __future__ import annotations

import argparse

from pepsi.commands import Context, summary
from pepsi.db import connect, roles, schema
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
    roles_parser = actions.add_parser(
        "roles",
        help="create the roles pepsi_publisher and pepsi_worker, and grant them their due",
        description="Create the group roles pepsi_publisher (may publish, nothing else) and "
        "pepsi_worker (stage code: its rows at a stage, and publishing) if they are missing, "
        "and grant them their privileges in the database in use. Login roles made members "
        "of them cannot add a stage, change a PROGRAM or read the password tables. Run it "
        "as the schema's owner; running it again changes nothing. See docs/security.md.",
    )
    roles_parser.set_defaults(handler=run_roles)


def run_schema(args: argparse.Namespace, ctx: Context) -> int:
    config = ctx.config()
    target = connect.resolve(config)
    with connect.connect(
        target.dsn, timeout=config.postgres.connect_timeout, application_name="pepsi-setup"
    ) as conn:
        print(schema.install(conn))
    return EX_OK


def run_roles(args: argparse.Namespace, ctx: Context) -> int:
    config = ctx.config()
    target = connect.resolve(config)
    with connect.connect(
        target.dsn, timeout=config.postgres.connect_timeout, application_name="pepsi-setup"
    ) as conn:
        schema.require_current(conn)  # the grants name what this build installs
        print(roles.install(conn))
    return EX_OK
