"""A stage's Split outcome (issue 32): recipients going different ways, new messages made.

One round trip (pepsi.workqueue_record_split): the first unfinished group stays
on the row, the others become rows of their own sharing the body, finished
groups leave none, and the stage's new messages are written in the same
transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pepsi.config import Config, load_config
from pepsi.stage import (
    Advance,
    Defer,
    Fail,
    Finish,
    Message,
    Needs,
    NewMessage,
    Part,
    Split,
    stage,
)  # fmt: skip
from pepsi.worker.runner import StageRunner
from tests.rows import NOW, running

Conn = psycopg.Connection[tuple[Any, ...]]

CONF = """
[stage-a]
HANDLER = tests.stages:noop
NEXT = b
RETRY_DELAY = 10s
MAX_LIFETIME = 1h
[stage-b]
HANDLER = tests.stages:noop
[stage-dsn]
HANDLER = tests.stages:noop
[stage-late]
HANDLER = tests.stages:noop
MAX_LIFETIME = 1h
BOUNCE_STAGE = b
[stage-s]
HANDLER = tests.stages:noop
NEXT = fused
RETRY_DELAY = 10s
[stage-fused]
HANDLER = tests.stages:noop
FUSION = yes
"""
RCPTS = ["ok@x.org", "later@x.org", "bad@x.org"]


@pytest.fixture
def config(tmp_path: Path) -> Config:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF)
    return load_config(path)


def rows(conn: Conn, *ids: int) -> list[dict[str, Any]]:
    found = conn.execute(
        "SELECT w.workqueue_id, w.stage, w.status::text, w.recipients, w.sender, w.state,"
        " w.body_id, w.timeout, w.sender_key, b.header, b.body"
        " FROM pepsi.workqueue w LEFT JOIN pepsi.workqueue_body b USING (body_id)"
        " WHERE w.workqueue_id = ANY(%s) ORDER BY w.workqueue_id",
        (list(ids),),
    ).fetchall()
    names = ("id", "stage", "status", "recipients", "sender", "state", "body_id", "timeout",
             "sender_key", "header", "body")  # fmt: skip
    return [dict(zip(names, row, strict=True)) for row in found]


def newest(conn: Conn, after: int) -> list[int]:
    found = conn.execute(
        "SELECT workqueue_id FROM pepsi.workqueue WHERE workqueue_id > %s ORDER BY 1", (after,)
    ).fetchall()
    return [int(r[0]) for r in found]


@stage(Needs.BODY)
def relay(msg: Message) -> Split:
    """Delivers ok@, defers later@, fails bad@ and reports the failure to the sender."""
    report = NewMessage(
        "dsn", header=b"Subject: failure\r\n", body=b"bad@x.org failed\r\n", sender="",
        recipients=(msg.sender or "",), subject="failure", state={"dsn": "failure"},
    )  # fmt: skip
    return Split(
        (
            Part(("ok@x.org",), Finish()),
            Part(("later@x.org",), Defer("451 4.4.1 try later")),
            Part(("bad@x.org",), Fail("550 5.1.1 no such user")),
        ),
        spawn=(report,),
    )


def test_each_group_carries_on_alone_and_the_report_is_written_with_them(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    wid = running(conn, sender="alice@sender.org", recipients=RCPTS, body=b"hello\r\n")
    body_id = rows(conn, wid)[0]["body_id"]
    make_runner(relay).run_batch([wid])
    kept, *made = rows(conn, wid, *newest(conn, wid))
    # the row keeps the deferred group (the first that is not finished), paused for retry
    assert (kept["recipients"], kept["stage"], kept["status"]) == (["later@x.org"], "a", "paused")
    assert kept["state"]["last_error"] == "451 4.4.1 try later"
    assert kept["timeout"] == NOW + timedelta(seconds=10)
    failed, report = made
    assert (failed["recipients"], failed["status"]) == (["bad@x.org"], "failed")
    assert failed["state"]["failure_class"] == "permanent"
    assert failed["state"]["split_from"] == wid
    assert failed["body_id"] == body_id  # shares the body
    assert (report["stage"], report["status"], report["sender"]) == ("dsn", "pending", "")
    assert report["recipients"] == ["alice@sender.org"]
    assert report["sender_key"] == "null:sender.org"
    assert (report["header"], report["body"]) == (b"Subject: failure\r\n", b"bad@x.org failed\r\n")
    assert report["state"] == {"dsn": "failure"}


@stage
def all_delivered(msg: Message) -> Split:
    return Split((Part(tuple(msg.recipients), Finish()),), spawn=(NewMessage("dsn"),))


def test_everyone_finished_deletes_the_row_and_keeps_the_new_messages(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    wid = running(conn, recipients=RCPTS, body=b"x\r\n")
    make_runner(all_delivered).run_batch([wid])
    assert rows(conn, wid) == []
    (made,) = rows(conn, *newest(conn, wid))
    assert (made["stage"], made["status"], made["body_id"]) == ("dsn", "pending", None)


@stage
def wrong_parts(msg: Message) -> Split:
    return Split((Part(("ok@x.org",), Finish()), Part(("stranger@x.org",), Finish())))


@stage
def unknown_stage(msg: Message) -> Split:
    return Split((Part(tuple(msg.recipients), Finish()),), spawn=(NewMessage("nowhere"),))


@pytest.mark.parametrize(
    ("func", "problem"),
    [
        (wrong_parts, "name each of the message's recipients once"),
        (unknown_stage, "advance to unknown stage 'nowhere'"),
    ],
)
def test_a_split_that_does_not_fit_is_a_host_failure(
    conn: Conn, make_runner: Callable[..., StageRunner], func: Any, problem: str
) -> None:
    wid = running(conn, recipients=RCPTS)
    make_runner(func).run_batch([wid])
    (row,) = rows(conn, wid)
    assert (row["status"], row["recipients"]) == ("paused", RCPTS)
    assert problem in row["state"]["last_error"]
    assert newest(conn, wid) == []


@stage
def deferred_too_long(msg: Message) -> Split:
    return Split(
        (Part(("ok@x.org",), Finish()), Part(("later@x.org", "bad@x.org"), Defer("451 4.4.1")))
    )


def test_a_deferred_group_past_max_lifetime_goes_to_the_bounce_stage(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    wid = running(conn, "late", recipients=RCPTS, arrived=NOW - timedelta(hours=2))
    make_runner(deferred_too_long, "late").run_batch([wid])
    (row,) = rows(conn, wid)
    assert (row["stage"], row["status"]) == ("b", "pending")
    assert row["recipients"] == ["later@x.org", "bad@x.org"]
    assert row["state"]["failure_class"] == "retries-exhausted"


@stage
def deliver_one_fail_one(msg: Message) -> Split:
    return Split(
        (Part(("ok@x.org",), Advance()), Part(("bad@x.org",), Fail("550 5.1.1"))),
        spawn=(NewMessage("dsn", sender="", recipients=("alice@sender.org",)),),
    )


def test_a_split_that_advances_is_written_not_fused(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    # The successor may be fused, but the row's advance carries parts and new messages.
    wid = running(conn, "s", recipients=["ok@x.org", "bad@x.org"])
    make_runner(deliver_one_fail_one, "s").run_batch([wid])
    kept, failed, report = rows(conn, wid, *newest(conn, wid))
    assert (kept["stage"], kept["status"], kept["recipients"]) == ("fused", "pending", ["ok@x.org"])
    assert (failed["status"], failed["recipients"]) == ("failed", ["bad@x.org"])
    assert (report["stage"], report["recipients"]) == ("dsn", ["alice@sender.org"])


@pytest.mark.parametrize("deferred_first", [True, False], ids=["defer-first", "defer-last"])
def test_a_splits_edits_stand_whatever_the_order_of_its_parts(
    conn: Conn, make_runner: Callable[..., StageRunner], deferred_first: bool
) -> None:
    @stage(Needs.BODY)
    def retitle(msg: Message) -> Split:
        msg.subject = "[x] hello"
        parts = [Part(("ok@x.org",), Advance()), Part(("later@x.org",), Defer("451 4.4.1"))]
        return Split(tuple(reversed(parts)) if deferred_first else tuple(parts))

    wid = running(conn, "s", recipients=["ok@x.org", "later@x.org"], body=b"x\r\n")
    make_runner(retitle, "s").run_batch([wid])
    ids = [wid, *newest(conn, wid)]
    subjects = conn.execute(
        "SELECT subject FROM pepsi.workqueue WHERE workqueue_id = ANY(%s)", (ids,)
    ).fetchall()
    assert subjects == [("[x] hello",), ("[x] hello",)]


@stage
def to_a_queue(msg: Message) -> Split:
    return Split((Part(tuple(msg.recipients), Finish()),), spawn=(NewMessage("amqp:jobs"),))


def test_a_new_message_to_an_amqp_queue_is_written_under_the_queues_stage(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    wid = running(conn, recipients=RCPTS)
    make_runner(to_a_queue).run_batch([wid])
    (made,) = rows(conn, *newest(conn, wid))
    assert (made["stage"], made["status"]) == ("amqp:/:jobs", "pending")


@stage
def state_not_an_object(msg: Message) -> Split:
    report = NewMessage("dsn", state=None)  # type: ignore[arg-type]
    return Split((Part(tuple(msg.recipients), Finish()),), spawn=(report,))


def test_a_new_messages_state_must_be_a_json_object(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    wid = running(conn, recipients=RCPTS)
    make_runner(state_not_an_object).run_batch([wid])
    (row,) = rows(conn, wid)
    assert row["status"] == "paused"
    assert "state is not a JSON object" in row["state"]["last_error"]
    assert newest(conn, wid) == []


def test_a_split_wakes_the_dispatcher_for_the_rows_it_makes(
    dsn: str, conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    """A worker's answer for a message it finished or paused is no news to the
    dispatcher (a stage found empty stays so); the rows a split makes (its groups, its
    delivery status notifications) are pending, so their write sends a NOTIFY."""
    wid = running(conn, sender="alice@sender.org", recipients=RCPTS, body=b"hello\r\n")
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN workqueue")
        make_runner(relay).run_batch([wid])
        heard = [n.channel for n in listener.notifies(timeout=10, stop_after=1)]
    assert heard == ["workqueue"]
    assert len(newest(conn, wid)) == 2  # the failed group and the report
