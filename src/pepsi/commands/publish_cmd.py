"""`pepsi publish`: publish a message read from stdin, printing the new ids."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from pepsi.db import connect
from pepsi.errors import EX_OK
from pepsi.publish import publish

if TYPE_CHECKING:
    from pepsi.cli import Context


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "publish",
        help="publish a message read from stdin",
        description="Read a message body from stdin and publish COUNT copies at STAGE in "
        "one transaction (one confirm, one notification). Prints each new id on its own "
        "line once committed.",
    )
    parser.add_argument("--stage", required=True, help="the first stage")
    parser.add_argument("--sender", help="envelope sender ('' for the null sender)")
    parser.add_argument(
        "--recipient", action="append", default=[], dest="recipients", help="repeatable"
    )
    parser.add_argument("--user", help="authenticated submitter (origin user)")
    parser.add_argument("--peer", help="IP address of the connecting peer")
    parser.add_argument("--message-id", help="the message's id (travels with it)")
    parser.add_argument("--count", type=int, default=1, help="copies to publish (default 1)")
    parser.set_defaults(handler=run_publish)


def run_publish(args: argparse.Namespace, ctx: Context) -> int:
    config = ctx.config()
    body = sys.stdin.buffer.read() if not sys.stdin.isatty() else b""
    target = connect.resolve(config)
    with connect.connect(target.dsn, timeout=config.postgres.connect_timeout) as conn:
        ids = publish(
            conn,
            config,
            args.stage,
            body=body,
            sender=args.sender,
            recipients=args.recipients,
            user=args.user,
            peer=args.peer,
            message_id=args.message_id,
            count=args.count,
        )
    sys.stdout.write("".join(f"{i}\n" for i in ids))
    return EX_OK
