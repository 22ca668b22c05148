"""P-9: counters written by the dispatcher, exact after a run, nothing when idle."""

from __future__ import annotations

import time
from typing import Any

import psycopg
from psycopg import conninfo

from tests.scenarios.conftest import Dispatcher, Pipeline, wait_until

STAGE_COLUMNS = (
    "processed", "failed", "strikes", "requeued", "busy_us",
    "finished", "advanced", "paused", "retries", "timed_out",
)  # fmt: skip


def stage_stats(pipeline: Pipeline) -> dict[str, dict[str, int]]:
    rows = pipeline.db.execute(
        f"SELECT stage, {', '.join(STAGE_COLUMNS)} FROM pepsi.stage_stats"
    ).fetchall()
    return {str(r[0]): dict(zip(STAGE_COLUMNS, map(int, r[1:]), strict=True)) for r in rows}


def dispatch_stats(pipeline: Pipeline) -> dict[str, int]:
    cur = pipeline.db.execute("SELECT * FROM pepsi.dispatch_stats")
    row = cur.fetchone()
    names = [c.name for c in cur.description or ()]
    return {} if row is None else {k: v for k, v in zip(names, row, strict=True) if type(v) is int}


def status(pipeline: Pipeline, wid: int) -> str | None:
    row = pipeline.row(wid)
    return None if row is None else row[1]


def test_counters_match_the_events(pipeline: Pipeline, admin_dsn: str) -> None:
    pipeline.configure(
        "[stage-a]\nHANDLER = tests.stages:faulty_serial\nNEXT = b\n"
        "RETRY_DELAY = 200ms\nMAX_RUNTIME = 1s\n"
        "[stage-b]\nHANDLER = tests.stages:noop\n",
        POLL_INTERVAL="30s",
    )
    pipeline.publish("a", count=20)
    pipeline.publish("a", properties={"fault": "permanent"})
    pipeline.publish("a", properties={"fault": "crash"})
    pipeline.publish("a", properties={"fault": "hang"})
    pipeline.publish("a", properties={"fault": "host", "times": 2})
    dispatcher = pipeline.start()
    wait_until(pipeline.settled, timeout=90, what="the run to settle")
    # the idle flush writes the counters without waiting for STATS_INTERVAL (60 s)
    wait_until(
        lambda: (
            stage_stats(pipeline).get("b", {}).get("finished") == 21
            and stage_stats(pipeline).get("a", {}).get("strikes") == 6
        ),
        what="the idle flush",
    )
    a, b = stage_stats(pipeline)["a"], stage_stats(pipeline)["b"]
    # 20 plain + the flaky one's two retries and its success; the permanent failure
    assert (a["processed"], a["failed"], a["advanced"], a["retries"]) == (23, 1, 21, 2)
    # three strikes each for the poison message and the hanging one
    assert (a["strikes"], a["timed_out"], a["finished"], a["paused"]) == (6, 3, 0, 0)
    assert a["busy_us"] > 0  # worker time, from the status-line reports
    assert (b["processed"], b["finished"], b["failed"], b["strikes"]) == (21, 21, 0, 0)
    d = dispatch_stats(pipeline)
    assert d["stages_executed"] == 45  # 24 passes at a (the struck never answer), 21 at b
    assert d["claimed"] >= 51  # each row once per stage, the struck ones three times
    # a worker per strike, and one per death with several ids in flight (no strike:
    # each then runs alone to find the culprit)
    assert d["workers_crashed"] >= 6
    assert d["workers_started"] >= 8  # the first of each stage and one per strike
    assert d["wakeups_worker"] > 0  # status lines read together wake the loop once
    assert d["wakeups_notify"] >= 1  # the listener's (re)connection
    assert d["paused_resumed"] == 6  # 2 + 2 strikes (the third ends it) and 2 retries

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
        # the follow-up of the last worker's exit (its answer's flush, a live snapshot of
        # the gauges) ends within a second or two: wait until 2 s pass without a statement
        seen = [last_statement(admin), time.monotonic()]

        def quiet() -> bool:
            now = last_statement(admin)
            if now != seen[0]:
                seen[:] = [now, time.monotonic()]
            return time.monotonic() - seen[1] >= 2.0

        wait_until(quiet, timeout=20, what="the last worker's follow-up to end")
        before = last_statement(admin)
        time.sleep(3)  # idle: the window being measured, not a wait for something
        after = last_statement(admin)
    pipeline.db = psycopg.connect(pipeline.dsn, autocommit=True)
    assert dispatcher.stop() == 0
    assert before[1] >= 2  # its claim and listener connections are there
    assert after == before


def run_five_while_one_is_held(pipeline: Pipeline, stats_interval: str) -> tuple[int, Dispatcher]:
    """A hanging message keeps the pipeline busy (never idle) while stage b runs five."""
    pipeline.configure(
        "[stage-hold]\nHANDLER = tests.stages:faulty_serial\nMAX_RUNTIME = 10m\n"
        "[stage-b]\nHANDLER = tests.stages:noop\n",
        STATS_INTERVAL=stats_interval,
    )
    (held,) = pipeline.publish("hold", properties={"fault": "hang"})
    dispatcher = pipeline.start()
    wait_until(lambda: status(pipeline, held) == "running", what="the hang to be held")
    pipeline.publish("b", count=5)
    return held, dispatcher


def test_flush_waits_for_the_interval_while_busy_and_happens_at_shutdown(
    pipeline: Pipeline,
) -> None:
    """A busy pipeline is not idle: counters wait for STATS_INTERVAL or shutdown."""
    held, dispatcher = run_five_while_one_is_held(pipeline, "10m")
    wait_until(
        lambda: pipeline.scalar("SELECT count(*) FROM pepsi.workqueue WHERE stage = 'b'") == 0,
        what="b to finish",
    )
    # Neither trigger can have fired: a message is in flight, so the pipeline
    # never went idle, and the interval is ten minutes away.
    assert status(pipeline, held) == "running"
    assert stage_stats(pipeline) == {}
    assert dispatcher.stop() == 0  # SIGTERM: the shutdown flush
    assert stage_stats(pipeline)["b"]["finished"] == 5
    d = dispatch_stats(pipeline)
    assert d["stages_executed"] == 5
    assert d["workers_retired"] >= 2  # both workers were stopped on purpose


def test_flush_every_interval_while_busy(pipeline: Pipeline) -> None:
    held, dispatcher = run_five_while_one_is_held(pipeline, "1s")
    wait_until(
        lambda: stage_stats(pipeline).get("b", {}).get("finished") == 5,
        what="the interval flush",
    )
    assert status(pipeline, held) == "running"  # still busy: not the idle flush
    assert dispatcher.stop() == 0
