"""The SQL of failure handling: strikes (W-6, R-8) and the bouncer's sinks (R-9)."""

from __future__ import annotations

from typing import Any

import psycopg

from pepsi.admin.bouncer import bounce_once

Conn = psycopg.Connection[tuple[Any, ...]]


def running(conn: Conn, stage: str = "s", **columns: Any) -> int:
    row = conn.execute(
        "INSERT INTO pepsi.workqueue (stage, status) VALUES (%s, 'running') RETURNING workqueue_id",
        (stage,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def strike(conn: Conn, wid: int, kind: str = "crashed") -> int:
    row = conn.execute(
        # the third strike ends the row: the dispatcher's MAX_STRIKES
        "SELECT pepsi.workqueue_strike(%s, 's', %s, 'worker died', ARRAY[60, 120]::float8[], 3)",
        (wid, kind),
    ).fetchone()
    assert row is not None
    return int(row[0])


def state_of(conn: Conn, wid: int) -> tuple[str, dict[str, Any], float | None]:
    row = conn.execute(
        "SELECT status::text, state, extract(epoch FROM timeout - now())::float8"
        " FROM pepsi.workqueue WHERE workqueue_id = %s",
        (wid,),
    ).fetchone()
    assert row is not None
    return str(row[0]), dict(row[1]), row[2]


def test_three_strikes(conn: Conn) -> None:
    wid = running(conn)
    assert strike(conn, wid) == 1
    status, state, due = state_of(conn, wid)
    assert (status, state) == ("paused", {"strikes": 1, "last_error": "worker died"})
    assert due is not None
    assert 55 < due <= 60
    conn.execute("UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = %s", (wid,))
    assert strike(conn, wid) == 2
    assert 115 < (state_of(conn, wid)[2] or 0) <= 120
    conn.execute("UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = %s", (wid,))
    assert strike(conn, wid) == 3
    status, state, due = state_of(conn, wid)
    assert (status, due) == ("failed", None)
    assert state["failure_class"] == "crashed"
    assert state["failed_stage"] == "s"


def test_a_hang_ends_in_timeout_and_a_moved_row_is_not_struck(conn: Conn) -> None:
    wid = running(conn)
    conn.execute(
        "UPDATE pepsi.workqueue SET state = '{\"strikes\": 2}' WHERE workqueue_id = %s", (wid,)
    )
    assert strike(conn, wid, "timed-out") == 3
    assert state_of(conn, wid)[0] == "timeout"
    assert state_of(conn, wid)[1]["failure_class"] == "timed-out"
    other = running(conn, stage="elsewhere")
    assert strike(conn, other) == 0  # not running at stage s: untouched
    assert state_of(conn, other)[1] == {}


def test_bouncer_sinks(conn: Conn) -> None:
    body = conn.execute(
        "INSERT INTO pepsi.workqueue_body (body) VALUES ('b') RETURNING body_id"
    ).fetchone()
    assert body is not None
    conn.execute(
        "INSERT INTO pepsi.workqueue (stage, status, state, body_id) VALUES"
        " ('a', 'failed', '{\"failure_class\": \"permanent\"}', %s), ('a', 'timeout', '{}', NULL),"
        " ('a', 'pending', '{}', NULL), ('guarded', 'failed', '{}', NULL)",
        (body[0],),
    )
    # to a stage: pending there, with where it came from
    assert bounce_once(conn, ["a"], "dlq") == 2
    rows = conn.execute(
        "SELECT stage, status::text, state->>'bounced_from', state->>'bounced_status'"
        " FROM pepsi.workqueue WHERE stage = 'dlq' ORDER BY workqueue_id"
    ).fetchall()
    assert rows == [("dlq", "pending", "a", "failed"), ("dlq", "pending", "a", "timeout")]
    # to the table: the whole message, body included, leaves the queue
    conn.execute("UPDATE pepsi.workqueue SET stage = 'a', status = 'failed' WHERE stage = 'dlq'")
    assert bounce_once(conn, ["a"], None) == 2
    kept = conn.execute(
        "SELECT stage, status::text, body FROM pepsi.dead_letter ORDER BY workqueue_id"
    ).fetchall()
    assert kept == [("a", "failed", b"b"), ("a", "failed", None)]
    left = conn.execute("SELECT stage, status::text FROM pepsi.workqueue ORDER BY 1").fetchall()
    assert left == [("a", "pending"), ("guarded", "failed")]
    assert conn.execute("SELECT count(*) FROM pepsi.workqueue_body").fetchone() == (0,)
