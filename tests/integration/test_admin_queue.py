"""`pepsi.admin.queue` in-process: reads, filters, previews and repairs on a real queue."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from pepsi.admin import queue, queue_repair
from pepsi.admin.queue import (
    MessageFilter,
    NoSuchMessage,
    QueueError,
    RepairRefused,
    UnknownStage,
)
from pepsi.admin.queue_repair import RepairPlan, RepairRequest, Selection

Conn = psycopg.Connection[Any]
STAGES = ("a", "b")
LOCK = 1885696115  # the dispatcher's advisory lock (queries.sql: dispatcher_lock_try)
HUGE = 2**70  # beyond bigint: no message can have it


@pytest.fixture
def db(conn: Conn) -> Conn:
    """Five rows: one per status, a body on row 1 (as tests/integration/test_queue_cmd.py)."""
    body = conn.execute(
        "INSERT INTO pepsi.workqueue_body (header, body) VALUES ('H: 1\n\n', 'hello')"
        " RETURNING body_id"
    ).fetchone()
    assert body is not None
    conn.execute(
        "INSERT INTO pepsi.workqueue"
        " (workqueue_id, stage, status, timeout, state, origin_user, body_id) VALUES"
        " (1, 'a', 'pending', NULL, '{}', 'alice', %s),"
        " (2, 'a', 'paused', now() + interval '1 hour', '{\"temporary_failures\": 2}', 'bob', NULL),"
        ' (3, \'b\', \'failed\', NULL, \'{"failed_stage": "a", "failure_class": "crashed",'
        "  \"strikes\": 3}', 'bob', NULL),"
        " (4, 'b', 'running', NULL, '{}', 'carol', NULL),"
        " (5, 'b', 'timeout', NULL, '{\"failure_class\": \"timed-out\", \"strikes\": 3}', 'dave',"
        "  NULL)",
        (body[0],),
    )
    return conn


@pytest.fixture
def other(dsn: str) -> Iterator[Conn]:
    """A second session: a dispatcher, a listener or an onlooker."""
    with psycopg.connect(dsn, autocommit=True) as connection:
        yield connection


def rows(conn: Conn) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT workqueue_id, stage, status::text FROM pepsi.workqueue ORDER BY 1"
    ).fetchall()


def request(action: Any, *ids: int, to: str | None = None, **chosen: Any) -> RepairRequest:
    return RepairRequest(action, Selection(ids=ids, **chosen), to=to)


def test_status_counts_heads_and_failures(db: Conn) -> None:
    read = queue.status(db)
    assert [s.stage for s in read.stages] == ["a", "b"]
    a, b = read.stages
    assert dict(a.counts) == {"paused": 1, "pending": 1}
    assert list(b.counts) == ["failed", "running", "timeout"]  # by name, as the SQL orders
    assert a.oldest_pending_s is not None
    assert a.oldest_pending_s >= 0
    assert a.next_retry is not None
    assert (b.oldest_pending_s, b.next_retry) == (None, None)
    assert [(f.stage, f.status, f.failure_class, f.count) for f in read.failures] == [
        ("b", "failed", "crashed", 1), ("b", "timeout", "timed-out", 1),
    ]  # fmt: skip
    assert queue.count_by_stage_status(db) == {
        "a": {"paused": 1, "pending": 1},
        "b": {"failed": 1, "running": 1, "timeout": 1},
    }


def test_an_empty_queue(conn: Conn) -> None:
    assert queue.status(conn) == queue.QueueStatus(stages=(), failures=())
    assert queue.list_messages(conn) == ()


def test_listing_filters(db: Conn) -> None:
    def ids(where: MessageFilter | None = None, limit: int = 50) -> list[int]:
        return [m.id for m in queue.list_messages(db, where, limit=limit)]

    assert ids() == [1, 2, 3, 4, 5]
    assert ids(MessageFilter(stage="b")) == [3, 4, 5]
    assert ids(MessageFilter(status="paused")) == [2]
    assert ids(MessageFilter(sender_key="user:bob", status="failed")) == [3]
    assert ids(limit=2) == [1, 2]
    assert ids(limit=HUGE) == [1, 2, 3, 4, 5]  # a limit beyond bigint is "all"
    (third,) = queue.list_messages(db, MessageFilter(stage="b", status="failed"))
    assert (third.strikes, third.last_error, third.sender_key) == (3, None, "user:bob")
    with pytest.raises(QueueError, match="at least 1"):
        queue.list_messages(db, limit=0)
    with pytest.raises(QueueError, match="no status 'lost'"):
        queue.list_messages(db, MessageFilter(status="lost"))  # type: ignore[arg-type]


def test_show_reads_the_body_only_when_asked(db: Conn) -> None:
    plain = queue.get_message(db, 1)
    assert (plain.stage, plain.status, plain.origin_user) == ("a", "pending", "alice")
    assert (plain.header_size, plain.body_size) == (6, 5)
    assert (plain.header, plain.body) == (None, None)
    full = queue.get_message(db, 1, with_body=True)
    assert (full.header, full.body) == (b"H: 1\n\n", b"hello")
    assert queue.get_message(db, 3).state == {
        "failed_stage": "a", "failure_class": "crashed", "strikes": 3,
    }  # fmt: skip
    for missing in (99, HUGE, -HUGE):
        with pytest.raises(NoSuchMessage, match=f"no message {missing} in the queue"):
            queue.get_message(db, missing)


def test_requests_are_checked_before_the_database(db: Conn) -> None:
    for wrong, error, message in (
        (request("retry"), RepairRefused, "say which messages"),
        (request("retry", failure_class="crashed"), RepairRefused, "say which messages"),
        (request("move", 1, to="nowhere"), UnknownStage, "no stage named 'nowhere'"),
        (request("move", 1), RepairRefused, "say which stage"),
        (request("resume", 2, to="b"), RepairRefused, "only move takes"),
        (request("resume", stage="zz"), UnknownStage, "no stage named 'zz'"),
        (request("wipe", 1), RepairRefused, "no repair named 'wipe'"),
    ):
        with pytest.raises(error, match=message):
            queue_repair.check(wrong, STAGES)
        with pytest.raises(error, match=message):
            queue_repair.repair(db, wrong, stages=STAGES)
    assert len(rows(db)) == 5


def test_preview_counts_what_a_repair_would_touch_and_changes_nothing(db: Conn) -> None:
    before = rows(db)
    plan = queue_repair.preview(db, request("retry", every=True), stages=STAGES)
    assert (plan.ids, plan.count, plan.running) == ((3, 5), 2, ())
    assert queue_repair.preview(db, request("retry", failure_class="crashed", every=True),
                         stages=STAGES).ids == (3,)  # fmt: skip
    assert queue_repair.preview(db, request("resume", stage="a"), stages=STAGES).ids == (2,)
    # a stage selects the rows at it and those that failed at it
    assert queue_repair.preview(db, request("move", stage="a", to="b"), stages=STAGES).ids == (
        1,
        2,
        3,
    )
    plan = queue_repair.preview(db, request("delete", stage="b"), stages=STAGES)
    assert (plan.ids, plan.running) == ((3, 4, 5), (4,))  # no dispatcher: running rows too
    assert rows(db) == before
    assert db.info.transaction_status is TransactionStatus.IDLE


def test_each_repair_is_one_transaction_with_one_notify(db: Conn, other: Conn) -> None:
    other.execute("LISTEN workqueue")
    seen: list[tuple[RepairPlan, TransactionStatus, Any]] = []

    def confirm(plan: RepairPlan) -> bool:
        # inside the repair's transaction: the lock is held, the rows not yet changed
        locked = other.execute("SELECT pg_try_advisory_lock(%s)", (LOCK,)).fetchone()
        seen.append((plan, db.info.transaction_status, locked))
        return True

    done = queue_repair.repair(db, request("move", 1, 4, to="a"), stages=STAGES, confirm=confirm)
    assert (done.action, done.ids) == ("move", (1, 4))
    ((plan, status, locked),) = seen
    assert (plan.ids, plan.running, status, locked) == ((1, 4), (4,), TransactionStatus.INTRANS,
                                                        (False,))  # fmt: skip
    assert db.info.transaction_status is TransactionStatus.IDLE  # committed
    assert other.execute("SELECT pg_try_advisory_lock(%s)", (LOCK,)).fetchone() == (True,)
    assert len(list(other.notifies(timeout=1))) == 1
    assert rows(other)[:4] == [(1, "a", "pending"), (2, "a", "paused"), (3, "b", "failed"),
                               (4, "a", "pending")]  # fmt: skip


def test_resume_retry_and_delete(db: Conn, other: Conn) -> None:
    other.execute("LISTEN workqueue")
    assert queue_repair.repair(db, request("resume", 2), stages=STAGES).ids == (2,)
    assert db.execute("SELECT timeout FROM pepsi.workqueue WHERE workqueue_id = 2").fetchone() == (
        None,
    )
    assert queue_repair.repair(db, request("retry", every=True), stages=STAGES).ids == (3, 5)
    assert db.execute(
        "SELECT workqueue_id, stage, status::text, state FROM pepsi.workqueue"
        " WHERE workqueue_id IN (3, 5) ORDER BY 1"
    ).fetchall() == [(3, "a", "pending", {}), (5, "b", "pending", {})]
    assert len(list(other.notifies(timeout=1, stop_after=2))) == 2  # one per repair
    assert queue_repair.repair(db, request("delete", 1), stages=STAGES).ids == (1,)
    assert list(other.notifies(timeout=0.2)) == []  # a delete wakes nobody
    assert db.execute("SELECT count(*) FROM pepsi.workqueue_body").fetchone() == (0,)
    # nothing qualifies any more: a bulk repair of nothing is not an error
    assert queue_repair.repair(db, request("resume", every=True), stages=STAGES).ids == ()


def test_a_declined_confirmation_changes_nothing(db: Conn) -> None:
    counts: list[int] = []

    def decline(plan: RepairPlan) -> bool:
        counts.append(plan.count)
        return False

    with pytest.raises(RepairRefused, match=r"^nothing deleted$"):
        queue_repair.repair(db, request("delete", stage="a"), stages=STAGES, confirm=decline)
    with pytest.raises(RepairRefused, match=r"^nothing retried$"):
        queue_repair.repair(db, request("retry", 3), stages=STAGES, confirm=decline)
    assert counts == [3, 1]  # a, and 3 that failed at a
    assert len(rows(db)) == 5
    assert db.info.transaction_status is TransactionStatus.IDLE


def test_ids_that_do_not_qualify_or_cannot_exist(db: Conn) -> None:
    before = rows(db)
    for wrong, message in (
        (request("resume", 1), r"not in a state it applies to \(paused\): 1$"),
        (request("retry", 42, 3), r"no such message.*\(failed/timeout\): 42$"),
        (request("resume", HUGE), rf"no such message.*: {HUGE}$"),
        (request("delete", 2, HUGE, -HUGE), rf": {HUGE}, {-HUGE}$"),
        # beyond bigint with a stage: still only those ids, never the whole stage
        (request("move", HUGE, stage="a", to="b"), r"\(pending/paused/failed/timeout/running\)"),
    ):
        with pytest.raises(RepairRefused, match=message):
            queue_repair.repair(db, wrong, stages=STAGES)
        with pytest.raises(RepairRefused, match=message):
            queue_repair.preview(db, wrong, stages=STAGES)
    assert rows(db) == before


def test_running_rows_are_refused_while_a_dispatcher_runs(db: Conn, other: Conn) -> None:
    other.execute("SELECT pg_advisory_lock(%s)", (LOCK,))  # as the dispatcher holds it
    for action in ("delete", "move"):
        wrong = request(action, stage="b", to="a" if action == "move" else None)
        with pytest.raises(RepairRefused, match=r"message\(s\) 4 are running and the dispatcher"):
            queue_repair.preview(db, wrong, stages=STAGES)
        with pytest.raises(RepairRefused, match="running and the dispatcher is up"):
            queue_repair.repair(db, wrong, stages=STAGES)
    # rows that are not running are repaired as usual
    assert queue_repair.repair(db, request("delete", 3, 5), stages=STAGES).ids == (3, 5)
    other.execute("SELECT pg_advisory_unlock(%s)", (LOCK,))
    assert queue_repair.repair(db, request("delete", 4), stages=STAGES).ids == (4,)
