"""Reading the queue without SQL: `pepsi queue`, the web console.

`status()` (rows per stage and status, the oldest pending row's age, when
the next paused row falls due, failures by class), `list_messages()` (a
filter's rows, paged along the partial indexes), `get_message()` and
`read_head()`. Repairing it (resume, retry, move, delete) is
`pepsi.admin.queue_repair`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import psycopg

from pepsi.admin.horizon import Holder, read_oldest
from pepsi.db.queries import query

# The errors live in pepsi.errors (every error class does); re-exported here.
from pepsi.errors import NoSuchMessage, QueueError, RepairRefused, UnknownStage  # noqa: F401

Connection = psycopg.Connection[Any]
Status = Literal["pending", "running", "paused", "failed", "timeout"]
STATUSES: tuple[Status, ...] = ("pending", "running", "paused", "failed", "timeout")
BIGINT_MIN, BIGINT_MAX = -(2**63), 2**63 - 1  # workqueue_id: no id outside can exist


def fits_bigint(message_id: int) -> bool:
    """Whether a message could have this id (a workqueue_id is a bigint)."""
    return BIGINT_MIN <= message_id <= BIGINT_MAX


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
    if fits_bigint(message_id):
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
    if fits_bigint(message_id):
        row = conn.execute(query("web_message_head"), {"id": message_id, "limit": limit}).fetchone()
    if row is None:
        raise NoSuchMessage(f"no message {message_id} in the queue")
    header, body = row
    return (None if header is None else bytes(header)), (None if body is None else bytes(body))
