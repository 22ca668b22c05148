"""`pepsi config check` (alias `pepsi-config check`): validate and show the stage graph."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pepsi.commands import Context, summary
from pepsi.config import Config, StageConfig, default_locations, find_config
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
    """Each entry stage followed along NEXT until the end, a repeat or a branch.

    A built-in that routes (an if stage) ends its chain with `(routes)`: its
    THEN and ELSE are printed on lines of their own.
    """
    result = []
    for entry in config.entry_stages() or list(config.stages)[:1]:
        chain: list[str] = []
        node: str | None = entry
        while node is not None and node not in chain and not config.stages[node].routes:
            chain.append(node)
            node = config.stages[node].next
        if node is not None and config.stages[node].routes and node not in chain:
            chain.extend((node, "(routes)"))
        elif node is not None:
            chain.append(f"{node} (cycle)")
        else:
            chain.append("done")
        result.append(chain)
    return result


def render_graph(config: Config, console: Console) -> None:
    from pepsi.terminal import table as make_table  # noqa: PLC0415

    table = make_table("stages", "stage", "runs", "next", "bounce", "pool", "max runtime")
    for stage in config.stages.values():
        table.add_row(
            stage.name,
            _runs(stage),
            _next(stage),
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
    for stage in config.stages.values():
        if stage.builtin is not None and stage.routes:
            routes = ", ".join(f"{key} {target}" for key, target in stage.routes)
            describe = stage.builtin_options.describe()
            console.print(f"  {stage.name}: {describe}: {routes}", highlight=False, markup=False)


def _runs(stage: StageConfig) -> str:
    if stage.builtin is not None:
        return f"built-in {stage.builtin}"
    return f"handler {stage.handler}" if stage.handler else f"program {stage.program}"


def _next(stage: StageConfig) -> str:
    """NEXT, or an if stage's THEN and ELSE (its ELSE defaults to NEXT)."""
    after = stage.next or "(finish)"
    if not stage.routes:
        return after
    shown = [f"{key.lower()} {target}" for key, target in stage.routes]
    if all(key != "ELSE" for key, _ in stage.routes):
        shown.append(f"else {after}")
    return ", ".join(shown)
