"""`pepsi telemetry`: the feature telemetry switch (SPEC P-11).

    on       set [pepsi] SHARE_TELEMETRY = yes in the configuration file, tell the dispatcher
    off      set it to no, likewise
    status   the file's value, and how many live workers report

Each worker reads the switch from the file once, when it starts; `on` and
`off` rewrite that one line (the rest of the file is kept as it is) and send
NOTIFY telemetry_changed, on which the dispatcher replaces every live worker.
The messages in flight are not lost: a worker finishes its batch first.
What is reported, and where to: docs/operations.md#telemetry.
"""

from __future__ import annotations

import argparse
import sys

from pepsi.admin.config import telemetry
from pepsi.admin.connection import open_current
from pepsi.commands import Context, summary
from pepsi.errors import EX_OK, PepsiError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "telemetry",
        help=summary("telemetry"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("on", help="turn feature telemetry on").set_defaults(
        handler=run_switch, on=True
    )
    actions.add_parser("off", help="turn feature telemetry off").set_defaults(
        handler=run_switch, on=False
    )
    actions.add_parser("status", help="the file's value and the live workers'").set_defaults(
        handler=run_status
    )


def _word(on: bool) -> str:
    return "yes" if on else "no"


def run_switch(args: argparse.Namespace, ctx: Context) -> int:
    config = ctx.config()
    path = telemetry.config_file(config)
    changed = telemetry.write_switch(path, args.on)
    line = f"{telemetry.KEY} = {_word(args.on)} in {path}{'' if changed else ' (already)'}"
    try:
        with open_current(config, application_name=telemetry.APPLICATION_NAME) as conn:
            telemetry.notify_changed(conn)
    except PepsiError:
        # The file is the switch and it is set; only the live workers keep the old value.
        where = f" -c {ctx.config_path}" if ctx.config_path else ""
        again = f"{ctx.prog}{where} telemetry {'on' if args.on else 'off'}"
        print(f"{line}; the dispatcher was NOT told: run `{again}` again", file=sys.stderr)
        raise
    print(f"{line}; the dispatcher replaces its workers")
    return EX_OK


def run_status(args: argparse.Namespace, ctx: Context) -> int:
    config = ctx.config()
    where = f"in {config.path}" if config.path else "(the default: no configuration file)"
    print(f"{telemetry.KEY} = {_word(config.pepsi.share_telemetry)} {where}")
    with open_current(config, application_name=telemetry.APPLICATION_NAME) as conn:
        stages = telemetry.live_workers(conn)
    live = sum(s.live for s in stages)
    reporting = sum(s.reporting for s in stages)
    print(f"live workers: {live}, reporting telemetry: {reporting}")
    width = max((len(s.stage) for s in stages), default=0)
    for s in stages:
        print(f"  {s.stage:<{width}}  {s.reporting} of {s.live}")
    return EX_OK
