"""Reading the queue and repairing it without SQL: `pepsi queue`, the web console.

Reads: `status()` (rows per stage and status, the oldest pending row's age,
when the next paused row falls due, failures by class), `list_messages()`
and `get_message()`.

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

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import psycopg

from pepsi.admin.horizon import Holder, read_oldest
from pepsi.config.values import is_amqp_stage
from pepsi.db.queries import query

# The errors live in pepsi.errors (every error class does); re-exported here.
from pepsi.errors import NoSuchMessage, QueueError, RepairRefused, UnknownStage

Connection = psycopg.Connection[Any]
Status = Literal["pending", "running", "paused", "failed", "timeout"]
STATUSES: tuple[Status, ...] = ("pending", "running", "paused", "failed", "timeout")
Action = Literal["resume", "retry", "move", "delete"]
BIGINT_MIN, BIGINT_MAX = -(2**63), 2**63 - 1  # workqueue_id: no id outside can exist


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


def _fits(message_id: int) -> bool:
    return BIGINT_MIN <= message_id <= BIGINT_MAX


# -- reading -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageStatus:
    stage: str
    counts: Mapping[str, int]  # status -> rows: the statuses present, in name order
    oldest_pending_s: float | None  # age of the oldest pending row
    next_retry: datetime | None  # when the next paused row falls due


@dataclass(frozen=True)
class FailureCount:
    stage: str
    status: str  # failed or timeout
    failure_class: str  # "?" when the row has none
    count: int


@dataclass(frozen=True)
class QueueStatus:
    stages: tuple[StageStatus, ...]  # by stage name
    failures: tuple[FailureCount, ...]
    horizon: Holder | None = None  # the oldest transaction holding back vacuum


def count_by_stage_status(conn: Connection) -> dict[str, dict[str, int]]:
    """Rows per stage and status (stage -> status -> rows): a scan of the queue."""
    counts: dict[str, dict[str, int]] = {}
    for stage, status, n in conn.execute(query("workqueue_count_by_stage_status")):
        counts.setdefault(str(stage), {})[str(status)] = int(n)
    return counts


def status(conn: Connection) -> QueueStatus:
    """Counts, heads and failures of every stage that has rows; who holds back vacuum."""
    counts = count_by_stage_status(conn)
    stages = sorted(counts)
    heads = {
        str(stage): (oldest, next_retry)
        for stage, oldest, next_retry in conn.execute(
            query("workqueue_heads_by_stage"), {"stages": stages}
        )
    }
    failures = conn.execute(query("workqueue_count_failures_by_class")).fetchall()
    rows = []
    for stage in stages:
        oldest, next_retry = heads.get(stage, (None, None))
        rows.append(
            StageStatus(stage, counts[stage], None if oldest is None else float(oldest), next_retry)
        )
    return QueueStatus(
        stages=tuple(rows),
        failures=tuple(FailureCount(str(s), str(st), str(c), int(n)) for s, st, c, n in failures),
        horizon=read_oldest(conn),
    )


@dataclass(frozen=True)
class MessageFilter:
    """Which rows a listing shows; None: any."""

    stage: str | None = None
    status: Status | None = None
    sender_key: str | None = None  # e.g. user:alice, ip:192.0.2.7
    failure_class: str | None = None  # state->>'failure_class': permanent, crashed, ...
    older_than: float | None = None  # seconds: rows that arrived at least this long ago

    @property
    def narrowed(self) -> bool:
        """Whether it uses more than `pepsi queue list` offers (the web console's filters)."""
        return self.failure_class is not None or self.older_than is not None


@dataclass(frozen=True)
class MessageSummary:
    id: int
    stage: str
    status: str
    arrived: datetime
    timeout: datetime | None
    sender_key: str | None
    message_id: str | None
    last_error: str | None
    strikes: int


def list_messages(
    conn: Connection,
    where: MessageFilter | None = None,
    *,
    limit: int = 50,
    after: int | None = None,
) -> tuple[MessageSummary, ...]:
    """The rows `where` selects, oldest first, at most `limit`; with `after`, only
    those past that id (keyset paging: ask for limit + 1 to learn of a next page).

    A stage's pending rows, and its failed/timeout rows, page along their partial
    indexes (workqueue_pending_idx, workqueue_failed_idx): no sort, no offset.
    """
    where = where or MessageFilter()
    if limit < 1:
        raise QueueError(f"the limit must be at least 1, got {limit}")
    if where.status is not None and where.status not in STATUSES:
        raise QueueError(f"no status {where.status!r} (one of {', '.join(STATUSES)})")
    if where.older_than is not None and not where.older_than >= 0:
        raise QueueError(f"the age must be at least 0 seconds, got {where.older_than}")
    if after is not None or where.narrowed:
        name, params = page_query(where, limit=limit, after=after)
        with conn.transaction():
            conn.execute(query("workqueue_page_in_order"))
            rows = conn.execute(query(name), params).fetchall()
        return tuple(MessageSummary(*row) for row in rows)
    rows = conn.execute(
        query("workqueue_list"),
        {"stage": where.stage, "status": where.status, "sender_key": where.sender_key,
         "limit": min(limit, BIGINT_MAX)},  # beyond bigint is "all" anyway
    ).fetchall()  # fmt: skip
    return tuple(MessageSummary(*row) for row in rows)


def page_query(
    where: MessageFilter, *, limit: int, after: int | None = None
) -> tuple[str, dict[str, Any]]:
    """The named query (workqueue_page_*) and parameters listing one page of `where`."""
    if where.stage is not None and where.status == "pending":
        name = "workqueue_page_pending"
    elif where.stage is not None and where.status in ("failed", "timeout"):
        name = "workqueue_page_failed"
    else:
        name = "workqueue_page_any"
    start = BIGINT_MIN if after is None else max(BIGINT_MIN, min(after, BIGINT_MAX))
    return name, {
        "stage": where.stage,
        "status": where.status,
        "sender_key": where.sender_key,
        "failure_class": where.failure_class,
        "older_than": where.older_than,
        "after": start,
        "limit": min(limit, BIGINT_MAX),
    }


@dataclass(frozen=True)
class MessageDetail:
    id: int
    stage: str
    status: str
    arrived: datetime
    timeout: datetime | None
    expires: datetime | None
    message_id: str | None
    sender: str | None
    recipients: Sequence[str] | None
    origin_user: str | None
    origin_peer: str | None
    sender_key: str | None
    header_from: str | None
    subject: str | None
    content_type: str | None
    correlation_id: str | None
    properties: Mapping[str, Any] | None
    state: Mapping[str, Any]
    header_size: int | None
    body_size: int | None
    header: bytes | None  # None unless read with_body
    body: bytes | None


def get_message(conn: Connection, message_id: int, *, with_body: bool = False) -> MessageDetail:
    """One message: envelope, state and sizes; its header and body `with_body`."""
    row = None
    if _fits(message_id):
        row = conn.execute(
            query("workqueue_get"), {"id": message_id, "with_body": with_body}
        ).fetchone()
    if row is None:
        raise NoSuchMessage(f"no message {message_id} in the queue")
    return MessageDetail(*row)


def read_head(
    conn: Connection, message_id: int, *, limit: int
) -> tuple[bytes | None, bytes | None]:
    """The first `limit` bytes of a message's header and of its body (None: it has none)."""
    row = None
    if _fits(message_id):
        row = conn.execute(query("web_message_head"), {"id": message_id, "limit": limit}).fetchone()
    if row is None:
        raise NoSuchMessage(f"no message {message_id} in the queue")
    header, body = row
    return (None if header is None else bytes(header)), (None if body is None else bytes(body))


# -- repairing -----------------------------------------------------------------------------


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
    searched = [i for i in chosen.ids if _fits(i)]
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
