"""P-9: counters written by the dispatcher, exact after a run, nothing when idle."""

from __future__ import annotations

import time

import psycopg
from psycopg import conninfo

from tests.scenarios.conftest import Pipeline, wait_until


def stage_stats(pipeline: Pipeline) -> dict[str, tuple[int, ...]]:
    rows = pipeline.db.execute(
        "SELECT stage, processed, failed, strikes, busy_us FROM pepsi.stage_stats"
    ).fetchall()
    return {str(r[0]): tuple(int(x) for x in r[1:]) for r in rows}


def test_counters_match_the_events(pipeline: Pipeline, admin_dsn: str) -> None:
    pipeline.configure(
        "[stage-a]\nHANDLER = tests.stages:faulty_serial\nNEXT = b\n"
        "[stage-b]\nHANDLER = tests.stages:noop\n",
        POLL_INTERVAL="30s",
    )
    pipeline.publish("a", count=20)
    pipeline.publish("a", properties={"fault": "permanent"})
    pipeline.publish("a", properties={"fault": "crash"})
    dispatcher = pipeline.start()
    wait_until(pipeline.settled, timeout=60, what="the run to settle")
    # the idle flush writes the counters without waiting for STATS_INTERVAL (60 s)
    wait_until(
        lambda: (
            stage_stats(pipeline).get("b", (0,))[0] == 20
            and stage_stats(pipeline).get("a", (0, 0, 0))[2] == 3
        ),
        what="the idle flush",
    )
    stats = stage_stats(pipeline)
    assert stats["a"][:3] == (20, 1, 3)  # processed, failed (permanent), strikes (poison)
    assert stats["b"][:3] == (20, 0, 0)
    assert stats["a"][3] > 0  # worker time, from the status-line reports
    claimed, executed = pipeline.db.execute(
        "SELECT claimed, stages_executed FROM pepsi.dispatch_stats"
    ).fetchone() or (0, 0)
    assert executed == 41  # 21 passes at a (poison never answers), 20 at b
    assert claimed >= 44  # each row claimed once per stage, the poison three times

    # An idle dispatcher does no database work: no transaction in a window
    # shorter than its POLL_INTERVAL, counted from another database.
    dbname = str(conninfo.conninfo_to_dict(pipeline.dsn)["dbname"])
    # idle means its workers have stopped too (WORKER_IDLE_TIMEOUT), and their
    # exits have been handled
    wait_until(lambda: pipeline.workers() == 0, what="the idle workers to stop")
    pipeline.db.close()

    def commits(admin: psycopg.Connection[tuple[object, ...]]) -> int:
        admin.execute("SELECT pg_stat_clear_snapshot()")
        row = admin.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (dbname,)
        ).fetchone()
        return int(str(row[0])) if row else 0

    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        time.sleep(2.5)  # the last exits' follow-up, and the backends' stats reports
        before = commits(admin)
        time.sleep(3)  # idle: the window being measured, not a wait for something
        after = commits(admin)
    pipeline.db = psycopg.connect(pipeline.dsn, autocommit=True)
    assert dispatcher.stop() == 0
    assert after == before
