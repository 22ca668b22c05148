"""P-4: the claim walks the pending index and stops at each stage's cap,
whatever the backlog: checked on a skewed backlog of 1 M rows."""

from __future__ import annotations

import json
from typing import Any

import psycopg

from pepsi.db.queries import query

Conn = psycopg.Connection[tuple[Any, ...]]


def nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found.extend(nodes(child))
    return found


def test_claim_plan_stays_on_the_partial_index_on_a_skewed_backlog(conn: Conn) -> None:
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
    params = {"stages": ["big", "small", "empty"], "caps": [16, 16, 16]}
    with conn.transaction(force_rollback=True):
        row = conn.execute(
            b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query("workqueue_claim_fifo").as_bytes(),
            params,
        ).fetchone()
    assert row is not None
    plan = (row[0] if isinstance(row[0], list) else json.loads(str(row[0])))[0]
    all_nodes = nodes(plan["Plan"])
    scans = [n for n in all_nodes if n.get("Relation Name") == "workqueue"]
    kinds = {(n["Node Type"], n.get("Index Name")) for n in scans}
    assert ("Seq Scan", None) not in kinds
    assert ("Index Scan", "workqueue_pending_idx") in kinds or (
        "Index Only Scan",
        "workqueue_pending_idx",
    ) in kinds
    claimed = plan["Plan"].get("Actual Rows", 0)
    assert claimed == 32  # 16 + 16, the empty stage has none
    # The cost does not depend on the backlog: a few pages per claimed row.
    touched = plan["Plan"]["Shared Hit Blocks"] + plan["Plan"]["Shared Read Blocks"]
    assert touched < 1000, f"claim touched {touched} pages"
    print(f"claim of 32 rows on a 1.05 M-row backlog touched {touched} pages")
