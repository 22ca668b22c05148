"""P-4: the claim walks the pending index and stops at each stage's cap,
whatever the backlog and whatever the statistics: checked on a skewed backlog
of 1 M rows, and with the statistics a vacuum of the drained queue leaves.

The claim is a function (for its planner settings), so its plan is read with
auto_explain, which reports the statement inside it as a notice.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from pepsi.db.queries import query
from tests.conftest import TEMPLATE, _fresh
from tests.rows import NO_ROWS

Conn = psycopg.Connection[tuple[Any, ...]]
FIFO = {"stages": ["big", "small", "empty"], "caps": [16, 16, 16], "commit": None, **NO_ROWS}


def nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found.extend(nodes(child))
    return found


def inner_plan(conn: Conn, params: dict[str, Any]) -> dict[str, Any]:
    """The plan of the UPDATE inside workqueue_claim_fifo, as it ran (rolled back)."""
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    conn.execute("LOAD 'auto_explain'")
    for key, value in (("log_min_duration", "0"), ("log_nested_statements", "on"),
                       ("log_analyze", "on"), ("log_buffers", "on"), ("log_format", "json"),
                       ("log_level", "notice")):  # fmt: skip
        conn.execute(f"SET auto_explain.{key} = {value}")
    with conn.transaction(force_rollback=True):
        conn.execute(query("workqueue_claim_fifo"), params).fetchall()
    plans = [json.loads(n[n.index("{") :]) for n in notices if "UPDATE pepsi.workqueue" in n]
    assert plans, notices
    plan: dict[str, Any] = plans[0]["Plan"]
    return plan


def skewed_backlog(conn: Conn) -> None:
    # One stage dominates: 990 000 pending rows; another has 10 000; and
    # 50 000 failed rows of the big stage sit in the primary key's way.
    conn.execute(
        "INSERT INTO pepsi.workqueue (stage, status, sender)"
        " SELECT CASE WHEN n % 100 = 0 THEN 'small' ELSE 'big' END, 'pending', 'a@b.c'"
        " FROM generate_series(1, 1000000) AS n"
    )
    conn.execute(
        "INSERT INTO pepsi.workqueue (stage, status) SELECT 'big', 'failed'"
        " FROM generate_series(1, 50000)"
    )
    conn.execute("ANALYZE pepsi.workqueue")


def assert_on_the_partial_index(plan: dict[str, Any]) -> int:
    scans = [n for n in nodes(plan) if n.get("Relation Name") == "workqueue"]
    kinds = {(n["Node Type"], n.get("Index Name")) for n in scans}
    assert not {kind for kind, _ in kinds} & {"Seq Scan", "Bitmap Heap Scan"}, kinds
    assert kinds & {
        ("Index Scan", "workqueue_pending_idx"),
        ("Index Only Scan", "workqueue_pending_idx"),
    }, kinds
    assert plan.get("Actual Rows", 0) == 32  # 16 + 16, the empty stage has none
    return int(plan["Shared Hit Blocks"] + plan["Shared Read Blocks"])


@pytest.fixture(scope="module")
def backlog(admin_dsn: str, template_dsn: str) -> Iterator[Conn]:
    """One skewed backlog for the module's tests: building it is most of their time."""
    for dsn in _fresh(admin_dsn, TEMPLATE):
        with psycopg.connect(dsn, autocommit=True) as conn:
            skewed_backlog(conn)
            yield conn


def test_claim_plan_stays_on_the_partial_index_on_a_skewed_backlog(backlog: Conn) -> None:
    conn = backlog
    touched = assert_on_the_partial_index(inner_plan(conn, FIFO))
    # The cost does not depend on the backlog: a few pages per claimed row.
    assert touched < 1000, f"claim touched {touched} pages"
    print(f"claim of 32 rows on a 1.05 M-row backlog touched {touched} pages")


def test_claim_plan_holds_with_the_statistics_of_an_empty_queue(backlog: Conn) -> None:
    """A vacuum of the drained queue leaves no tuples in its pages' statistics.

    With them the planner took a bitmap of every pending row of the stage and
    sorted it: 107 ms a claim on a 200 000-row backlog, growing with it.
    """
    conn = backlog
    conn.execute(
        "UPDATE pg_class SET reltuples = 0 WHERE oid IN ('pepsi.workqueue'::regclass,"
        " 'pepsi.workqueue_pending_idx'::regclass, 'pepsi.workqueue_pending_sender_idx'::regclass)"
    )
    try:
        with psycopg.connect(conn.info.dsn, autocommit=True) as fresh:  # plans made now
            touched = assert_on_the_partial_index(inner_plan(fresh, FIFO))
    finally:
        conn.execute("ANALYZE pepsi.workqueue")  # the backlog's own statistics again
    assert touched < 1000, f"claim touched {touched} pages"


def claimed_by_key(conn: Conn, name: str, params: dict[str, Any]) -> int:
    """The plan of the UPDATE inside claim `name` finds its rows by the primary key: the
    pages it touched."""
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    conn.execute("LOAD 'auto_explain'")
    for key, value in (("log_min_duration", "0"), ("log_nested_statements", "on"),
                       ("log_analyze", "on"), ("log_buffers", "on"), ("log_format", "json"),
                       ("log_level", "notice")):  # fmt: skip
        conn.execute(f"SET auto_explain.{key} = {value}")
    with conn.transaction(force_rollback=True):
        conn.execute(query(name), params).fetchall()
    updates = [
        json.loads(n[n.index("{") :])["Plan"]
        for n in notices
        if "SET status = 'running'" in n and "UPDATE pepsi.workqueue" in n
    ]
    assert updates, notices
    (update,) = [n for n in nodes(updates[-1]) if n["Node Type"] == "ModifyTable"]
    # the rows it updates (its outer child) are found by key; the ids' own subplan may
    # read the pending index, as it should
    (rows,) = [p for p in update["Plans"] if p.get("Parent Relationship") == "Outer"]
    assert (rows["Node Type"], rows.get("Index Name")) == ("Index Scan", "workqueue_pkey"), rows
    return int(update["Shared Hit Blocks"] + update["Shared Read Blocks"])


def test_both_claims_find_their_rows_by_key_after_a_vacuum_of_an_empty_queue(
    admin_dsn: str, template_dsn: str
) -> None:
    """Issue 33: after a VACUUM of the emptied queue (the operator's after a mass DELETE,
    or autovacuum's after a drain) the table and its indexes count 0 rows; the claim's
    last UPDATE then read its ids through workqueue_pending_sender_idx, a pass over the
    whole index per claim with many senders (12 ms, not 0.5), and a drain ran 4-5x
    slower until the dispatcher's own VACUUM. The real sequence, 2 000 senders."""
    for dsn in _fresh(admin_dsn, TEMPLATE):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("ALTER TABLE pepsi.workqueue SET (autovacuum_enabled = false)")
            backlog = (
                "INSERT INTO pepsi.workqueue (stage, status, sender)"
                " SELECT 'many', 'pending', 's' || (n % 2000) || '@x.org'"
                " FROM generate_series(1, 40000) AS n"
            )
            conn.execute(backlog)
            conn.execute("DELETE FROM pepsi.workqueue")
            conn.execute("VACUUM pepsi.workqueue")  # records 0 rows: vacuum_truncate is off
            conn.execute(backlog)
            with psycopg.connect(dsn, autocommit=True) as fresh:  # plans made now
                fifo = claimed_by_key(fresh, "workqueue_claim_fifo",
                                      {"stages": ["many"], "caps": [64], "commit": None, **NO_ROWS})  # fmt: skip
                fair = claimed_by_key(fresh, "workqueue_claim_fair", {
                    "stages": ["many"], "caps": [64], "fifo": [6], "averages": [0.001],
                    "starts": [""], "lags": json.dumps({}), "max_senders": 64, "commit": None, **NO_ROWS,
                })  # fmt: skip
    assert fifo < 1000, fifo
    assert fair < 1000, fair
