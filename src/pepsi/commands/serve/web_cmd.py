"""`pepsi web`: the web console (docs/web.md).

    pepsi web [--listen HOST:PORT]        serve it (default 127.0.0.1:8080) until Ctrl-C
    pepsi web url                         print the link (with its token) of running consoles
    pepsi web password [--password-stdin] print the hash for [pepsi-web] PASSWORD

Without a PASSWORD the console serves only this machine, repairs nothing, and
lets in whoever opens the link it prints: a token drawn at each start, kept in
a file only you can read (`pepsi web url` prints it again). Listening on
another address then refuses to start. With a PASSWORD, every page asks for a
login, and repairs are allowed unless READ_ONLY = yes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from pepsi.amqp.auth.passwords import hash_password
from pepsi.commands import Context, summary
from pepsi.commands.accounts.passwords import read_password
from pepsi.config import values
from pepsi.errors import EX_ERROR, EX_OK, ConfigError, UsageError

log = logging.getLogger("pepsi.web")
DEFAULT_LISTEN = "127.0.0.1:8080"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "web",
        help=summary("web"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help=f"where to serve the console (default {DEFAULT_LISTEN}; port 0: a free one)",
    )
    parser.set_defaults(handler=run_web)
    actions = parser.add_subparsers(dest="action", metavar="[ACTION]")
    password = actions.add_parser(
        "password", help="print the hash of a password, for [pepsi-web] PASSWORD"
    )
    password.add_argument(
        "--password-stdin", action="store_true", help="read the password from standard input"
    )
    password.set_defaults(handler=run_password)
    url = actions.add_parser(
        "url", help="print the link, with its token, of each console running as you"
    )
    url.set_defaults(handler=run_url)


def run_password(args: argparse.Namespace, ctx: Context) -> int:
    secret = read_password(args.password_stdin)
    if not secret:
        raise UsageError("the password is empty")
    print(hash_password(secret))
    return EX_OK


def run_url(args: argparse.Namespace, ctx: Context) -> int:
    from pepsi.web import tokens  # noqa: PLC0415

    consoles = tokens.running()
    if not consoles:
        print(
            f"no console without a password runs as this user ({tokens.folder()} lists none); "
            "start one with `pepsi web`, or [pepsi-web] LISTEN for the dispatcher's",
            file=sys.stderr,
        )
        return EX_ERROR
    for console in consoles:
        print(f"{console.link}  ({console.by}, pid {console.pid})")
    return EX_OK


def run_web(args: argparse.Namespace, ctx: Context) -> int:
    from pepsi.admin.connection import open_current  # noqa: PLC0415
    from pepsi.db import connect  # noqa: PLC0415
    from pepsi.web import server  # noqa: PLC0415  # aiohttp only when serving

    config = ctx.config()
    try:
        address = values.listen_address(args.listen or DEFAULT_LISTEN)
    except ValueError as exc:
        raise UsageError(f"--listen: {exc}") from None
    if address is None:
        raise UsageError("--listen: the console needs an address")
    try:
        server.check_exposure(config, address[0])
    except ConfigError as exc:
        raise UsageError(f"--listen: {exc.problem}") from None
    open_current(config, application_name="pepsi-web").close()  # reachable, this schema
    dsn = connect.resolve(config).dsn

    async def serve() -> None:
        try:
            running = await server.start(config, dsn, address, publish_as="pepsi web")
        except OSError as exc:
            raise UsageError(
                f"cannot listen on {address[0]}:{address[1]}: {exc.strerror}"
            ) from None
        print(f"Pepsi console at {running.link}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        try:
            await stop.wait()
        finally:
            await running.stop()

    try:
        asyncio.run(serve())
    except ConfigError:
        raise
    except KeyboardInterrupt:
        pass
    with contextlib.suppress(Exception):
        logging.shutdown()
    return EX_OK
