"""P-9: counters written by the dispatcher, exact after a run, nothing when idle."""

from __future__ import annotations

import time
from typing import Any

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

    # An idle dispatcher does no database work: none of its connections starts
    # a statement during a window shorter than its POLL_INTERVAL. (Counting
    # the database's commits would also count autovacuum's.)
    dbname = str(conninfo.conninfo_to_dict(pipeline.dsn)["dbname"])
    wait_until(lambda: pipeline.workers() == 0, what="the idle workers to stop")
    pipeline.db.close()

    def last_statement(admin: psycopg.Connection[tuple[object, ...]]) -> Any:
        return admin.execute(
            "SELECT max(query_start), count(*) FROM pg_stat_activity"
            " WHERE datname = %s AND application_name LIKE 'pepsi-%%'",
            (dbname,),
        ).fetchone()

    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        time.sleep(1.5)  # the follow-up of the last worker's exit
        before = last_statement(admin)
        time.sleep(3)  # idle: the window being measured, not a wait for something
        after = last_statement(admin)
    pipeline.db = psycopg.connect(pipeline.dsn, autocommit=True)
    assert dispatcher.stop() == 0
    assert before[1] >= 2  # its claim and listener connections are there
    assert after == before
