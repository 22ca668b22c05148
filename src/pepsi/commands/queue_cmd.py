"""`pepsi queue` (alias `pepsi-queue`): inspect the queue and repair it without SQL.

    status                     counts per stage and status, oldest pending age,
                               next retry, failures by class
    list [selectors]           the rows themselves
    show ID [--body]           one message: envelope, state, sizes, body
    resume IDS | selectors     paused -> pending now
    retry IDS | selectors      failed/timeout -> pending at the failed stage, counts reset
    move IDS --to STAGE        to another stage, pending
    delete IDS [--yes]         remove messages

Each repair is one transaction and sends one NOTIFY. A `running` row belongs
to the dispatcher (it is the only writer of pending -> running): repairs
leave running rows alone unless no dispatcher holds its lock, in which case
that lock is held for the repair's transaction.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pepsi.commands import summary
from pepsi.db import connect, schema
from pepsi.db.queries import query
from pepsi.errors import EX_OK, PepsiError

if TYPE_CHECKING:
    from pepsi.cli import Context

REPAIRS = {
    "resume": (("paused",), "queue_resume"),
    "retry": (("failed", "timeout"), "queue_retry"),
    "move": (("pending", "paused", "failed", "timeout", "running"), "queue_move"),
    "delete": (("pending", "paused", "failed", "timeout", "running"), "queue_delete"),
}


class RepairRefused(PepsiError):
    """A repair that cannot be done as asked; nothing was changed."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "queue",
        help=summary("queue"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    status = actions.add_parser("status", help="counts, ages, retries and failures")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(handler=run_status)
    listing = actions.add_parser("list", help="list messages")
    _selectors(listing)
    listing.add_argument("--status", choices=("pending", "running", "paused", "failed", "timeout"))
    listing.add_argument("--sender-key", help="e.g. user:alice, ip:192.0.2.7")
    listing.add_argument("--limit", type=int, default=50)
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(handler=run_list)
    show = actions.add_parser("show", help="one message")
    show.add_argument("id", type=int)
    show.add_argument("--body", action="store_true", help="print the body too")
    show.add_argument("--json", action="store_true")
    show.set_defaults(handler=run_show)
    for name, text in (
        ("resume", "paused messages: pending now"),
        ("retry", "failed/timeout messages: pending again at their failed stage"),
        ("move", "messages to another stage, pending"),
        ("delete", "remove messages"),
    ):
        repair = actions.add_parser(name, help=text)
        repair.add_argument("ids", nargs="*", type=int, metavar="ID")
        _selectors(repair)
        repair.add_argument("--all", action="store_true", help="every message that qualifies")
        if name == "retry":
            repair.add_argument("--failure-class", help="permanent, crashed, timed-out, ...")
        if name == "move":
            repair.add_argument("--to", required=True, metavar="STAGE")
        if name == "delete":
            repair.add_argument("--yes", action="store_true", help="do not ask")
        repair.add_argument("--json", action="store_true")
        repair.set_defaults(handler=run_repair, repair=name)


def _selectors(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stage", help="only this stage")


def _connect(ctx: Context) -> Any:
    config = ctx.config()
    conn = connect.connect(connect.resolve(config).dsn, timeout=config.postgres.connect_timeout)
    schema.require_current(conn)
    return conn


def _emit(data: Any) -> None:
    json.dump(data, sys.stdout, default=_json_default, indent=2)
    sys.stdout.write("\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise TypeError(type(value).__name__)


def run_status(args: argparse.Namespace, ctx: Context) -> int:
    with _connect(ctx) as conn:
        counts = conn.execute(query("queue_status_counts")).fetchall()
        stages = sorted({str(r[0]) for r in counts})
        heads = conn.execute(query("queue_status_heads"), {"stages": stages}).fetchall()
        failures = conn.execute(query("queue_status_failures")).fetchall()
    by_stage: dict[str, dict[str, Any]] = {s: {"stage": s} for s in stages}
    for stage, status, n in counts:
        by_stage[stage][status] = int(n)
    for stage, oldest, next_retry in heads:
        by_stage[stage]["oldest_pending_s"] = None if oldest is None else round(float(oldest), 1)
        by_stage[stage]["next_retry"] = next_retry
    data = {
        "stages": list(by_stage.values()),
        "failures": [
            {"stage": s, "status": st, "failure_class": c, "count": int(n)}
            for s, st, c, n in failures
        ],
    }
    if args.json:
        _emit(data)
        return EX_OK
    from pepsi.terminal import console, table  # noqa: PLC0415  # rich loads slowly

    out = console()
    statuses = ("pending", "running", "paused", "failed", "timeout")
    grid = table("queue", "stage", *statuses, "oldest pending", "next retry")
    for row in data["stages"]:
        oldest = row.get("oldest_pending_s")
        retry = row.get("next_retry")
        grid.add_row(
            row["stage"],
            *(str(row.get(s, 0)) for s in statuses),
            "-" if oldest is None else f"{oldest:.1f}s",
            "-" if retry is None else retry.strftime("%Y-%m-%d %H:%M:%S"),
        )
    out.print(grid if data["stages"] else "queue: empty")
    if data["failures"]:
        failed = table("failures", "stage", "status", "failure class", "count")
        for f in data["failures"]:
            failed.add_row(f["stage"], f["status"], f["failure_class"], str(f["count"]))
        out.print(failed)
    return EX_OK


def run_list(args: argparse.Namespace, ctx: Context) -> int:
    if args.limit < 1:
        raise RepairRefused("--limit must be at least 1")
    with _connect(ctx) as conn:
        rows = conn.execute(
            query("queue_list"),
            {"stage": args.stage, "status": args.status, "sender_key": args.sender_key,
             "limit": args.limit},
        ).fetchall()  # fmt: skip
    keys = ("id", "stage", "status", "arrived", "timeout", "sender_key", "message_id",
            "last_error", "strikes")  # fmt: skip
    items = [dict(zip(keys, row, strict=True)) for row in rows]
    if args.json:
        _emit(items)
        return EX_OK
    from pepsi.terminal import console, table  # noqa: PLC0415

    grid = table("messages", "id", "stage", "status", "sender", "strikes", "last error")
    for item in items:
        grid.add_row(
            str(item["id"]), item["stage"], item["status"], item["sender_key"],
            str(item["strikes"]), (item["last_error"] or "")[:60],
        )  # fmt: skip
    console().print(grid)
    return EX_OK


def run_show(args: argparse.Namespace, ctx: Context) -> int:
    with _connect(ctx) as conn:
        row = conn.execute(query("queue_show"), {"id": args.id}).fetchone()
    if row is None:
        raise RepairRefused(f"no message {args.id} in the queue")
    keys = ("id", "stage", "status", "arrived", "timeout", "expires", "message_id", "sender",
            "recipients", "origin_user", "origin_peer", "sender_key", "header_from", "subject",
            "content_type", "correlation_id", "properties", "state", "header_size",
            "body_size", "header", "body")  # fmt: skip
    item = dict(zip(keys, row, strict=True))
    if not args.body:
        item.pop("header")
        item.pop("body")
    if args.json:
        _emit(item)
        return EX_OK
    for key, value in item.items():
        if key in ("header", "body"):
            continue
        shown = json.dumps(value) if isinstance(value, dict | list) else value
        print(f"{key:15} {'' if shown is None else shown}")
    if args.body:
        sys.stdout.flush()
        sys.stdout.buffer.write((item["header"] or b"") + (item["body"] or b""))
        sys.stdout.buffer.write(b"\n")
    return EX_OK


def run_repair(args: argparse.Namespace, ctx: Context) -> int:
    name = args.repair
    statuses, query_name = REPAIRS[name]
    if not args.ids and not args.all and not args.stage:
        raise RepairRefused(f"say which messages: IDs, --stage STAGE or --all ({name} refused)")
    config = ctx.config()
    if name == "move" and args.to not in config.stages:
        raise RepairRefused(f"no stage named {args.to!r}")
    if args.stage and args.stage not in config.stages:
        raise RepairRefused(f"no stage named {args.stage!r}")
    with _connect(ctx) as conn, conn.transaction():
        selected = conn.execute(
            query("queue_select"),
            {"ids": args.ids, "stage": args.stage,
             "failure_class": getattr(args, "failure_class", None), "statuses": list(statuses)},
        ).fetchall()  # fmt: skip
        found = {int(r[0]) for r in selected}
        missing = [i for i in args.ids if i not in found]
        if missing:
            raise RepairRefused(
                f"{name}: no such message, or not in a state it applies to "
                f"({'/'.join(statuses)}): {', '.join(map(str, missing))}"
            )
        running = [int(r[0]) for r in selected if r[1] == "running"]
        allow_running = False
        if running:
            lock = conn.execute(query("dispatcher_lock_absent")).fetchone()
            allow_running = bool(lock and lock[0])
            if not allow_running:
                raise RepairRefused(
                    f"{name}: message(s) {', '.join(map(str, running[:10]))} are running and "
                    "the dispatcher is up; stop it or wait"
                )
        ids = sorted(found)
        if name == "delete" and not args.yes:
            if not sys.stdin.isatty():
                raise RepairRefused(f"delete {len(ids)} message(s)? add --yes to confirm")
            answer = input(f"delete {len(ids)} message(s)? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                raise RepairRefused("nothing deleted")
        done = conn.execute(
            query(query_name),
            {"ids": ids, "to": getattr(args, "to", None), "allow_running": allow_running},
        ).fetchall()
        if done and name != "delete":
            conn.execute(query("workqueue_notify"))
    changed = sorted(int(r[0]) for r in done)
    if args.json:
        _emit({"action": name, "ids": changed})
    else:
        print(f"{name}: {len(changed)} message(s)" + (f" ({_ids(changed)})" if changed else ""))
    return EX_OK


def _ids(ids: list[int]) -> str:
    shown = ", ".join(map(str, ids[:20]))
    return shown + (f" and {len(ids) - 20} more" if len(ids) > 20 else "")
