"""Subcommands of `pepsi`: each module registers one on the parser.

Only commands that work are registered (and so listed in --help).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pepsi.commands import (
    bouncer_cmd,
    config_cmd,
    db_cmd,
    dispatch_cmd,
    ingress_cmd,
    queue_cmd,
    setup_cmd,
    top_cmd,
    worker_cmd,
)

Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

COMMANDS: tuple[Register, ...] = (
    setup_cmd.register,
    config_cmd.register,
    db_cmd.register,
    dispatch_cmd.register,
    ingress_cmd.register,
    bouncer_cmd.register,
    queue_cmd.register,
    top_cmd.register,
    worker_cmd.register,
)
