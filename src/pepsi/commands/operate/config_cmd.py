"""`pepsi config check|reload|set|unset` (alias `pepsi-config`): the stage graph, and
live reconfiguration through the database overlay (P-10)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pepsi.commands import Context, summary
from pepsi.config import Config, StageConfig, default_locations, find_config
from pepsi.durations import format_duration
from pepsi.errors import EX_OK, ConfigError, WorkerRefused

if TYPE_CHECKING:
    from rich.console import Console

    from pepsi.admin.config.overlay import Change


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("config", help=summary("config"))
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check",
        help="validate the configuration and print the stage graph",
        description="Parse pepsi.conf (the -c FILE, or the first default location that "
        "exists), validate the stage graph and print it, then import each HANDLER (and "
        "check each built-in's files) as a worker would at its start, with the "
        "configuration's directory and the current one on the path. Exit 0 if valid, "
        "1 otherwise.",
    )
    check.add_argument(
        "--no-import",
        action="store_true",
        help="check the file only: do not import the handlers (a machine without them)",
    )
    check.set_defaults(handler=run_check)
    reload = actions.add_parser(
        "reload",
        help="ask the running dispatcher to reload the file and the overlay",
        description="Send NOTIFY config_changed: the dispatcher reads pepsi.conf and the "
        "database overlay again, swaps its stage table and retires every live worker "
        "(SIGHUP to the dispatcher does the same). A graph that does not parse stops it "
        "with exit 78; [pepsi-dispatch] changes need a restart (docs/configuration.md).",
    )
    reload.set_defaults(handler=run_reload)
    set_ = actions.add_parser(
        "set",
        help="set keys in the database overlay and reload",
        description="Write SECTION.KEY=VALUE rows into pepsi.config_override (for example "
        "stage-deliver.PARALLELISM=8, or a whole new stage: stage-extra.HANDLER=pkg.mod:fn) "
        "and notify the dispatcher, in one transaction. The result is checked as the "
        "dispatcher will load it, file plus overlay: if it does not load, nothing is written. "
        "[pepsi-dispatch] cannot be set here.",
    )
    set_.add_argument("assignments", nargs="+", metavar="SECTION.KEY=VALUE")
    set_.set_defaults(handler=run_set)
    unset = actions.add_parser(
        "unset",
        help="remove keys from the database overlay and reload",
        description="Delete SECTION.KEY rows from pepsi.config_override (the file's value, "
        "or the default, applies again) and notify the dispatcher, in one transaction, "
        "if the result still loads.",
    )
    unset.add_argument("keys", nargs="+", metavar="SECTION.KEY")
    unset.set_defaults(handler=run_unset)


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
    refused = [] if args.no_import else _starts(config)
    for problem in refused:
        console.print(f"error: {problem}", highlight=False, markup=False)
    if refused:
        raise ConfigError(
            f"{config.path}: {len(refused)} stage(s) would not start (see above); "
            "a worker refuses the same way"
        )
    console.print(f"{config.path}: OK", highlight=False, markup=False)
    return EX_OK


def _starts(config: Config) -> list[str]:
    """What each Python stage's worker would refuse at its start (W-7): the problems."""
    from pepsi.worker.handlers import load_handler  # noqa: PLC0415

    for folder in (Path.cwd(), config.path.parent if config.path else None):
        if folder is not None and str(folder) not in sys.path:
            sys.path.insert(0, str(folder))  # as the worker's: the file's folder first
    problems = []
    for stage in config.stages.values():
        if stage.handler is None:
            continue  # an executable: nothing to import
        try:
            load_handler(stage)
        except WorkerRefused as exc:
            problems.append(str(exc))
    return problems


def run_reload(args: argparse.Namespace, ctx: Context) -> int:
    from pepsi.admin.config import overlay  # noqa: PLC0415  # the driver only when it is needed
    from pepsi.admin.connection import open_current  # noqa: PLC0415

    with open_current(ctx.config(), application_name="pepsi-config") as conn:
        overlay.request_reload(conn)
    print("reload requested (NOTIFY config_changed)")
    return EX_OK


def run_set(args: argparse.Namespace, ctx: Context) -> int:
    from pepsi.admin.config import overlay  # noqa: PLC0415

    changes = [overlay.parse_assignment(a, with_value=True) for a in args.assignments]
    return _apply(ctx, changes)


def run_unset(args: argparse.Namespace, ctx: Context) -> int:
    from pepsi.admin.config import overlay  # noqa: PLC0415

    changes = [overlay.parse_assignment(k, with_value=False) for k in args.keys]
    return _apply(ctx, changes)


def _apply(ctx: Context, changes: list[Change]) -> int:
    from pepsi.admin.config import overlay  # noqa: PLC0415
    from pepsi.admin.connection import open_current  # noqa: PLC0415

    with open_current(ctx.config(), application_name="pepsi-config") as conn:
        config = overlay.apply(conn, ctx.config(), changes)
    for change in changes:
        shown = "(unset)" if change.value is None else change.value
        print(f"[{change.section}] {change.key} = {shown}")
    print(f"{len(config.stages)} stages; reload requested (NOTIFY config_changed)")
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
        while (
            node is not None
            and node in config.stages
            and node not in chain
            and not config.stages[node].routes
        ):
            chain.append(node)
            node = config.stages[node].next
        if node is not None and node not in config.stages:
            chain.append(f"{node} (AMQP queue)")
        elif node is not None and config.stages[node].routes and node not in chain:
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
