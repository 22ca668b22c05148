"""A stage's edits to its message are written with its outcome (issue 32).

The envelope sender, the recipients, the extracted headers, the producer
properties, the header block and the body: what a stage changes is stored in
the same statement as its outcome, and what a failing stage changed is not.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pepsi.config import Config, load_config
from pepsi.stage import Message, Needs, stage
from pepsi.worker.runner import StageRunner
from tests.rows import running

Conn = psycopg.Connection[tuple[Any, ...]]

CONF = """
[stage-a]
HANDLER = tests.stages:noop
NEXT = b
RETRY_DELAY = 10s
[stage-b]
HANDLER = tests.stages:noop
"""


@pytest.fixture
def config(tmp_path: Path) -> Config:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF)
    return load_config(path)


def stored(conn: Conn, wid: int) -> dict[str, Any]:
    row = conn.execute(
        "SELECT w.stage, w.status::text, w.sender, w.recipients, w.subject, w.header_from,"
        " w.properties, w.sender_key, w.state, w.body_id, b.header, b.body"
        " FROM pepsi.workqueue w LEFT JOIN pepsi.workqueue_body b USING (body_id)"
        " WHERE w.workqueue_id = %s",
        (wid,),
    ).fetchone()
    assert row is not None
    names = ("stage", "status", "sender", "recipients", "subject", "header_from", "properties",
             "sender_key", "state", "body_id", "header", "body")  # fmt: skip
    return dict(zip(names, row, strict=True))


@stage
def forward(msg: Message) -> None:
    """As SRS does: a new sender; and the recipients and extracted headers change too."""
    msg.sender = "srs0=abcd=xy=sender.org=alice@fwd.example"
    msg.recipients = (*msg.recipients, "extra@example.org")
    msg.subject = "[fwd] " + (msg.subject or "")
    msg.header_from = "Forwarder <fwd@fwd.example>"
    msg.properties["forwarded"] = True


@stage(Needs.HEADER)
def sign(msg: Message) -> None:
    msg.header = b"DKIM-Signature: v=1; fake\r\n" + (msg.header or b"")


@stage(Needs.BODY)
def footer(msg: Message) -> None:
    msg.body = (msg.body or b"") + b"-- \r\nsent through Pepsi\r\n"


@stage
def edit_then_fail(msg: Message) -> None:
    msg.sender = "someone@else.org"
    raise ConnectionError("upstream down")


@stage
def bad_edit(msg: Message) -> None:
    msg.recipients = ("not an address",)


def test_metadata_edits_are_stored_with_the_advance(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    wid = running(conn, sender="", recipients=["bob@example.com"], properties={"k": 1})
    conn.execute("UPDATE pepsi.workqueue SET subject = 'hello' WHERE workqueue_id = %s", (wid,))
    assert stored(conn, wid)["sender_key"] == "null:example.com"
    make_runner(forward).run_batch([wid])
    row = stored(conn, wid)
    assert (row["stage"], row["status"]) == ("b", "pending")
    assert row["sender"] == "srs0=abcd=xy=sender.org=alice@fwd.example"
    assert row["recipients"] == ["bob@example.com", "extra@example.org"]
    assert row["subject"] == "[fwd] hello"
    assert row["header_from"] == "Forwarder <fwd@fwd.example>"
    assert row["properties"] == {"k": 1, "forwarded": True}
    assert row["sender_key"] == "from:fwd.example"  # recomputed from the new sender


def test_a_new_header_block_is_this_row_s_alone(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    first = running(conn, body=b"the body\r\n", header="Subject: hi\r\n")
    body_id = stored(conn, first)["body_id"]
    sibling = running(conn, stage_name="b")  # a row split from the same message
    conn.execute("UPDATE pepsi.workqueue SET body_id = %s WHERE workqueue_id = %s",
                 (body_id, sibling))  # fmt: skip
    make_runner(sign).run_batch([first])
    signed = stored(conn, first)
    assert signed["header"] == b"DKIM-Signature: v=1; fake\r\nSubject: hi\r\n"
    assert signed["body"] == b"the body\r\n"  # kept, copied by the server
    assert signed["body_id"] != body_id
    untouched = stored(conn, sibling)
    assert (untouched["body_id"], untouched["header"]) == (body_id, b"Subject: hi\r\n")


def test_a_new_body_keeps_the_header_and_the_old_body_goes_with_its_last_row(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    wid = running(conn, body=b"text\r\n", header="Subject: hi\r\n")
    old = stored(conn, wid)["body_id"]
    make_runner(footer).run_batch([wid])
    row = stored(conn, wid)
    assert (row["header"], row["body"]) == (
        b"Subject: hi\r\n",
        b"text\r\n-- \r\nsent through Pepsi\r\n",
    )
    gone = conn.execute("SELECT count(*) FROM pepsi.workqueue_body WHERE body_id = %s", (old,))
    assert gone.fetchone() == (0,)


def test_a_failing_stage_leaves_no_edit(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    wid = running(conn, sender="alice@sender.org")
    make_runner(edit_then_fail).run_batch([wid])
    row = stored(conn, wid)
    assert (row["stage"], row["status"], row["sender"]) == ("a", "paused", "alice@sender.org")


def test_an_edit_that_cannot_be_stored_is_a_host_failure(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    wid = running(conn, recipients=["bob@example.com"])
    make_runner(bad_edit).run_batch([wid])
    row = stored(conn, wid)
    assert (row["stage"], row["status"], row["recipients"]) == ("a", "paused", ["bob@example.com"])
    assert "not an address: 'not an address'" in row["state"]["last_error"]


@stage(transactional=True)
def forward_in_a_transaction(msg: Message) -> None:
    msg.db.execute("SELECT 1")
    msg.sender = "fwd@fwd.example"


def test_a_transactional_stage_s_edits_commit_with_its_outcome(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    wid = running(conn, sender="alice@sender.org")
    make_runner(forward_in_a_transaction).run_batch([wid])
    row = stored(conn, wid)
    assert (row["stage"], row["status"], row["sender"]) == ("b", "pending", "fwd@fwd.example")


@stage
def retry_silently(msg: Message) -> None:
    msg.properties["smtp"]["ret"] = "HDRS"  # a value inside a property, changed in place


def test_a_change_inside_a_property_is_stored(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    wid = running(conn, properties={"smtp": {"ret": "FULL", "envid": "e1"}})
    make_runner(retry_silently).run_batch([wid])
    assert stored(conn, wid)["properties"] == {"smtp": {"ret": "HDRS", "envid": "e1"}}
