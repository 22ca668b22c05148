"""`pepsi worker`: the unified worker program the dispatcher starts for HANDLER stages."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pepsi.commands import summary
from pepsi.db import connect
from pepsi.errors import ConfigError, WorkerRefused
from pepsi.worker import runtime

if TYPE_CHECKING:
    from pepsi.commands import Context


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "worker",
        help=summary("worker"),
        description="Run the Python stage named by $PEPSI_STAGE behind the worker "
        "protocol: print `ready`, then read message ids on stdin and write one status "
        "line per id. Exits 78 before `ready` if the configuration, the handler or the "
        "database schema is not usable.",
    )
    parser.set_defaults(handler=run_worker)


def run_worker(args: argparse.Namespace, ctx: Context) -> int:
    stage = runtime.stage_from_env()
    try:
        config = ctx.config()
    except WorkerRefused:
        raise
    except ConfigError as exc:  # a configuration that does not parse: refuse (W-7)
        raise WorkerRefused(str(exc)) from None
    return runtime.run(config, stage, connect.resolve(config).dsn)
