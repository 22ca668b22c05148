"""`pepsi config check` (alias `pepsi-config check`): validate and show the stage graph."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pepsi.commands import Context, summary
from pepsi.config import Config, default_locations, find_config
from pepsi.durations import format_duration
from pepsi.errors import EX_OK, ConfigError

if TYPE_CHECKING:
    from rich.console import Console


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("config", help=summary("config"))
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check",
        help="validate the configuration and print the stage graph",
        description="Parse pepsi.conf (the -c FILE, or the first default location that "
        "exists), validate the stage graph and print it. Exit 0 if valid, 1 otherwise.",
    )
    check.set_defaults(handler=run_check)


def run_check(args: argparse.Namespace, ctx: Context) -> int:
    from pepsi.terminal import console as make_console  # noqa: PLC0415  # rich loads slowly

    if find_config(ctx.config_path) is None:
        searched = ", ".join(str(p) for p in default_locations())
        raise ConfigError(f"no configuration file found (searched {searched}; use -c FILE)")
    config = ctx.config()
    console = make_console()
    render_graph(config, console)
    for warning in config.warnings:
        console.print(f"warning: {warning}", highlight=False, markup=False)
    console.print(f"{config.path}: OK", highlight=False, markup=False)
    return EX_OK


def chains(config: Config) -> list[list[str]]:
    """Each entry stage followed along NEXT until the end or a repeat."""
    result = []
    for entry in config.entry_stages() or list(config.stages)[:1]:
        chain: list[str] = []
        node: str | None = entry
        while node is not None and node not in chain:
            chain.append(node)
            node = config.stages[node].next
        if node is not None:
            chain.append(f"{node} (cycle)")
        else:
            chain.append("done")
        result.append(chain)
    return result


def render_graph(config: Config, console: Console) -> None:
    from pepsi.terminal import table as make_table  # noqa: PLC0415

    table = make_table("stages", "stage", "runs", "next", "bounce", "pool", "max runtime")
    for stage in config.stages.values():
        runs = f"handler {stage.handler}" if stage.handler else f"program {stage.program}"
        table.add_row(
            stage.name,
            runs,
            stage.next or "(finish)",
            stage.bounce_stage or "(fail)",
            f"{stage.parallelism} × {stage.queue_limit}",
            format_duration(stage.max_runtime),
        )
    if not config.stages:
        console.print("no stages configured ([stage-NAME] sections)", markup=False)
        return
    console.print(table)
    for chain in chains(config):
        console.print("  " + " → ".join(chain), highlight=False, markup=False)
