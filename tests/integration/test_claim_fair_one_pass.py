"""The fair claim's one pass (issue 36): each sender of the window read with its oldest
rows in one descent, a second read only for senders whose further rows may still rank
in. Whatever the lags, the backlog and the capacity, it claims what the pure ranking
chooses; and a window of many senders costs one descent each."""

from __future__ import annotations

from typing import Any

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pepsi.dispatch.policy.fairness import rank
from tests.integration.test_claim_fair import claim, insert

Conn = psycopg.Connection[tuple[Any, ...]]


@st.composite
def backlogs(draw: st.DrawFn) -> tuple[list[str], dict[str, float], float, int, int]:
    """Up to 64 senders (one window), some with many rows; lags a whole number of
    messages apart, so that scores tie across senders and at the first pass's edge, and
    averages near 0 and 0 itself, where all of a sender's rows tie."""
    count = draw(st.integers(2, 64))
    senders = [f"s{i:02d}" for i in range(count)]
    depth = draw(st.lists(st.integers(1, 12), min_size=count, max_size=count))
    order = [s for s, d in zip(senders, depth, strict=True) for _ in range(d)]
    order = draw(st.permutations(order))
    average = draw(st.sampled_from([0.25, 1.0, 0.001, 1e-12, 0.0]))
    lags = {
        s: draw(st.integers(0, 9)) * (average or 0.5)
        for s in senders
        if draw(st.integers(0, 3)) > 0
    }
    cap = draw(st.integers(2, 200))
    return list(order), lags, average, cap, draw(st.integers(0, cap // 4))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(backlogs())
def test_one_pass_claims_what_the_pure_ranking_chooses(
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


def test_a_sender_far_behind_the_others_gets_all_its_rows_ranked(conn: Conn) -> None:
    """One sender owed many messages' worth: it ranks in beyond the rows read with it
    at first, which a second read fetches (the other senders are not read again)."""
    users = [f"u{i:02d}" for i in range(40)]
    insert(conn, "s", [u for u in users for _ in range(10)])  # 10 rows each, grouped
    lags = {f"user:{u}": 20.0 for u in users[1:]}  # u00 is 20 messages behind the rest
    claimed, _ = claim(conn, "s", 30, average=1.0, lags=lags)
    mine = conn.execute(
        "SELECT count(*) FROM pepsi.workqueue WHERE workqueue_id = ANY(%s) AND origin_user = 'u00'",
        (claimed,),
    ).fetchone()
    assert mine == (10,)  # all of u00's, then 20 of the others'
    assert len(claimed) == 30


def test_a_window_costs_one_descent_per_sender(conn: Conn) -> None:
    """64 senders with 50 rows each and even lags: a claim of 16 descends the sender
    index once per sender (it found each sender, then read its rows with a second
    descent: 128)."""
    conn.execute(
        "INSERT INTO pepsi.workqueue (stage, origin_user)"
        " SELECT 's', 'u' || (n % 64) FROM generate_series(1, 3200) n"
    )
    conn.execute("VACUUM ANALYZE pepsi.workqueue")

    def descents() -> int:
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT idx_scan FROM pg_stat_user_indexes"
            " WHERE indexrelname = 'workqueue_pending_sender_idx'"
        ).fetchone()
        assert row is not None
        return int(row[0])

    before = descents()
    with conn.transaction(force_rollback=True):
        claimed, _ = claim(conn, "s", 16, fifo=1)
    assert len(claimed) == 16
    # 64 senders and one probe past the last: the claim reads no sender twice
    assert descents() - before <= 66
