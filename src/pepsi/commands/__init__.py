"""Subcommands of `pepsi`: one module each, imported only when it runs.

The table names every command with its one-line help, so `pepsi --help`
lists them all without importing any; the command that runs is the only
module loaded. That keeps `pepsi worker` (started for every worker process)
from paying for the dispatcher, the publishers, rich and prometheus_client.
Only commands that work are listed.

A command module parses its arguments, calls the domain (`pepsi.admin`, the
dispatcher, the worker, publishing) and prints; its handler gets the parsed
arguments and a `Context`, defined here so that `pepsi.cli` and the command
modules import it from the one module both already load.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pepsi.config import Config, load_config


@dataclass
class Context:
    """What every command handler gets: the global options, the config on demand."""

    prog: str
    config_path: Path | None
    verbose: bool
    _config: Config | None = field(default=None, repr=False)

    def config(self) -> Config:
        if self._config is None:
            self._config = load_config(self.config_path)
        return self._config


Handler = Callable[[argparse.Namespace, Context], int]


@dataclass(frozen=True)
class Command:
    name: str
    module: str  # defines register(sub) adding the full parser of `name`
    help: str
    aliases: tuple[str, ...] = ()


COMMANDS: tuple[Command, ...] = (
    Command("setup", "install.setup_cmd", "install or upgrade the database schema"),
    Command("config", "operate.config_cmd", "check the configuration; reload, set, unset (live)"),
    Command("db", "install.db_cmd", "manage the embedded database, show the one in use"),
    Command(
        "cluster", "install.cluster_cmd", "a three-node replicated PostgreSQL on this machine (dev)"
    ),
    Command("dispatch", "serve.dispatch_cmd", "run the dispatcher"),
    Command(
        "ingress",
        "serve.ingress_cmd",
        "publish messages (stdin, files or JSON lines); --serve: the SMTP/LMTP server",
        aliases=("publish",),
    ),
    Command(
        "failure-bouncer",
        "serve.bouncer_cmd",
        "move failed messages of stages without BOUNCE_STAGE to the dead-letter sink",
    ),
    Command("queue", "operate.queue_cmd", "inspect and repair the queue"),
    Command("settings", "operate.settings_cmd", "per-address overrides of stage options"),
    Command("amqp", "accounts.amqp_cmd", "AMQP users, vhosts and permissions"),
    Command("mail", "accounts.mail_cmd", "users who may log in to the SMTP/LMTP ingress"),
    Command("top", "operate.top_cmd", "live view: backlog, workers and rates per stage"),
    Command("web", "serve.web_cmd", "the web console: see the pipeline and repair it in a browser"),
    Command("systemd", "serve.systemd_cmd", "print the dispatcher's or the ingress's systemd unit"),
    Command(
        "telemetry", "operate.telemetry_cmd", "turn feature telemetry on or off; show its status"
    ),
    Command("worker", "serve.worker_cmd", "run one stage's worker (started by the dispatcher)"),
)


def summary(name: str) -> str:
    """The one-line help of command `name`, for its module's parser."""
    return next(c.help for c in COMMANDS if c.name == name)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], wanted: str | None) -> None:
    """Add every command to `sub`: `wanted` in full, the others by name and help only."""
    for command in COMMANDS:
        if wanted is not None and wanted in (command.name, *command.aliases):
            module = importlib.import_module(f"pepsi.commands.{command.module}")
            module.register(sub)
        else:
            sub.add_parser(command.name, aliases=list(command.aliases), help=command.help)
