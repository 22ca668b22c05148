"""Message priority in the claims (issue 33): higher first, FIFO within a priority, and
within a sender under fair scheduling; rows without one keep their plans."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from pepsi.db.queries import query
from tests.rows import NO_ROWS

Conn = psycopg.Connection[tuple[Any, ...]]


def insert(conn: Conn, stage: str, rows: list[tuple[str, int]]) -> list[int]:
    """One pending row per (origin user, priority), in order."""
    return [
        int(r[0])
        for r in conn.execute(
            "INSERT INTO pepsi.workqueue (stage, origin_user, priority)"
            " SELECT %s, u, p FROM unnest(%s::text[], %s::smallint[]) WITH ORDINALITY"
            " AS t(u, p, n) ORDER BY n RETURNING workqueue_id",
            (stage, [u for u, _ in rows], [p for _, p in rows]),
        ).fetchall()
    ]


def fifo(conn: Conn, stage: str, cap: int) -> list[int]:
    """The claimed ids in the order the dispatcher serves them (by the priority returned)."""
    rows = conn.execute(
        query("workqueue_claim_fifo"), {"stages": [stage], "caps": [cap], "commit": None, **NO_ROWS}
    )
    return [int(r[0]) for r in sorted(rows.fetchall(), key=lambda r: (-r[2], r[0]))]


def fair(conn: Conn, stage: str, cap: int, fifo_share: int = 0) -> list[int]:
    row = conn.execute(
        query("workqueue_claim_fair"),
        {
            "stages": [stage], "caps": [cap], "fifo": [fifo_share], "averages": [1.0],
            "starts": [""], "lags": Jsonb({}), "max_senders": 64, "commit": None, **NO_ROWS,
        },
    ).fetchone()  # fmt: skip
    assert row is not None
    return [int(i) for i in row[0]]


def test_the_oldest_first_claim_takes_the_highest_priority_first(conn: Conn) -> None:
    a, b, c, d, e, f = insert(
        conn, "s", [("u", 0), ("u", 0), ("u", 5), ("u", 1), ("u", 5), ("u", 0)]
    )
    assert fifo(conn, "s", 3) == [c, e, d]  # 5, 5 (FIFO between them), 1
    assert fifo(conn, "s", 10) == [a, b, f]  # then the others, oldest first
    g, h = insert(conn, "s", [("u", 0), ("u", 0)])
    assert fifo(conn, "s", 10) == [g, h]  # none with a priority: as before


def test_the_fair_claim_orders_each_senders_rows_by_priority(conn: Conn) -> None:
    """Senders stay fair to each other; within each, its highest priority goes first."""
    a1, a2, a3 = insert(conn, "s", [("alice", 0), ("alice", 0), ("alice", 9)])
    b1, b2, b3 = insert(conn, "s", [("bob", 0), ("bob", 3), ("bob", 0)])
    assert fair(conn, "s", 2) == [a3, b2]  # one each (fair), each sender's highest
    assert sorted(fair(conn, "s", 2)) == [a1, b1]  # then each one's oldest
    assert sorted(fair(conn, "s", 10)) == [a2, b3]


def test_the_fair_claims_head_is_the_highest_priority(conn: Conn) -> None:
    """fifo[i], the share taken whatever the sender, is the stage's head: its highest
    priority, then its oldest; one sender waiting takes its own highest first."""
    insert(conn, "s", [("alice", 0), ("bob", 0)])
    (late,) = insert(conn, "s", [("carol", 7)])
    assert fair(conn, "s", 1, fifo_share=1) == [late]
    conn.execute("DELETE FROM pepsi.workqueue")
    x, y, z = insert(conn, "t", [("alice", 0), ("alice", 2), ("alice", 0)])
    assert fair(conn, "t", 2) == [y, x]
    assert fair(conn, "t", 2) == [z]
