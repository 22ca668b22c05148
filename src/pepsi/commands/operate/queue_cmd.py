"""`pepsi queue` (alias `pepsi-queue`): inspect the queue and repair it without SQL.

    status                     counts per stage and status, oldest pending age,
                               next retry, failures by class, and a warning
                               when a transaction holds back vacuum (longer
                               than $PEPSI_HORIZON_WARN_AFTER, default 60s)
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
from collections.abc import Mapping
from dataclasses import asdict
from datetime import datetime
from typing import Any

from pepsi.admin import horizon, queue, queue_repair, serving
from pepsi.admin.connection import open_current
from pepsi.admin.watch import claimed
from pepsi.commands import Context, summary
from pepsi.errors import EX_OK, QueueError, RepairRefused


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
    threshold = horizon.warn_after()  # before connecting: a bad value is the caller's mistake
    with open_current(ctx.config()) as conn:
        read = queue.status(conn)
        dispatcher, serves = serving.served(conn)
        counts: Mapping[str, Mapping[str, int]] = {s.stage: s.counts for s in read.stages}
        if dispatcher is not None and claimed.has_worker_rows(counts):
            begun = claimed.started(conn)  # read ahead or started: the dispatcher says
            if begun is not None:
                counts = claimed.split_counts(counts, claimed.started_by_stage(conn, begun))
    holder = read.horizon
    pending = {s.stage: s.counts.get("pending", 0) for s in read.stages}
    unserved = serving.unserved(pending, serves, running=dispatcher is not None)
    data: dict[str, Any] = {
        "stages": [_stage_data(s, counts[s.stage]) for s in read.stages],
        "failures": [asdict(f) for f in read.failures],
        "oldest_transaction": None
        if holder is None
        else {**holder.as_dict(), "late": horizon.is_late(holder, threshold)},
        "unserved": [{"stage": stage, "pending": n} for stage, n in unserved],
    }
    if args.json:
        _emit(data)
        return EX_OK
    from pepsi.terminal import console, table  # noqa: PLC0415  # rich loads slowly

    out = console()
    statuses = ("pending", "claimed", "running", "paused", "failed", "timeout")
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
    warning = horizon.warning(holder, threshold)  # a line only past the threshold
    if warning is not None:
        out.print(warning, style="bold yellow", markup=False, highlight=False, soft_wrap=True)
    for stage, n in unserved:
        line = "warning: " + serving.describe(stage, n)
        out.print(line, style="bold yellow", markup=False, highlight=False, soft_wrap=True)
    return EX_OK


def _stage_data(stage: queue.StageStatus, counts: Mapping[str, int]) -> dict[str, Any]:
    oldest = stage.oldest_pending_s
    return {
        "stage": stage.stage,
        **counts,  # only the statuses present; `claimed`: running, not started yet
        "oldest_pending_s": None if oldest is None else round(oldest, 1),
        "next_retry": stage.next_retry,
    }


def run_list(args: argparse.Namespace, ctx: Context) -> int:
    if args.limit < 1:
        raise QueueError("--limit must be at least 1")
    where = queue.MessageFilter(stage=args.stage, status=args.status, sender_key=args.sender_key)
    with open_current(ctx.config()) as conn:
        items = [asdict(m) for m in queue.list_messages(conn, where, limit=args.limit)]
        if any(i["status"] == "running" for i in items) and serving.served(conn)[0] is not None:
            begun = claimed.started(conn)  # read ahead or started: the dispatcher says
            for item in items:
                item["status"] = claimed.label(item["status"], item["id"], item["stage"], begun)
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
    with open_current(ctx.config()) as conn:
        item = asdict(queue.get_message(conn, args.id, with_body=args.body))
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
    # The domain refuses this too; here it comes first, in the command line's words.
    if not args.ids and not args.all and not args.stage:
        raise RepairRefused(f"say which messages: IDs, --stage STAGE or --all ({name} refused)")
    selection = queue_repair.Selection(
        ids=tuple(args.ids),
        stage=args.stage,
        failure_class=getattr(args, "failure_class", None),
        every=args.all,
    )
    request = queue_repair.RepairRequest(name, selection, to=getattr(args, "to", None))
    stages = ctx.config().stages
    queue_repair.check(request, stages)  # before connecting, as the mistake is the command line's
    confirm = _confirm_delete if name == "delete" and not args.yes else None
    with open_current(ctx.config()) as conn:
        done = queue_repair.repair(conn, request, stages=stages, confirm=confirm)
    changed = list(done.ids)
    if args.json:
        _emit({"action": name, "ids": changed})
    else:
        print(f"{name}: {len(changed)} message(s)" + (f" ({_ids(changed)})" if changed else ""))
    return EX_OK


def _confirm_delete(plan: queue_repair.RepairPlan) -> bool:
    """Asked inside the repair's transaction, with the count it would delete."""
    if not sys.stdin.isatty():
        raise RepairRefused(f"delete {plan.count} message(s)? add --yes to confirm")
    answer = input(f"delete {plan.count} message(s)? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def _ids(ids: list[int]) -> str:
    shown = ", ".join(map(str, ids[:20]))
    return shown + (f" and {len(ids) - 20} more" if len(ids) > 20 else "")
