"""The dispatcher's database services in-process against a real PostgreSQL: the
session's lock and orphan reset, the claimer (FIFO and fair), the sweeper, the
stats flusher and the row writer's strikes. Each `run_once` is driven directly,
with an injected clock where timing matters; no dispatcher or worker process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg import sql

from pepsi.config import Config, DispatchOptions, StageConfig, load_config
from pepsi.dispatch.coordinator import Dispatcher
from pepsi.dispatch.ledger import Claimed
from pepsi.dispatch.policy.fairness import FairShare
from pepsi.dispatch.rows import MAX_STRIKES, RowWriter
from pepsi.dispatch.services.claimer import ROWS_MAX, Claimer
from pepsi.dispatch.services.flusher import StatsFlusher
from pepsi.dispatch.services.sweeper import Sweeper, SweepOptions
from pepsi.dispatch.session import Session, SessionOptions, connect
from pepsi.dispatch.stats import Stats
from pepsi.errors import AlreadyRunning, DatabaseReadOnly, classify, is_reconnect
from pepsi.stage import Needs
from pepsi.worker.messages import MessageLoader

REPO = Path(__file__).resolve().parents[2]
Conn = psycopg.Connection[tuple[Any, ...]]
AConn = psycopg.AsyncConnection[tuple[Any, ...]]
T = TypeVar("T")


def run(dsn: str, body: Callable[[AConn], Awaitable[T]]) -> T:
    async def main() -> T:
        async with await connect(dsn, "pepsi-test", 10.0) as conn:
            return await body(conn)

    return asyncio.run(main())


def insert(conn: Conn, stage: str, senders: list[str], status: str = "pending") -> list[int]:
    rows = conn.execute(
        "INSERT INTO pepsi.workqueue (stage, origin_user, status)"
        " SELECT %s, u, %s::pepsi.workqueue_status"
        " FROM unnest(%s::text[]) WITH ORDINALITY AS t(u, n) ORDER BY n"
        " RETURNING workqueue_id",
        (stage, status, senders),
    ).fetchall()
    return [int(r[0]) for r in rows]


def statuses(conn: Conn) -> dict[int, str]:
    rows = conn.execute("SELECT workqueue_id, status::text FROM pepsi.workqueue").fetchall()
    return {int(i): str(s) for i, s in rows}


def _options(dsn: str, lock_wait: float = 0.3) -> SessionOptions:
    return SessionOptions(dsn, connect_timeout=5.0, lock_wait=lock_wait, reconnect_max=1.0)


# ---- session ------------------------------------------------------------------------


def test_a_second_session_gives_up_after_lock_wait_naming_the_holder(dsn: str) -> None:
    async def main() -> tuple[str, float]:
        first = Session(_options(dsn), lambda: False, time.monotonic)
        await first.open()
        second = Session(_options(dsn, lock_wait=0.3), lambda: False, time.monotonic)
        started = time.monotonic()
        try:
            with pytest.raises(AlreadyRunning) as refused:
                await second.open()
            return str(refused.value), time.monotonic() - started
        finally:
            await first.close()

    message, waited = asyncio.run(main())
    assert "another dispatcher is running on this database (backend pid" in message
    assert "pepsi-dispatch" in message
    assert 0.3 <= waited < 5


def test_the_lock_is_free_again_once_its_session_closes(dsn: str) -> None:
    async def main() -> None:
        first = Session(_options(dsn), lambda: False, time.monotonic)
        await first.open()
        await first.close()
        second = Session(_options(dsn), lambda: False, time.monotonic)
        await second.open()
        await second.close()

    asyncio.run(main())


def test_orphans_go_back_to_pending_held_rows_stay_running(dsn: str, conn: Conn) -> None:
    held, orphans = insert(conn, "s", ["a", "b"], "running"), insert(conn, "s", ["c"], "running")

    async def main() -> None:
        session = Session(_options(dsn), lambda: False, time.monotonic)
        await session.open()
        try:
            await session.reset_orphans(held)
        finally:
            await session.close()

    asyncio.run(main())
    now = statuses(conn)
    assert [now[i] for i in held] == ["running", "running"]
    assert [now[i] for i in orphans] == ["pending"]


# ---- claimer --------------------------------------------------------------------------


def test_the_fifo_claim_takes_each_stages_oldest_within_its_capacity(dsn: str, conn: Conn) -> None:
    a = insert(conn, "a", ["x"] * 5)
    b = insert(conn, "b", ["x"] * 3)
    claimer = Claimer(None)
    rows = run(dsn, lambda c: claimer.run_once(c, {"a": 2, "b": 10, "idle": 0}))
    assert rows == [Claimed(a[0], "a"), Claimed(a[1], "a"), *(Claimed(i, "b") for i in b)]
    assert claimer.statements == 1
    now = statuses(conn)
    assert sorted(i for i, s in now.items() if s == "running") == sorted([*a[:2], *b])


def test_no_capacity_runs_no_statement(dsn: str, conn: Conn) -> None:
    insert(conn, "a", ["x"])
    claimer = Claimer(None)
    assert run(dsn, lambda c: claimer.run_once(c, {"a": 0})) == []
    assert claimer.statements == 0


def test_the_fair_claim_interleaves_senders_and_names_them(dsn: str, conn: Conn) -> None:
    greedy = insert(conn, "s", ["greedy"] * 20)
    polite = insert(conn, "s", ["polite"] * 2)
    fair = FairShare(60.0, 0, time.monotonic)
    rows = run(dsn, lambda c: Claimer(fair).run_once(c, {"s": 4}))
    taken = {row.wid for row in rows}
    assert set(polite) <= taken  # the small sender is not stuck behind the burst
    assert len(taken & set(greedy)) == 2
    assert {row.sender for row in rows} == {"user:greedy", "user:polite"}  # origin user
    assert "s" in fair.window


@pytest.mark.parametrize("fair", [False, True], ids=["fifo", "fair"])
def test_stage_names_of_any_characters_reach_the_claim_intact(
    dsn: str, conn: Conn, fair: bool
) -> None:
    """The claim's arguments go as array literals: names that need quoting in one."""
    names = ['a"b', "c\\d", "{e,f}", "g h", "", "amqp:%2F:q 'x' NULL", "NULL"]
    ids = {name: insert(conn, name, ["x", "y"]) for name in names}
    share = FairShare(60.0, 0, time.monotonic) if fair else None
    claimer = Claimer(share, synchronous=True)
    rows = run(dsn, lambda c: claimer.run_once(c, dict.fromkeys(names, 1)))
    assert sorted((row.stage, row.wid) for row in rows) == sorted(
        (name, taken[0]) for name, taken in ids.items()
    )
    if share is not None:
        assert set(share.window) == set(names)


@pytest.mark.parametrize("fair", [False, True], ids=["fifo", "fair"])
@pytest.mark.parametrize(
    ("synchronous", "capacities", "expected"),
    [
        (False, {"a": 4}, "off"),  # the default: a claim does not wait for its WAL flush
        (True, {"a": 4}, "on"),  # WORKER_SYNCHRONOUS_COMMIT = yes: claims wait, as outcomes do
        (False, {"a": 4, "amqp:%2F:q": 4}, "on"),  # an AMQP queue's delivery must stay marked
    ],
)
def test_a_claim_commits_asynchronously_unless_outcomes_or_amqp_wait(
    dsn: str, conn: Conn, fair: bool, synchronous: bool, capacities: dict[str, int], expected: str
) -> None:
    wid = insert(conn, "a", ["x"])[0]
    share = FairShare(60.0, 0, time.monotonic) if fair else None
    claimer = Claimer(share, synchronous=synchronous)

    async def claim(c: AConn) -> tuple[list[Claimed], str, str]:
        async with c.transaction(force_rollback=True):  # what the claim's commit would use
            rows = await claimer.run_once(c, capacities)
            inside = await (await c.execute("SHOW synchronous_commit")).fetchone()
        rows = await claimer.run_once(c, capacities)  # autocommit, as the dispatcher runs it
        after = await (await c.execute("SHOW synchronous_commit")).fetchone()
        assert inside is not None
        assert after is not None
        return rows, str(inside[0]), str(after[0])

    rows, inside, after = run(dsn, claim)
    assert [row.wid for row in rows] == [wid]
    assert (inside, after) == (expected, "on")  # for the claim's transaction only
    assert statuses(conn)[wid] == "running"


# ---- sweeper ----------------------------------------------------------------------------


def test_the_sweeper_resumes_due_rows_and_learns_when_the_next_is_due(dsn: str, conn: Conn) -> None:
    due = insert(conn, "s", ["x", "y"], "paused")
    later = insert(conn, "s", ["z"], "paused")
    conn.execute(
        "UPDATE pepsi.workqueue SET timeout = now() - interval '1s' WHERE workqueue_id = ANY(%s)",
        (due,),
    )
    conn.execute(
        "UPDATE pepsi.workqueue SET timeout = now() + interval '30s' WHERE workqueue_id = ANY(%s)",
        (later,),
    )
    clock = [100.0]
    stats = Stats()
    sweeper = Sweeper(SweepOptions(5.0, 60.0, 3600.0, ()), stats, lambda: clock[0])
    run(dsn, sweeper.run_once)
    now = statuses(conn)
    assert [now[i] for i in due] == ["pending", "pending"]
    assert now[later[0]] == "paused"
    assert sweeper.next_poll == 105.0
    assert sweeper.next_due is not None
    assert 125.0 < sweeper.next_due <= 130.0
    assert stats.delta.dispatch["paused_resumed"] == 2
    assert sweeper.next_housekeeping == 160.0


def test_nothing_is_swept_before_it_is_due(dsn: str, conn: Conn) -> None:
    due = insert(conn, "s", ["x"], "paused")
    conn.execute("UPDATE pepsi.workqueue SET timeout = now() - interval '1s'")
    sweeper = Sweeper(SweepOptions(5.0, 60.0, 3600.0, ()), Stats(), lambda: 100.0)
    sweeper.next_poll, sweeper.next_housekeeping = 101.0, 101.0
    run(dsn, sweeper.run_once)
    assert statuses(conn)[due[0]] == "paused"


# ---- stats flusher and row writer ---------------------------------------------------------


def test_one_flush_writes_the_deltas_and_an_empty_one_writes_nothing(dsn: str, conn: Conn) -> None:
    stats = Stats()
    flusher = StatsFlusher(stats, 60.0, datetime.now(UTC), time.monotonic)
    stats.stage("s", "processed", 3)
    stats.count("claims")
    run(dsn, flusher.run_once)
    run(dsn, flusher.run_once)  # nothing new: no statement, no row
    (processed,) = conn.execute("SELECT sum(processed) FROM pepsi.stage_stats").fetchone() or (0,)
    (claims,) = conn.execute("SELECT sum(claims) FROM pepsi.dispatch_stats").fetchone() or (0,)
    assert (processed, claims) == (3, 1)


def test_a_flush_counts_its_minute_for_the_chart_and_forgets_past_a_day(
    dsn: str, conn: Conn
) -> None:
    conn.execute(
        "INSERT INTO pepsi.stage_stats_minute VALUES"
        " (date_trunc('minute', now()) - interval '2 hours', 's', 7, 0),"
        " (date_trunc('minute', now()) - interval '25 hours', 's', 9, 9)"
    )
    stats = Stats()
    flusher = StatsFlusher(stats, 60.0, datetime.now(UTC), time.monotonic)
    for processed, failed in ((3, 1), (2, 0)):  # two flushes in (most likely) one minute
        stats.stage("s", "processed", processed)
        stats.stage("s", "failed", failed)
        stats.stage("quiet", "strikes", 1)  # nothing processed or failed: no minute row
        run(dsn, flusher.run_once)
    rows = conn.execute(
        "SELECT stage, processed, failed, now() - minute < interval '3 hours'"
        " FROM pepsi.stage_stats_minute ORDER BY minute"
    ).fetchall()
    assert rows[0] == ("s", 7, 0, True)  # two hours ago: kept; a day and more: gone
    assert sum(r[1] for r in rows[1:]) == 5
    assert sum(r[2] for r in rows[1:]) == 1
    assert {r[0] for r in rows} == {"s"}


def test_the_strike_limit_ends_a_message(dsn: str, conn: Conn) -> None:
    (wid,) = insert(conn, "s", ["x"], "running")
    rows = RowWriter(DispatchOptions(strike_delay=0.001))
    for _ in range(MAX_STRIKES):
        conn.execute(
            "UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = %s", (wid,)
        )
        rows.strike("s", wid, "crashed", "worker exited with status 3")
        run(dsn, lambda c: rows.flush(c, 0.0))
    row = conn.execute(
        "SELECT status::text, state->>'strikes', state->>'failure_class' FROM pepsi.workqueue"
    ).fetchone()
    assert row == ("failed", str(MAX_STRIKES), "crashed")


# ---- the whole loop, one cycle at a time -------------------------------------------------


def test_one_cycle_claims_starts_a_worker_and_the_next_settles_its_answers(
    dsn: str, conn: Conn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator in-process: its services over a real database and a real worker."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    conf = tmp_path / "pepsi.conf"
    conf.write_text("[stage-a]\nHANDLER = tests.stages:noop\n")
    ids = insert(conn, "a", ["x", "y", "z"])

    async def main() -> tuple[int, int, float]:
        dispatcher = Dispatcher(load_config(conf), dsn)
        await dispatcher.session.open()
        try:
            await dispatcher.session.start_checks(["a"])
            await dispatcher.cycle()
            (worker,) = dispatcher.supervisor.pools["a"].workers.values()
            held = len(worker.inflight)
            deadline = time.monotonic() + 30
            while worker.inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.02)  # the worker answers on its own
            await dispatcher.cycle()
            sleep = dispatcher.sleep_time()
            return held, dispatcher.ledger.answered_total, sleep
        finally:
            await dispatcher.supervisor.shutdown()
            await dispatcher.session.close()

    held, answered, sleep = asyncio.run(main())
    assert held == len(ids)
    assert answered == len(ids)
    assert statuses(conn) == {}  # noop with no NEXT: finished, deleted
    assert 0 < sleep <= DispatchOptions().poll_interval


def test_a_sub_second_strike_delay_is_logged_as_such(
    dsn: str, conn: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    (wid,) = insert(conn, "s", ["x"], "running")
    rows = RowWriter(DispatchOptions(strike_delay=0.5))
    rows.strike("s", wid, "crashed", "worker exited with status 3")
    with caplog.at_level("WARNING", logger="pepsi.dispatch"):
        run(dsn, lambda c: rows.flush(c, 0.0))
    assert "strike 1 (worker exited with status 3); retry in 500ms" in caplog.text


def test_a_database_turned_read_only_is_a_reconnect_not_a_bug(dsn: str, conn: Conn) -> None:
    """After a failover the old primary refuses writes (25006): reconnect, do not carry on."""
    name = conn.info.dbname

    async def main() -> tuple[BaseException, bool]:
        dispatcher = Dispatcher(Config(None), dsn)
        await dispatcher.session.open()
        try:
            try:
                await dispatcher.cycle()  # the sweeper's UPDATE is refused
            except psycopg.Error as exc:
                failure: BaseException = exc
            else:
                raise AssertionError("a read-only database accepted the sweep")
            conn.execute(sql.SQL("ALTER DATABASE {} RESET ALL").format(sql.Identifier(name)))
            restored = await dispatcher.session.reconnect(dispatcher._restore)
            await dispatcher.cycle()  # writable again: the same cycle goes through
            return failure, restored
        finally:
            await dispatcher.session.close()

    conn.execute(
        sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(
            sql.Identifier(name)
        )
    )
    failure, restored = asyncio.run(main())
    assert is_reconnect(failure)
    assert isinstance(classify(failure), DatabaseReadOnly)
    assert restored


def insert_full(conn: Conn, stage: str, n: int) -> list[int]:
    """Rows with every metadata column set (a body too), as a claim hands them to workers."""
    body = conn.execute(
        "INSERT INTO pepsi.workqueue_body (header, body) VALUES ('h', 'b') RETURNING body_id"
    ).fetchone()
    assert body is not None
    rows = conn.execute(
        "INSERT INTO pepsi.workqueue (stage, message_id, sender, recipients, origin_user,"
        " origin_peer, header_from, subject, content_type, correlation_id, properties, state,"
        " body_id)"
        " SELECT %s, '<m' || g || '@x>', 'a@example.org', ARRAY['b@example.net', 'C@x'],"
        " 'ann', '2001:db8::1', 'Ann <a@example.org>', 'héllo \"q\"' || chr(10) || 'x',"
        " 'text/plain', 'c-' || g, '{\"k\": [1, 2.5, null], \"é\": {\"t\": true}}',"
        ' \'{"strikes": 1, "last_error": "x\\\\ny"}\', %s'
        " FROM generate_series(1, %s) g ORDER BY g RETURNING workqueue_id",
        (stage, body[0], n),
    ).fetchall()
    return [int(r[0]) for r in rows]


@pytest.mark.parametrize("fair", [False, True], ids=["fifo", "fair"])
def test_a_small_claim_hands_the_rows_of_the_stages_that_take_them(
    dsn: str, conn: Conn, fair: bool
) -> None:
    """Each row as the worker's own load would read it once claimed, token included;
    only for `rows_for`'s stages."""

    takes = insert_full(conn, "takes", 3)
    plain = insert_full(conn, "plain", 2)
    share = FairShare(60.0, 0, time.monotonic) if fair else None
    rows = run(dsn, lambda c: Claimer(share).run_once(c, {"takes": 5, "plain": 5}, ["takes"]))
    assert sorted(row.wid for row in rows) == sorted(takes + plain)
    assert all(row.row is None for row in rows if row.stage == "plain")
    handed = {row.wid: row.row for row in rows if row.stage == "takes"}
    loader = MessageLoader(StageConfig(name="takes"), Needs.METADATA)
    with psycopg.connect(dsn, autocommit=True) as worker:
        loaded = loader.load(worker, takes)  # the worker's own load, as before
        assert set(loaded) == set(takes)
        for wid in takes:
            row = handed[wid]
            assert row is not None
            msg = loader.from_claim(worker, wid, row)
            assert msg is not None
            assert vars(msg) | {"_loader": None} == vars(loaded[wid]) | {"_loader": None}
            assert msg._token is not None
            assert msg._loader is not None  # the body, on first access, as loaded
            assert msg.body == b"b"


@pytest.mark.parametrize("fair", [False, True], ids=["fifo", "fair"])
def test_a_large_claim_hands_ids_only(dsn: str, conn: Conn, fair: bool) -> None:
    """A backlog's claim returns no row: the workers load theirs, side by side."""
    ids = insert_full(conn, "s", ROWS_MAX + 1)
    share = FairShare(60.0, 0, time.monotonic) if fair else None
    rows = run(dsn, lambda c: Claimer(share).run_once(c, {"s": 100}, ["s"]))
    assert sorted(row.wid for row in rows) == ids
    assert all(row.row is None for row in rows)


@pytest.mark.parametrize("fair", [False, True], ids=["fifo", "fair"])
def test_a_claim_names_the_stages_it_left_without_a_pending_row(
    dsn: str, conn: Conn, fair: bool
) -> None:
    """After the claim, a probe: `a` and the AMQP queue emptied, `b` has rows left, `c`
    had none to take (the known-empty rule for an empty claim covers it)."""
    insert(conn, "a", ["x", "y"])
    insert(conn, "b", ["x"] * 5)
    insert(conn, "amqp:%2F:q", ["x"])
    share = FairShare(60.0, 0, time.monotonic) if fair else None
    claimer = Claimer(share)
    capacities = {"a": 5, "b": 2, "c": 5, "amqp:%2F:q": 5}
    rows = run(dsn, lambda c: claimer.run_once(c, capacities))
    assert sorted(row.stage for row in rows) == ["a", "a", "amqp:%2F:q", "b", "b"]
    assert claimer.drained == {"a", "amqp:%2F:q"}
    assert run(dsn, lambda c: claimer.run_once(c, {"b": 10})) != []
    assert claimer.drained == {"b"}
    assert run(dsn, lambda c: claimer.run_once(c, {"b": 10})) == []
    assert claimer.drained == set()


def claims_after_news_of_a_drained_stage(
    dsn: str, conf: Path, news: Callable[[Dispatcher], int]
) -> tuple[bool, int, int]:
    """A dispatcher serving stage `a` claims its pending rows (the stage is then drained),
    its worker answers, and a cycle settles that; then `news(dispatcher)` makes a row
    pending by the way under test (its id) and one more cycle runs, by hand (nothing
    woke it). Whether the first claim left `a` known empty, the claim statements the
    last cycle ran, and the row's id."""

    async def main() -> tuple[bool, int, int]:
        dispatcher = Dispatcher(load_config(conf), dsn)
        await dispatcher.session.open()
        try:
            await dispatcher.session.start_checks(["a"])
            await dispatcher.cycle()  # claims every pending row: the stage is drained
            drained = dispatcher.known.pending("a") == 0
            (worker,) = dispatcher.supervisor.pools["a"].workers.values()
            deadline = time.monotonic() + 30
            while worker.inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.02)  # the worker answers on its own
            assert not worker.inflight, "the worker did not answer within 30 s"
            await dispatcher.cycle()  # its answers settled: nothing to claim
            wid = news(dispatcher)
            before = dispatcher.claimer.statements
            await dispatcher.cycle()
            return drained, dispatcher.claimer.statements - before, wid
        finally:
            await dispatcher.supervisor.shutdown()
            await dispatcher.session.close()

    return asyncio.run(main())


def test_a_row_put_back_to_pending_is_claimed_though_its_stage_was_drained(
    dsn: str, conn: Conn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim that takes a stage's last rows marks it empty until news; rows the
    dispatcher itself puts back to pending (a worker gone before running them) are
    news for their stage, or they would wait for the poll tick."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    conf = tmp_path / "pepsi.conf"
    conf.write_text("[stage-a]\nHANDLER = tests.stages:noop\n")
    insert(conn, "a", ["x", "y"])

    def requeued(dispatcher: Dispatcher) -> int:
        (wid,) = insert(conn, "a", ["z"], "running")
        dispatcher.ledger.requeue("a", [wid])  # as for a worker gone before running it
        return wid

    drained, claims, wid = claims_after_news_of_a_drained_stage(dsn, conf, requeued)
    assert drained
    assert claims == 1  # the requeue was news for `a`
    assert statuses(conn).get(wid) != "pending"  # claimed again (and perhaps run)


def test_a_paused_row_that_falls_due_is_claimed_though_its_stage_was_drained(
    dsn: str, conn: Conn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweeper's resuming of a due row is news for the claim in the same cycle,
    whatever woke the loop, or the row would wait for the next poll tick behind a
    stage marked empty."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    conf = tmp_path / "pepsi.conf"
    conf.write_text("[stage-a]\nHANDLER = tests.stages:noop\n")
    insert(conn, "a", ["x"])

    def fell_due(dispatcher: Dispatcher) -> int:
        (wid,) = insert(conn, "a", ["z"], "paused")
        conn.execute(
            "UPDATE pepsi.workqueue SET timeout = now() - interval '1 second'"
            " WHERE workqueue_id = %s",
            (wid,),
        )
        dispatcher.sweeper.due_in(0)  # as a worker's pause outcome tells it
        return wid

    drained, claims, wid = claims_after_news_of_a_drained_stage(dsn, conf, fell_due)
    assert drained
    assert claims == 1  # resumed, and claimed in the same cycle
    assert statuses(conn).get(wid) not in ("paused", "pending")


def test_a_row_no_notify_announced_is_claimed_at_the_poll_though_its_stage_was_drained(
    dsn: str, conn: Conn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row made pending without a NOTIFY (by hand, say) waits behind a stage known
    empty only for the sweeper's next poll: the poll is news for every stage, whatever
    woke the loop (a busy loop may never wake for a deadline alone)."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    conf = tmp_path / "pepsi.conf"
    conf.write_text("[stage-a]\nHANDLER = tests.stages:noop\n")
    insert(conn, "a", ["x"])

    def by_hand(dispatcher: Dispatcher) -> int:
        (wid,) = insert(conn, "a", ["z"])  # an INSERT of its own: no NOTIFY
        dispatcher.sweeper.next_poll = 0.0  # the poll is due
        return wid

    drained, claims, wid = claims_after_news_of_a_drained_stage(dsn, conf, by_hand)
    assert drained
    assert claims == 1
    assert statuses(conn).get(wid) != "pending"
