"""Repairing the queue without SQL: `pepsi queue`, the web console.

Repairs: resume (paused -> pending now), retry (failed/timeout -> pending at
the stage it failed at, its counts reset), move (to another stage, pending)
and delete. A `RepairRequest` names the action and a `Selection` (ids, or a
stage and failure class, or all); `preview()` reads which rows it would
touch, `repair()` does it as one transaction, after an optional confirmation
that sees the same plan, and sends one NOTIFY. A `running` row belongs to the
dispatcher (the only writer of pending -> running): a repair touches running
rows only when no dispatcher holds its lock, and then holds that lock for its
transaction, so none can start meanwhile.

Pass an autocommit connection: a repair is then its own transaction (inside
a caller's transaction it would be a savepoint, holding the lock and the
NOTIFY until that commits).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pepsi.admin.queue import STATUSES, Connection, Status, fits_bigint
from pepsi.config.values import is_amqp_stage
from pepsi.db.queries import query
from pepsi.errors import RepairRefused, UnknownStage

Action = Literal["resume", "retry", "move", "delete"]


@dataclass(frozen=True)
class _Repair:
    statuses: tuple[Status, ...]  # the rows it applies to, in the order errors name them
    query: str
    done: str  # past tense, for a repair not confirmed


_ANY: tuple[Status, ...] = ("pending", "paused", "failed", "timeout", "running")
REPAIRS: Mapping[Action, _Repair] = {
    "resume": _Repair(("paused",), "workqueue_resume_paused", "resumed"),
    "retry": _Repair(("failed", "timeout"), "workqueue_retry_failed", "retried"),
    "move": _Repair(_ANY, "workqueue_move_unless_running", "moved"),
    "delete": _Repair(_ANY, "workqueue_delete_unless_running", "deleted"),
}


@dataclass(frozen=True)
class Selection:
    """The messages a repair applies to, among the rows in a status it applies to.

    `ids`: those messages, each of which must qualify. `stage` (the stage a
    row is at, or failed at) and `failure_class` narrow the rows; `every`
    takes all that qualify. With neither ids, a stage nor `every` a repair is
    refused: no bulk change happens by omission.
    """

    ids: tuple[int, ...] = ()
    stage: str | None = None
    failure_class: str | None = None  # permanent, crashed, timed-out, ...
    every: bool = False
    # The web console's filters (None: any): they narrow the rows further.
    status: Status | None = None  # among the statuses the repair applies to
    sender_key: str | None = None
    older_than: float | None = None  # seconds since the row arrived

    @property
    def narrowed(self) -> bool:
        return self.status is not None or self.sender_key is not None or self.older_than is not None

    @property
    def named(self) -> bool:
        return bool(self.ids or self.stage or self.every)


@dataclass(frozen=True)
class RepairRequest:
    action: Action
    selection: Selection
    to: str | None = None  # move: the stage the messages go to


@dataclass(frozen=True)
class RepairPlan:
    """What a repair touches, read in its transaction (or in a preview's)."""

    request: RepairRequest
    ids: tuple[int, ...]  # ascending
    running: tuple[int, ...]  # of those, running: touched only while no dispatcher runs

    @property
    def count(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class RepairResult:
    action: Action
    ids: tuple[int, ...]  # the rows changed, ascending


def check(request: RepairRequest, stages: Collection[str]) -> None:
    """The request's own mistakes, found without the database (`stages`: those configured)."""
    name = request.action
    if name not in REPAIRS:
        raise RepairRefused(f"no repair named {name!r} (one of {', '.join(REPAIRS)})")
    if not request.selection.named:
        raise RepairRefused(f"say which messages: ids, a stage or all ({name} refused)")
    if name == "move":
        if request.to is None:
            raise RepairRefused("move: say which stage the messages go to")
        if request.to not in stages and not is_amqp_stage(request.to):
            raise UnknownStage(f"no stage named {request.to!r}")
    elif request.to is not None:
        raise RepairRefused(f"{name}: only move takes a stage to go to")
    chosen = request.selection
    if chosen.status is not None and chosen.status not in STATUSES:
        raise RepairRefused(f"no status {chosen.status!r} (one of {', '.join(STATUSES)})")
    if chosen.older_than is not None and not chosen.older_than >= 0:
        raise RepairRefused(f"the age must be at least 0 seconds, got {chosen.older_than}")
    stage = request.selection.stage
    if stage and stage not in stages and not is_amqp_stage(stage):  # AMQP queues: amqp:/:q
        raise UnknownStage(f"no stage named {stage!r}")


def preview(conn: Connection, request: RepairRequest, *, stages: Collection[str]) -> RepairPlan:
    """The rows `repair()` would touch now, refused for the same reasons; nothing changes."""
    check(request, stages)
    with conn.transaction():
        return _plan(conn, request)


def repair(
    conn: Connection,
    request: RepairRequest,
    *,
    stages: Collection[str],
    confirm: Callable[[RepairPlan], bool] | None = None,
) -> RepairResult:
    """Do `request` in one transaction; `confirm` sees the plan first and may decline.

    Refused (RepairRefused, nothing changed) when a given id does not exist or
    is not in a status the repair applies to, when a stage does not exist,
    when running rows are selected while a dispatcher runs, or when `confirm`
    returns False.
    """
    check(request, stages)
    spec = REPAIRS[request.action]
    with conn.transaction():
        plan = _plan(conn, request)
        if confirm is not None and not confirm(plan):
            raise RepairRefused(f"nothing {spec.done}")
        done = conn.execute(
            query(spec.query),
            {"ids": list(plan.ids), "to": request.to, "allow_running": bool(plan.running)},
        ).fetchall()
        if done and request.action != "delete":
            conn.execute(query("workqueue_notify"))
    return RepairResult(request.action, tuple(sorted(int(r[0]) for r in done)))


def _plan(conn: Connection, request: RepairRequest) -> RepairPlan:
    name = request.action
    statuses = REPAIRS[name].statuses
    chosen = request.selection
    searched = [i for i in chosen.ids if fits_bigint(i)]
    selected: list[tuple[Any, ...]] = []
    # Ids given, none of which can exist: no query (an empty array means "any id").
    if chosen.narrowed:
        statuses = tuple(s for s in statuses if chosen.status in (None, s))
    if (searched or not chosen.ids) and chosen.narrowed:
        selected = conn.execute(
            query("web_select_matching"),
            {"ids": searched, "stage": chosen.stage, "failure_class": chosen.failure_class,
             "statuses": list(statuses), "sender_key": chosen.sender_key,
             "older_than": chosen.older_than},
        ).fetchall()  # fmt: skip
    elif searched or not chosen.ids:
        selected = conn.execute(
            query("workqueue_select_matching"),
            {"ids": searched, "stage": chosen.stage, "failure_class": chosen.failure_class,
             "statuses": list(statuses)},
        ).fetchall()  # fmt: skip
    found = {int(r[0]) for r in selected}
    missing = [i for i in chosen.ids if i not in found]
    if missing:
        raise RepairRefused(
            f"{name}: no such message, or not in a state it applies to "
            f"({'/'.join(statuses)}): {', '.join(map(str, missing))}"
        )
    running = tuple(int(r[0]) for r in selected if r[1] == "running")
    if running:
        lock = conn.execute(query("dispatcher_lock_try_xact")).fetchone()
        if not (lock and lock[0]):
            raise RepairRefused(
                f"{name}: message(s) {', '.join(map(str, running[:10]))} are running and "
                "the dispatcher is up; stop it or wait"
            )
    return RepairPlan(request, tuple(sorted(found)), running)
