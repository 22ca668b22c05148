"""The workqueue table itself: sender_key (D-3), bodies and their sweep (D-2)."""

from __future__ import annotations

import json
import threading
import time

import psycopg
import pytest
from psycopg import sql

from pepsi.db.queries import query, query_text

Conn = psycopg.Connection[tuple[object, ...]]


def insert(conn: Conn, body_id: int | None = None, **columns: object) -> int:
    columns = {"stage": "s", **columns}
    if body_id is not None:
        columns["body_id"] = body_id
    names = ", ".join(columns)
    marks = ", ".join(["%s"] * len(columns))
    row = conn.execute(
        f"INSERT INTO pepsi.workqueue ({names}) VALUES ({marks}) RETURNING workqueue_id",
        list(columns.values()),
    ).fetchone()
    assert row is not None
    return int(str(row[0]))


def sender_key(conn: Conn, **columns: object) -> str:
    row_id = insert(conn, **columns)
    row = conn.execute(
        "SELECT sender_key FROM pepsi.workqueue WHERE workqueue_id = %s", (row_id,)
    ).fetchone()
    assert row is not None
    return str(row[0])


@pytest.mark.parametrize(
    ("columns", "expected"),
    [
        # an authenticated submitter wins whatever else the row says
        (
            {"origin_user": "alice", "origin_peer": "192.0.2.7", "sender": "x@y.org"},
            "user:alice",
        ),
        # else the connecting peer: IPv4 by its address
        ({"origin_peer": "192.0.2.7", "sender": "x@Example.ORG"}, "ip:192.0.2.7"),
        # IPv6 by its /64: two hosts of one /64 are one sender
        ({"origin_peer": "2001:db8:1:2:aaaa::1"}, "ip:2001:db8:1:2::/64"),
        ({"origin_peer": "2001:db8:1:2:ffff:ffff:ffff:ffff"}, "ip:2001:db8:1:2::/64"),
        ({"origin_peer": "2001:db8:1:3::1"}, "ip:2001:db8:1:3::/64"),
        # a message Pepsi created itself: the envelope sender's domain
        ({"sender": "Reports@Example.ORG", "recipients": ["a@b.c"]}, "from:example.org"),
        ({"sender": "postmaster"}, "from:postmaster"),
        # null sender: the first recipient's domain
        ({"sender": "", "recipients": ["bob@Dest.example", "c@other"]}, "null:dest.example"),
        ({"sender": None, "recipients": ["bob@dest.example"]}, "null:dest.example"),
        ({"sender": ""}, "null:"),
    ],
)
def test_sender_key(conn: Conn, columns: dict[str, object], expected: str) -> None:
    assert sender_key(conn, **columns) == expected


@pytest.mark.parametrize(
    ("columns", "expected"),
    [
        # the keys the INSERT trigger's short WHEN clause takes as right
        ({"origin_user": "alice", "sender_key": "user:alice"}, "user:alice"),
        ({"sender_key": "null:"}, "null:"),
        # anything else it hands to the function, which puts it right
        ({"origin_user": "alice", "sender_key": "user:bob"}, "user:alice"),
        ({"origin_user": "alice", "sender_key": "null:"}, "user:alice"),
        ({"origin_peer": "192.0.2.7", "sender_key": "null:"}, "ip:192.0.2.7"),
        ({"sender": "a@B.example", "sender_key": "null:"}, "from:b.example"),
        ({"sender": "", "sender_key": "null:"}, "null:"),
        ({"recipients": ["r@D.example"], "sender_key": "null:"}, "null:d.example"),
        ({"sender_key": "user:"}, "null:"),
        ({"sender_key": "null:x"}, "null:"),
    ],
)
def test_an_inserted_sender_key_is_right_whatever_the_writer_gave(
    conn: Conn, columns: dict[str, object], expected: str
) -> None:
    assert sender_key(conn, **columns) == expected


def test_sender_key_follows_its_inputs_and_cannot_be_set(conn: Conn) -> None:
    """A trigger fills the column from the row (a stored generated column made every
    UPDATE of a row recompute it), so a value written by hand never sticks."""
    row_id = insert(conn, sender="a@One.example", sender_key="user:forged")

    def key() -> str:
        row = conn.execute(
            "SELECT sender_key FROM pepsi.workqueue WHERE workqueue_id = %s", (row_id,)
        ).fetchone()
        assert row is not None
        return str(row[0])

    assert key() == "from:one.example"
    conn.execute("UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = %s", (row_id,))
    assert key() == "from:one.example"
    conn.execute(
        "UPDATE pepsi.workqueue SET sender = '', recipients = '{b@Two.example}'"
        " WHERE workqueue_id = %s",
        (row_id,),
    )
    assert key() == "null:two.example"
    conn.execute(
        "UPDATE pepsi.workqueue SET origin_peer = '192.0.2.9' WHERE workqueue_id = %s", (row_id,)
    )
    assert key() == "ip:192.0.2.9"
    conn.execute("UPDATE pepsi.workqueue SET sender_key = 'x' WHERE workqueue_id = %s", (row_id,))
    assert key() == "ip:192.0.2.9"


def new_body(conn: Conn, body: bytes = b"hello", header: bytes = b"Subject: x\r\n") -> int:
    row = conn.execute(
        "INSERT INTO pepsi.workqueue_body (header, body) VALUES (%s, %s) RETURNING body_id",
        (header, body),
    ).fetchone()
    assert row is not None
    return int(str(row[0]))


def body_exists(conn: Conn, body_id: int) -> bool:
    row = conn.execute(
        "SELECT count(*) FROM pepsi.workqueue_body WHERE body_id = %s", (body_id,)
    ).fetchone()
    assert row is not None
    return bool(row[0])


def test_large_headers_and_bodies_are_stored_as_they_are(conn: Conn) -> None:
    # Compressible text over the 2 KB threshold: pglz would have taken it (0030).
    header = b"".join(b"X-Trace-%d: relayed by host%d.example\r\n" % (n, n) for n in range(200))
    body = b"".join(b"line %d of a long and very repetitive text part\r\n" % n for n in range(2000))
    body_id = new_body(conn, body, header=header)
    stored = conn.execute(
        "SELECT pg_column_compression(header), pg_column_compression(body),"
        " pg_column_size(body), header, body FROM pepsi.workqueue_body WHERE body_id = %s",
        (body_id,),
    ).fetchone()
    assert stored == (None, None, len(body), header, body)


def test_body_goes_with_its_last_row(conn: Conn) -> None:
    body = new_body(conn)
    first, second = insert(conn, body), insert(conn, body)
    conn.execute("DELETE FROM pepsi.workqueue WHERE workqueue_id = %s", (first,))
    assert body_exists(conn, body)  # still shared by the split row
    conn.execute("DELETE FROM pepsi.workqueue WHERE workqueue_id = %s", (second,))
    assert not body_exists(conn, body)


def test_one_delete_of_many_rows_releases_only_the_bodies_left_unreferenced(conn: Conn) -> None:
    shared, alone, kept = new_body(conn), new_body(conn), new_body(conn)
    rows = [insert(conn, shared), insert(conn, shared), insert(conn, alone), insert(conn, kept)]
    survivor = insert(conn, kept)
    insert(conn)  # a row without a body
    gone = conn.execute(
        "DELETE FROM pepsi.workqueue WHERE workqueue_id = ANY(%s) OR body_id IS NULL", (rows,)
    ).rowcount
    assert gone == 5
    assert not body_exists(conn, shared)
    assert not body_exists(conn, alone)
    assert body_exists(conn, kept)  # the survivor still references it
    conn.execute("DELETE FROM pepsi.workqueue WHERE workqueue_id = %s", (survivor,))
    assert not body_exists(conn, kept)


def test_replaced_body_is_released(conn: Conn) -> None:
    old, new = new_body(conn, b"old"), new_body(conn, b"new")
    row = insert(conn, old)
    conn.execute("UPDATE pepsi.workqueue SET body_id = %s WHERE workqueue_id = %s", (new, row))
    assert not body_exists(conn, old)
    assert body_exists(conn, new)


def wait_until_blocked(dsn: str, pid: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as watch:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            row = watch.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            if row is not None and row[0] == "Lock":
                return
            time.sleep(0.01)
    pytest.fail(f"backend {pid} never waited for a lock")


def delete_behind(dsn: str, holder: Conn, row_id: int) -> list[BaseException]:
    """Delete `row_id` in another transaction that must wait for `holder` (a lock its
    open transaction holds), then commit `holder`; the errors of the delete."""
    errors: list[BaseException] = []
    with psycopg.connect(dsn) as other:
        other_pid = other.info.backend_pid

        def delete() -> None:
            try:
                other.execute("DELETE FROM pepsi.workqueue WHERE workqueue_id = %s", (row_id,))
                other.commit()
            except psycopg.Error as exc:
                errors.append(exc)

        thread = threading.Thread(target=delete)
        thread.start()
        wait_until_blocked(dsn, other_pid)
        holder.commit()
        thread.join(timeout=10)
    return errors


def test_concurrent_deletes_of_the_last_two_rows_leave_no_orphan(dsn: str) -> None:
    """Without the body lock each delete would see the other row and keep the body."""
    with psycopg.connect(dsn, autocommit=True) as setup:
        body = new_body(setup)
        first, second = insert(setup, body), insert(setup, body)
    with psycopg.connect(dsn) as holder:
        holder.execute("DELETE FROM pepsi.workqueue WHERE workqueue_id = %s", (first,))
        # the second delete waits for the body lock, then sees no row left
        assert delete_behind(dsn, holder, second) == []
    with psycopg.connect(dsn, autocommit=True) as check:
        assert not body_exists(check, body)


def test_a_copy_keeps_its_body_while_the_other_rows_go(dsn: str) -> None:
    """No foreign key guards body_id (migration 0016): a row that copies another's body
    (here AMQP dead-lettering) holds the original locked, and the release of a concurrent
    delete of the body's other row waits for it, then sees the copy."""
    with psycopg.connect(dsn, autocommit=True) as setup:
        body = new_body(setup)
        original = insert(setup, body, status="running", stage="amqp:/:q")
        other = insert(setup, body, stage="elsewhere")
    letter = [{"workqueue_id": original, "stages": ["amqp:/:dlq"], "state": {},
               "properties": {}, "reason": "rejected"}]  # fmt: skip
    with psycopg.connect(dsn) as mover:
        copied = mover.execute(query("amqp_dead_letter"), {"rows": json.dumps(letter)})
        assert copied.fetchone() == (1, 1, 0)  # one copy made, the original moved
        # the other row's delete waits on the body, locked by the mover's release
        assert delete_behind(dsn, mover, other) == []
    with psycopg.connect(dsn, autocommit=True) as check:
        assert body_exists(check, body)
        rows = check.execute(
            "SELECT stage FROM pepsi.workqueue WHERE body_id = %s", (body,)
        ).fetchall()
        assert rows == [("amqp:/:dlq",)]
        check.execute("DELETE FROM pepsi.workqueue WHERE body_id = %s", (body,))
        assert not body_exists(check, body)


def test_gc_sweeps_orphans_with_a_cursor(conn: Conn) -> None:
    kept = new_body(conn)
    insert(conn, kept)
    orphans = [new_body(conn) for _ in range(5)]  # bodies no row references
    deleted, cursor = 0, 0
    calls = 0
    while True:
        row = conn.execute(
            query("workqueue_body_gc"), {"after_id": cursor, "max_examined": 2}
        ).fetchone()
        assert row is not None
        deleted += int(str(row[0]))
        cursor = int(str(row[1]))
        calls += 1
        if cursor == 0:
            break
    assert deleted == 5
    assert calls == 4  # 6 bodies, 2 per call, and one call to find the end
    assert body_exists(conn, kept)
    assert not any(body_exists(conn, b) for b in orphans)
    row = conn.execute("SELECT deleted FROM pepsi.workqueue_body_gc()").fetchone()
    assert row == (0,)


# ---- plans under stale statistics ----------------------------------------------------------


def _work_of(plans: list[dict[str, object]]) -> int:
    """Rows every node of these plans produced or threw away (a deterministic measure of
    the work done: a join walking a whole index per row shows as millions)."""
    total = 0

    def walk(node: dict[str, object]) -> None:
        nonlocal total
        loops = int(str(node.get("Actual Loops", 1)))
        total += int(float(str(node.get("Actual Rows", 0))) * loops)
        for key in ("Rows Removed by Filter", "Rows Removed by Join Filter"):
            total += int(float(str(node.get(key, 0))))
        for child in node.get("Plans", []) or []:  # type: ignore[attr-defined]
            walk(child)

    for plan in plans:
        walk(plan["Plan"])  # type: ignore[arg-type]
    return total


def _nested_plans(
    conn: Conn,
    statement: str | sql.SQL,
    params: dict[str, object] | None = None,
    *,
    containing: str,
    rows: int | None = None,
) -> list[dict[str, object]]:
    """The plans auto_explain logs for the statements `statement` runs (itself, its
    triggers and functions) whose text contains `containing`. With `params` it runs
    prepared, as psycopg does after a few runs; `rows`: how many it must return."""
    logged: list[str] = []
    conn.add_notice_handler(lambda notice: logged.append(notice.message_primary or ""))
    conn.execute("LOAD 'auto_explain'")
    for setting in (
        "auto_explain.log_min_duration = 0",
        "auto_explain.log_analyze = on",
        "auto_explain.log_nested_statements = on",
        "auto_explain.log_format = json",
        "client_min_messages = log",
    ):
        conn.execute(f"SET {setting}")
    cur = conn.execute(statement, params, prepare=params is not None)
    if rows is not None:
        assert len(cur.fetchall()) == rows
    conn.execute("SET client_min_messages = notice")
    plans = []
    for message in logged:
        start = message.find("{")
        if start < 0:
            continue
        document = json.loads(message[start:])
        if containing in str(document.get("Query Text", "")):
            plans.append(document)
    return plans


@pytest.fixture
def stale(conn: Conn) -> Conn:
    """50 000 rows, each with its body, in tables last vacuumed and analyzed empty after
    a burst of 20 000: the statistics the next burst finds."""
    for table in ("pepsi.workqueue", "pepsi.workqueue_body"):
        conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")

    def publish(count: int) -> None:
        conn.execute(
            "SELECT count(*) FROM pepsi.workqueue_publish_plain("
            "array_fill('s'::text, ARRAY[%(n)s]), array_fill('\\x00'::bytea, ARRAY[%(n)s]),"
            " array_fill('\\x78'::bytea, ARRAY[%(n)s]))",
            {"n": count},
        )

    publish(20_000)  # a burst, drained: vacuum keeps the pages and counts no row
    conn.execute("DELETE FROM pepsi.workqueue")
    conn.execute("VACUUM ANALYZE pepsi.workqueue, pepsi.workqueue_body")
    publish(50_000)
    conn.execute("SET statement_timeout = '30s'")  # a plan that walks an index per row
    return conn


def _first_ids(conn: Conn, count: int = 1000) -> str:
    """The oldest rows' ids, comma-separated (a statement of the test's own with a
    subquery would be planned from the same stale statistics)."""
    row = conn.execute(
        "SELECT string_agg(workqueue_id::text, ',') FROM"
        " (SELECT workqueue_id FROM pepsi.workqueue ORDER BY workqueue_id LIMIT %s) f",
        (count,),
    ).fetchone()
    assert row is not None
    return str(row[0])


def test_a_delete_releases_bodies_with_work_in_proportion_to_its_rows(stale: Conn) -> None:
    """The release trigger's plans stay index probes under stale statistics (they once
    walked a whole index per deleted row: 14 s for one batch of acknowledgements)."""
    plans = _nested_plans(
        stale,
        f"DELETE FROM pepsi.workqueue WHERE workqueue_id = ANY('{{{_first_ids(stale)}}}')",
        containing="pepsi.workqueue_body b",
    )
    assert len(plans) == 2  # the lock and the delete
    assert _work_of(plans) < 10 * 1000  # 3 000 here; 111 000 with a join
    left = stale.execute("SELECT count(*) FROM pepsi.workqueue_body").fetchone()
    assert left == (50_000 - 1000,)


def test_the_body_sweep_examines_in_proportion_to_its_batch(stale: Conn) -> None:
    plans = _nested_plans(
        stale,
        "SELECT * FROM pepsi.workqueue_body_gc(0, 10000)",
        containing="WITH examined AS",
    )
    assert len(plans) == 1
    assert _work_of(plans) < 10 * 10_000  # 80 000 here; 240 000 with a join


def _prepared_plans(
    conn: Conn,
    name: str,
    params: dict[str, object],
    rows: int | None = None,
    *,
    containing: str | None = None,
) -> list[dict[str, object]]:
    """The plans of the named query, run prepared (marked by its first line), or of the
    statements it runs whose text has `containing` (inside a function)."""
    marker = containing or query_text(name).splitlines()[0][:40]
    return _nested_plans(conn, query(name), params, containing=marker, rows=rows)


@pytest.mark.parametrize(
    "name", ["workqueue_load_running", "workqueue_load_running_with_settings", "amqp_delivery_load"]
)
def test_loading_bodies_probes_each_once_under_stale_statistics(stale: Conn, name: str) -> None:
    """A worker's load and the AMQP deliverer's, as generic plans (psycopg prepares a
    statement after a few runs): once a join, which walked the whole body index per row
    (a consume fell from 16 000 to 6 000 messages a second)."""
    ids = [int(i) for i in _first_ids(stale).split(",")]
    stale.execute(
        "UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = ANY(%s)", (ids,)
    )
    stale.execute("SET plan_cache_mode = force_generic_plan")
    params = {"ids": ids, "stage": "s", "with_header": True, "with_body": True, "inline": 1 << 18}
    # a stage's load is a function (0028): its statement, not the call
    inner = "b ON true" if name == "workqueue_load_running" else None
    plans = _prepared_plans(stale, name, params, rows=1000, containing=inner)
    assert len(plans) == 1
    assert 1000 <= _work_of(plans) < 10 * 1000


def test_recording_outcomes_probes_each_row_under_stale_statistics(stale: Conn) -> None:
    """A worker's outcomes (half finished, half advanced), as a generic plan: joined to
    the JSON recordset alone, the table side was a scan of every row per batch."""
    ids = [int(i) for i in _first_ids(stale).split(",")]
    stale.execute(
        "UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = ANY(%s)", (ids,)
    )
    stale.execute("SET plan_cache_mode = force_generic_plan")
    updates = [
        {"workqueue_id": i, "stage": "t", "status": "pending", "timeout": None, "state": {}}
        for i in ids[500:]
    ]
    params = {"finished": ids[:500], "stage": "s", "updates": json.dumps(updates)}
    # the function's DELETE and UPDATE (0028), each one generic plan
    plans = _prepared_plans(
        stale, "workqueue_record_outcomes", params, containing="w.stage = at_stage"
    )
    assert len(plans) == 2
    assert 1000 <= _work_of(plans) < 10 * 1000
    moved = stale.execute("SELECT count(*) FROM pepsi.workqueue WHERE stage = 't'").fetchone()
    assert moved == (500,)


def _metadata_load_plans(conn: Conn, ids: list[int]) -> list[dict[str, object]]:
    """The plan of the table read inside pepsi.workqueue_load_metadata, as it ran."""
    params = {"ids": ids, "stage": "s"}
    return _nested_plans(
        conn, query("workqueue_load_metadata"), params, containing="FROM pepsi.workqueue w",
        rows=len(ids),
    )  # fmt: skip


def _probes_by_key(plans: list[dict[str, object]]) -> bool:
    (plan,) = plans
    node = plan["Plan"]
    assert isinstance(node, dict)
    return (node["Node Type"], node.get("Index Name")) == ("Index Scan", "workqueue_pkey")


def test_a_metadata_load_probes_each_row_under_stale_statistics(stale: Conn) -> None:
    """A metadata-only stage's load, one generic plan (schema 26): the primary key."""
    ids = [int(i) for i in _first_ids(stale).split(",")]
    stale.execute(
        "UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = ANY(%s)", (ids,)
    )
    plans = _metadata_load_plans(stale, ids)
    assert _probes_by_key(plans)
    assert _work_of(plans) < 10 * 1000


def test_a_metadata_load_planned_on_a_small_queue_still_probes_a_large_one(conn: Conn) -> None:
    """The generic plan is made once per session, perhaps while the queue is nearly
    empty (where a sequential scan is the cheapest); it serves every later batch."""
    small = conn.execute(
        "INSERT INTO pepsi.workqueue (stage, status) VALUES ('s', 'running') RETURNING workqueue_id"
    ).fetchone()
    assert small is not None
    conn.execute("ANALYZE pepsi.workqueue")  # statistics of one row
    for _ in range(3):
        assert _probes_by_key(_metadata_load_plans(conn, [int(small[0])]))
    conn.execute(
        "INSERT INTO pepsi.workqueue (stage, status)"
        " SELECT 's', 'running' FROM generate_series(1, 50000)"
    )
    plans = _metadata_load_plans(conn, [int(small[0])])
    assert _probes_by_key(plans)
    assert _work_of(plans) < 100
