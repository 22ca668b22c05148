"""`pepsi cluster …`: a three-node replicated PostgreSQL on this machine (development, tests).

Production clusters are built by their operators (docs/replication.md); this
harness runs the same settings on loopback to try failovers by hand and in
the test suite.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pepsi.cluster.layout import DEFAULT_BASE_PORT, NODES
from pepsi.commands import Context, summary
from pepsi.errors import EX_OK, UsageError

if TYPE_CHECKING:
    from pepsi.cluster.harness import Cluster


def default_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "pepsi" / "cluster"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "cluster",
        help=summary("cluster"),
        description="Three PostgreSQL nodes under Patroni with quorum commit "
        "(ANY 1 of the two standbys) and etcd, on loopback. Point Pepsi at it with "
        'PEPSI_DSN="$(pepsi cluster dsn)". A development and test harness: see '
        "docs/replication.md for production.",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help=f"the cluster's directory (default {default_dir()})",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    create = actions.add_parser("create", help="write the cluster's files and start it")
    create.add_argument(
        "--port",
        type=int,
        default=DEFAULT_BASE_PORT,
        help=f"base port: etcd on PORT, PostgreSQL on PORT+11..13 (default {DEFAULT_BASE_PORT})",
    )
    create.add_argument("--no-start", action="store_true", help="only write the files")
    create.set_defaults(handler=run_create)
    start = actions.add_parser("start", help="start the cluster, or one node (it rejoins)")
    start.add_argument("node", nargs="?", choices=NODES, help="only this node")
    start.set_defaults(handler=run_start)
    actions.add_parser("stop", help="stop every node, then etcd").set_defaults(handler=run_stop)
    actions.add_parser("status", help="each node's role, state and lag").set_defaults(
        handler=run_status
    )
    actions.add_parser(
        "kill-primary", help="SIGKILL the primary's Patroni and PostgreSQL (a lost host)"
    ).set_defaults(handler=run_kill_primary)
    kill = actions.add_parser("kill", help="SIGKILL one node's Patroni and PostgreSQL")
    kill.add_argument("node", choices=NODES)
    kill.set_defaults(handler=run_kill)
    actions.add_parser("dsn", help="print the multi-host DSN for PEPSI_DSN").set_defaults(
        handler=run_dsn
    )
    destroy = actions.add_parser("destroy", help="kill everything and delete the directory")
    destroy.add_argument("--yes", action="store_true", help="really delete it")
    destroy.set_defaults(handler=run_destroy)


def _root(args: argparse.Namespace) -> Path:
    return (args.dir or default_dir()).expanduser().absolute()


def _open(args: argparse.Namespace) -> Cluster:
    from pepsi.cluster.harness import Cluster  # noqa: PLC0415

    return Cluster.open(_root(args))


def run_create(args: argparse.Namespace, ctx: Context) -> int:
    from pepsi.cluster.harness import Cluster  # noqa: PLC0415
    from pepsi.cluster.layout import Layout  # noqa: PLC0415

    if not 1024 <= args.port <= 65535 - 30:
        raise UsageError(f"--port {args.port}: choose a base port in 1024..65505")
    cluster = Cluster(Layout(_root(args), args.port))
    cluster.create()
    print(f"cluster created in {cluster.layout.root}")
    if not args.no_start:
        cluster.start()
        print(f"primary: {cluster.leader()}")
        print(f'use it: PEPSI_DSN="{cluster.layout.dsn()}"')
    return EX_OK


def run_start(args: argparse.Namespace, ctx: Context) -> int:
    cluster = _open(args)
    if args.node:
        cluster.start_node(args.node)
        print(f"{args.node} running")
    else:
        cluster.start()
        print(f"cluster running; primary: {cluster.leader()}")
    return EX_OK


def run_stop(args: argparse.Namespace, ctx: Context) -> int:
    _open(args).stop()
    print("cluster stopped")
    return EX_OK


def run_status(args: argparse.Namespace, ctx: Context) -> int:
    from pepsi.terminal import console as make_console  # noqa: PLC0415  # rich loads slowly
    from pepsi.terminal import table as make_table  # noqa: PLC0415

    cluster = _open(args)
    members = {m.name: m for m in cluster.members()}
    table = make_table(f"cluster {cluster.layout.root}", "node", "port", "role", "state", "lag")
    for node in NODES:
        member = members.get(node)
        port = str(cluster.layout.pg_port(node))
        if member is None:
            table.add_row(node, port, "-", "down", "-")
            continue
        lag = "-" if member.lag is None else f"{member.lag} B"
        table.add_row(node, port, member.role, member.state, lag)
    console = make_console()
    console.print(table)
    leader = cluster.leader()
    if leader is not None:
        quorum = cluster.synchronous_standby_names(leader)
        console.print(f"synchronous_standby_names on {leader}: {quorum!r}")
    else:
        console.print("no primary: writes wait until one is elected")
    return EX_OK


def run_kill_primary(args: argparse.Namespace, ctx: Context) -> int:
    print(f"killed {_open(args).kill_primary()}")
    return EX_OK


def run_kill(args: argparse.Namespace, ctx: Context) -> int:
    _open(args).kill(args.node)
    print(f"killed {args.node}")
    return EX_OK


def run_dsn(args: argparse.Namespace, ctx: Context) -> int:
    print(_open(args).layout.dsn())
    return EX_OK


def run_destroy(args: argparse.Namespace, ctx: Context) -> int:
    cluster = _open(args)
    if not args.yes:
        raise UsageError(f"this deletes {cluster.layout.root} and its data: add --yes")
    cluster.destroy()
    print(f"cluster in {cluster.layout.root} destroyed")
    return EX_OK
