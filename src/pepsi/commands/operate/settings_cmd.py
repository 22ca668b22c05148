"""`pepsi settings`: per-address overrides of stage options (W-9).

    set ADDRESS STAGE.KEY=VALUE ...   lay options over the address's (one transaction)
    get ADDRESS                       the address's options, one STAGE.KEY = VALUE a line
    delete ADDRESS [STAGE[.KEY] ...]  remove all of them, a stage's, or some options
    list [--stage STAGE]              every override (or one stage's), by address

A message's overrides are its recipients' (its envelope sender's when
state.local_origin is set); recipients with different ones are split into
one row each. Keys that can be overridden: MAX_LIFETIME, RETRY_DELAY,
RETRY_MAX_DELAY, BOUNCE_STAGE; values are checked as pepsi.conf's are. A
mistake (bad address, unknown stage or key, bad value) changes nothing and
exits 2. Workers see a stage's first override within 5 seconds, later
changes at their next batch. See docs/settings.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pepsi.admin.config import settings
from pepsi.admin.connection import open_current
from pepsi.commands import Context, summary
from pepsi.errors import EX_OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "settings",
        help=summary("settings"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    put = actions.add_parser("set", help="set options of an address")
    put.add_argument("address", metavar="ADDRESS")
    put.add_argument("items", nargs="+", metavar="STAGE.KEY=VALUE")
    put.set_defaults(handler=run_set)
    get = actions.add_parser("get", help="the options of an address")
    get.add_argument("address", metavar="ADDRESS")
    get.add_argument("--json", action="store_true", help="machine-readable output")
    get.set_defaults(handler=run_get)
    delete = actions.add_parser("delete", help="remove options of an address")
    delete.add_argument("address", metavar="ADDRESS")
    delete.add_argument("items", nargs="*", metavar="STAGE[.KEY]")
    delete.set_defaults(handler=run_delete)
    listing = actions.add_parser("list", help="every address's options")
    listing.add_argument("--stage", help="only this stage")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(handler=run_list)


def _print(rows: Sequence[settings.Setting], *, as_json: bool, with_address: bool) -> None:
    if as_json:
        json.dump([row.as_dict() for row in rows], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    for row in rows:
        for key, value in sorted(row.options.items()):
            prefix = f"{row.address} " if with_address else ""
            sys.stdout.write(f"{prefix}{row.stage}.{key} = {value}\n")


def run_set(args: argparse.Namespace, ctx: Context) -> int:
    settings.address(args.address)  # a mistake before connecting
    with open_current(ctx.config()) as conn:
        rows = settings.set_options(conn, ctx.config(), args.address, args.items)
    _print(rows, as_json=False, with_address=True)
    return EX_OK


def run_get(args: argparse.Namespace, ctx: Context) -> int:
    settings.address(args.address)
    with open_current(ctx.config()) as conn:
        rows = settings.get_settings(conn, args.address)
    _print(rows, as_json=args.json, with_address=False)
    return EX_OK


def run_delete(args: argparse.Namespace, ctx: Context) -> int:
    settings.address(args.address)
    with open_current(ctx.config()) as conn:
        removed = settings.delete_settings(conn, args.address, args.items)
    print(f"{removed} removed")
    return EX_OK


def run_list(args: argparse.Namespace, ctx: Context) -> int:
    with open_current(ctx.config()) as conn:
        rows = settings.list_settings(conn, args.stage)
    _print(rows, as_json=args.json, with_address=True)
    return EX_OK
