"""pepsi.workqueue_claim_fair against the pure ranking, rotation, starvation, plan."""

from __future__ import annotations

from typing import Any

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

from pepsi.db.queries import query
from pepsi.dispatch.policy.fairness import rank
from tests.rows import NO_ROWS

Conn = psycopg.Connection[tuple[Any, ...]]


def insert(conn: Conn, stage: str, users: list[str]) -> list[int]:
    """One pending row per entry, in order, for origin user `users[i]`."""
    rows = conn.execute(
        "INSERT INTO pepsi.workqueue (stage, origin_user)"
        " SELECT %s, u FROM unnest(%s::text[]) WITH ORDINALITY AS t(u, n) ORDER BY n"
        " RETURNING workqueue_id",
        (stage, users),
    ).fetchall()
    return [int(r[0]) for r in rows]


def claim(
    conn: Conn,
    stage: str,
    cap: int,
    *,
    fifo: int = 0,
    average: float = 1.0,
    lags: dict[str, float] | None = None,
    start: str = "",
    max_senders: int = 64,
) -> tuple[list[int], str]:
    lags = lags or {}
    row = conn.execute(
        query("workqueue_claim_fair"),
        {
            "stages": [stage], "caps": [cap], "fifo": [fifo], "averages": [average],
            "starts": [start], "lags": Jsonb({stage: lags} if lags else {}),
            "max_senders": max_senders, "commit": None, **NO_ROWS,
        },
    ).fetchone()  # fmt: skip
    assert row is not None
    return [int(i) for i in row[0]], str(row[3][0])


def pages_touched(conn: Conn, claim_sql: bytes | str, params: dict[str, Any] | None = None) -> int:
    """Pages one claim reads or hits (EXPLAIN ANALYZE: it runs for real)."""
    prefix = b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
    sql = claim_sql if isinstance(claim_sql, bytes) else claim_sql.encode()
    row = conn.execute(prefix + sql, params).fetchone()
    assert row is not None
    plan = row[0][0]["Plan"]
    return int(plan["Shared Hit Blocks"] + plan["Shared Read Blocks"])


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[str], dict[str, float], float, int, int]:
    senders = draw(st.lists(st.sampled_from("abcdefghij"), min_size=1, max_size=10, unique=True))
    order = draw(st.lists(st.sampled_from(senders), min_size=1, max_size=60))
    lags = {s: draw(st.sampled_from([0.5, 1.0, 2.5, 7.0])) for s in senders if draw(st.booleans())}
    cap = draw(st.integers(1, 25))
    return order, lags, draw(st.sampled_from([0.25, 1.0, 3.0])), cap, draw(st.integers(0, cap))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cases())
def test_sql_claims_what_the_pure_ranking_chooses(
    conn: Conn, case: tuple[list[str], dict[str, float], float, int, int]
) -> None:
    order, lags, average, cap, fifo = case
    conn.execute("DELETE FROM pepsi.workqueue")
    ids = insert(conn, "s", order)
    pending: dict[str, list[int]] = {}
    for wid, user in zip(ids, order, strict=True):
        pending.setdefault(f"user:{user}", []).append(wid)
    keyed = {f"user:{s}": v for s, v in lags.items()}
    expected = rank(pending, keyed, average, cap, fifo)
    claimed, _ = claim(conn, "s", cap, fifo=fifo, average=average, lags=keyed)
    assert sorted(claimed) == sorted(expected)
    running = conn.execute(
        "SELECT array_agg(workqueue_id ORDER BY workqueue_id) FROM pepsi.workqueue"
        " WHERE status = 'running'"
    ).fetchone()
    assert running is not None
    assert (running[0] or []) == sorted(expected)


def test_window_rotates_past_64_senders(conn: Conn) -> None:
    users = [f"u{i:03d}" for i in range(100)]
    insert(conn, "s", users + users)  # two rows each: 200 pending, more than a claim takes
    first, start = claim(conn, "s", 150)
    assert len(first) == 128  # both rows of each of the first 64 senders
    assert start == "user:u063"
    second, start = claim(conn, "s", 50, start=start)
    assert len(second) == 50  # from the other 36 only; the window wraps to the start
    assert start == ""
    senders = conn.execute(
        "SELECT DISTINCT origin_user FROM pepsi.workqueue WHERE workqueue_id = ANY(%s)", (second,)
    ).fetchall()
    assert {s for (s,) in senders} <= set(users[64:])


def test_everything_pending_fits_in_one_claim(conn: Conn) -> None:
    """No ranking and no window when the claim can take every pending row."""
    users = [f"u{i:03d}" for i in range(100)]
    ids = insert(conn, "s", users)
    claimed, start = claim(conn, "s", 200, start="user:u050", lags={"user:u001": 50.0})
    assert sorted(claimed) == ids
    assert start == "user:u050"  # the window stays where it was
    assert conn.execute(
        "SELECT count(*) FROM pepsi.workqueue WHERE status = 'pending'"
    ).fetchone() == (0,)


def test_a_lone_sender_gets_its_oldest_rows_whatever_its_lag(conn: Conn) -> None:
    """One pending sender: the ranking would take its oldest rows; the claim does, at once."""
    ids = insert(conn, "s", ["solo"] * 50)
    claimed, start = claim(conn, "s", 20, fifo=5, lags={"user:solo": 1000.0})
    assert claimed == ids[:20]
    assert start == ""
    assert claim(conn, "s", 20)[0] == ids[20:40]


def test_oldest_row_is_never_starved_by_new_senders(conn: Conn) -> None:
    """A heavily served sender's row, behind a stream of new level senders."""
    (old,) = insert(conn, "s", ["heavy"])
    cap, percent, rounds = 4, 10, 0
    credit = 0.0
    for round_ in range(1, 100):
        insert(conn, "s", [f"new{round_}-{i}" for i in range(cap * 2)])  # newcomers keep coming
        credit += cap * percent / 100
        fifo = int(credit)
        credit -= fifo
        claimed, _ = claim(conn, "s", cap, fifo=fifo, lags={"user:heavy": 1000.0})
        conn.execute("DELETE FROM pepsi.workqueue WHERE workqueue_id = ANY(%s)", (claimed,))
        if old in claimed:
            rounds = round_
            break
    # The bound: the rows queued before it (none) drain at the reserved rate,
    # one slot every 100 / (cap × percent) = 2.5 claims.
    assert 1 <= rounds <= 3


def test_cost_does_not_grow_with_a_senders_backlog(conn: Conn) -> None:
    conn.execute(
        "INSERT INTO pepsi.workqueue (stage, origin_user)"
        " SELECT 's', CASE WHEN n % 1000 = 0 THEN 'small' || n ELSE 'huge' END"
        " FROM generate_series(1, 200000) n"
    )
    conn.execute("ANALYZE pepsi.workqueue")
    with conn.transaction(force_rollback=True):
        touched = pages_touched(
            conn,
            "SELECT * FROM pepsi.workqueue_claim_fair('{s}', '{16}', '{2}', '{1.0}', '{\"\"}', '{}', 64)",
        )
        claimed = conn.execute(
            "SELECT count(*) FROM pepsi.workqueue WHERE status = 'running'"
        ).fetchone()
    assert claimed == (16,)
    # 201 senders are enumerated (one probe each) and 16 rows claimed: a few
    # thousand pages at most, against ~4 000 pages for the table itself.
    assert 0 < touched < 3000, touched


def test_claim_stays_on_the_sender_index_with_statistics_of_an_empty_queue(conn: Conn) -> None:
    """A vacuum of the drained queue leaves statistics of no rows in its pages.

    With them the planner took a bitmap of every pending row of the stage and
    sorted it, once per sender probed: 50-600 ms a claim in a burst, a
    thousand messages a second instead of thirteen (bench/race.py, fairness).
    """
    conn.execute(
        "INSERT INTO pepsi.workqueue (stage, origin_user)"
        " SELECT 's', 'u' || (n % 2000) FROM generate_series(1, 20000) n"
    )
    conn.execute("ANALYZE pepsi.workqueue")
    # what that vacuum leaves (set by hand: when a vacuum lands on an empty
    # queue is a race): no tuples in the table's and the indexes' pages
    conn.execute(
        "UPDATE pg_class SET reltuples = 0 WHERE oid IN ('pepsi.workqueue'::regclass,"
        " 'pepsi.workqueue_pending_idx'::regclass, 'pepsi.workqueue_pending_sender_idx'::regclass)"
    )
    lags = {f"user:u{i}": 0.001 * (i % 7) for i in range(0, 2000, 3)}
    with psycopg.connect(conn.info.dsn, autocommit=True) as fresh:  # plans made now
        touched = pages_touched(
            fresh,
            query("workqueue_claim_fair").as_bytes(),
            {"stages": ["s"], "caps": [128], "fifo": [12], "averages": [0.0001],
             "starts": ["user:u150"], "lags": Jsonb({"s": lags}), "max_senders": 64,
             "commit": None, **NO_ROWS},
        )  # fmt: skip
    assert touched < 8000, touched  # the bitmap plans read ~24 000 pages for this claim


def test_plans_made_on_a_small_queue_still_serve_a_large_one(conn: Conn) -> None:
    """The claim keeps one generic plan of each statement per session (schema 29): the
    dispatcher's first claims, on a queue of a few rows, make the plans its claims use
    on a backlog of 200 000 from 201 senders, with the statistics of the small one."""
    conn.execute("ALTER TABLE pepsi.workqueue SET (autovacuum_enabled = false)")
    conn.execute(
        "INSERT INTO pepsi.workqueue (stage, origin_user) SELECT 's', 'early' || n"
        " FROM generate_series(1, 3) n"
    )
    conn.execute("ANALYZE pepsi.workqueue")
    with psycopg.connect(conn.info.dsn, autocommit=True) as dispatcher:  # one session
        for _ in range(3):
            with dispatcher.transaction(force_rollback=True):
                assert len(claim(dispatcher, "s", 2)[0]) == 2
        conn.execute(
            "INSERT INTO pepsi.workqueue (stage, origin_user)"
            " SELECT 's', CASE WHEN n % 1000 = 0 THEN 'small' || n ELSE 'huge' END"
            " FROM generate_series(1, 200000) n"
        )  # not analyzed: the plans and the statistics are the small queue's
        with dispatcher.transaction(force_rollback=True):
            touched = pages_touched(
                dispatcher,
                "SELECT * FROM pepsi.workqueue_claim_fair('{s}', '{16}', '{2}', '{1.0}',"
                " '{\"\"}', '{}', 64)",
            )
    assert 0 < touched < 3000, touched
