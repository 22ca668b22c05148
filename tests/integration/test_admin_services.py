"""`pepsi.admin` services in-process: the bouncer, top's reads, the database status."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pepsi.admin.bouncer import Bouncer, BouncerSettings
from pepsi.admin.database import NotEmbedded, database_status, embedded_server
from pepsi.admin.watch import activity
from pepsi.config import Config, load_config
from pepsi.db.schema import SchemaState
from pepsi.errors import DatabaseUnavailable, SchemaMismatch
from tests.conftest import TEMPLATE, with_dbname
from tests.scenarios.conftest import wait_until

Conn = psycopg.Connection[Any]
NOWHERE = "postgresql://127.0.0.1:1/nowhere?connect_timeout=1"
CONF = (
    "[stage-a]\nHANDLER = tests.stages:noop\n"
    "[stage-guarded]\nHANDLER = tests.stages:noop\nBOUNCE_STAGE = a\n"
    "[stage-dlq]\nHANDLER = tests.stages:noop\n"
)


def config(tmp_path: Path, extra: str = "") -> Config:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF + extra)
    return load_config(path)


def fail(conn: Conn, stage: str, n: int = 1) -> None:
    conn.execute(
        "INSERT INTO pepsi.workqueue (stage, status, state)"
        " SELECT %s, 'failed', '{\"failure_class\": \"permanent\"}' FROM generate_series(1, %s)",
        (stage, n),
    )


def test_bouncer_settings_from_the_config(tmp_path: Path) -> None:
    to_table = BouncerSettings.from_config(config(tmp_path))
    assert (to_table.stages, to_table.sink, to_table.where) == (
        ("a", "dlq"), None, "table pepsi.dead_letter",
    )  # fmt: skip
    to_stage = BouncerSettings.from_config(
        config(tmp_path, "[pepsi-failure-bouncer]\nSINK = dlq\nINTERVAL = 5s\n")
    )
    # a stage with a BOUNCE_STAGE bounces its own failures; the sink does not feed itself
    assert (to_stage.stages, to_stage.where, to_stage.interval) == (("a",), "stage dlq", 5.0)


def test_bouncer_passes(
    conn: Conn, dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = BouncerSettings(("a",), "dlq", interval=30.0, batch=2)
    bouncer = Bouncer(settings, dsn, connect_timeout=5)
    bouncer.check()
    fail(conn, "a", 5)  # three batches of two
    fail(conn, "guarded")
    with caplog.at_level(logging.WARNING, logger="pepsi.failure-bouncer"):
        assert bouncer.run_once() == 5
        assert bouncer.run_once() == 0
    assert [r.getMessage() for r in caplog.records] == ["moved 5 failed messages to stage dlq"]
    counts = conn.execute(
        "SELECT stage, status::text, count(*) FROM pepsi.workqueue GROUP BY 1, 2 ORDER BY 1"
    ).fetchall()
    assert counts == [("dlq", "pending", 5), ("guarded", "failed", 1)]
    # the loop: one pass, then it waits for the interval or the stop
    fail(conn, "a")
    stop = threading.Event()
    stop.set()
    Bouncer(BouncerSettings(("a",), None, 30.0), dsn, connect_timeout=5).run(stop)
    assert conn.execute("SELECT count(*) FROM pepsi.dead_letter").fetchone() == (1,)


def test_bouncer_rides_out_an_outage(empty_dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(SchemaMismatch):
        Bouncer(BouncerSettings(("a",), None, 30.0), empty_dsn, connect_timeout=5).check()
    down = Bouncer(BouncerSettings(("a",), None, 30.0), NOWHERE, connect_timeout=1)
    with pytest.raises(DatabaseUnavailable, match="cannot connect to the database"):
        down.run_once()
    stop = threading.Event()
    stop.set()
    with caplog.at_level(logging.WARNING, logger="pepsi.failure-bouncer"):
        down.run(stop, rng=lambda: 0.0)  # logs, does not raise
    (record,) = caplog.records
    assert record.getMessage().startswith("database unavailable (cannot connect")
    # not INTERVAL (30s): the reconnect backoff's first delay, 0.1 s less its jitter
    assert record.getMessage().endswith("; retrying in 50ms")


def test_bouncer_retries_on_the_backoff_until_the_database_is_back(
    admin_dsn: str, template_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A database that is away (not created yet) is retried within RECONNECT_MAX_DELAY."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    bouncer = Bouncer(
        BouncerSettings(("a",), None, 30.0, reconnect_max=0.5),
        with_dbname(admin_dsn, name),
        connect_timeout=5,
    )
    stop = threading.Event()
    thread = threading.Thread(target=bouncer.run, args=(stop,))

    def messages() -> list[str]:
        return [r.getMessage() for r in caplog.records]

    with caplog.at_level(logging.INFO, logger="pepsi.failure-bouncer"):
        thread.start()
        try:
            # with a 30 s INTERVAL, three failed passes in 5 s can only be the backoff
            wait_until(
                lambda: sum(m.startswith("database unavailable") for m in messages()) >= 3,
                timeout=5,
                what="three quick retries",
            )
            with psycopg.connect(admin_dsn, autocommit=True) as admin:
                admin.execute(
                    sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                        sql.Identifier(name), sql.Identifier(TEMPLATE)
                    )
                )
            back = time.monotonic()
            wait_until(
                lambda: "database connection restored" in messages(), timeout=5, what="a pass"
            )
            assert time.monotonic() - back < 4.0  # the cap (0.5 s) and a pass, not INTERVAL
            waits = [m.rsplit("retrying in ", 1)[1] for m in messages() if "retrying in" in m]
            assert all(w.endswith("ms") and int(w[:-2]) <= 500 for w in waits), waits
        finally:
            stop.set()
            thread.join(timeout=10)
            with psycopg.connect(admin_dsn, autocommit=True) as admin:
                admin.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )
    assert not thread.is_alive()


def test_top_reads_frames(conn: Conn, dsn: str) -> None:
    fail(conn, "a", 2)
    conn.execute("INSERT INTO pepsi.workqueue (stage) VALUES ('b'), ('b'), ('b')")
    conn.execute("INSERT INTO pepsi.stage_stats (stage, processed, strikes) VALUES ('a', 9, 2)")
    with psycopg.connect(dsn, autocommit=True, application_name="pepsi-worker:b"):
        reader = activity.TopReader(conn, ["a"], interval=1.0, stats_interval=60.0)
        first = reader.refresh()
    assert [(r.stage, r.backlog, r.failed, r.workers, r.strikes) for r in first.stages] == [
        ("a", 0, 2, 0, 2), ("b", 3, 0, 1, 0),
    ]  # fmt: skip
    assert first.dispatcher_pid is None
    assert reader.counted is not None  # kept for the next refresh
    frames = list(activity.frames(conn, ["a"], 0.01, 3, 60.0))
    assert len(frames) == 3
    conn.close()
    with pytest.raises(DatabaseUnavailable, match="reading the queue failed"):
        reader.refresh()


def test_database_status(
    dsn: str, empty_dsn: str, isolated_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        fail(conn, "a")
    monkeypatch.setenv("PEPSI_DSN", dsn)
    found = database_status(load_config())
    assert (found.source, found.running) == ("$PEPSI_DSN", True)
    assert found.server_version is not None
    assert found.schema is not None
    assert found.schema.state is SchemaState.CURRENT
    assert found.queue == {"a": {"failed": 1}}
    with pytest.raises(NotEmbedded, match=r"cannot stop the embedded server.*\(\$PEPSI_DSN\)"):
        embedded_server(load_config(), "stop")
    monkeypatch.setenv("PEPSI_DSN", empty_dsn)
    found = database_status(load_config())
    assert found.schema is not None
    assert (found.schema.state, found.queue) == (SchemaState.MISSING, None)
    monkeypatch.delenv("PEPSI_DSN")
    stopped = database_status(load_config())  # the embedded server is not started for this
    assert stopped.running is False
    assert stopped.source.endswith("(stopped)")


def test_top_reads_the_oldest_transaction(conn: Conn, dsn: str) -> None:
    """Issue 13, defect 5: the reader names who holds back vacuum, and for how long."""
    reader = activity.TopReader(conn, ["a"], interval=1.0, stats_interval=60.0)
    assert reader.refresh().horizon is None
    with psycopg.connect(dsn, application_name="report") as idle:  # not autocommit: BEGIN
        idle.execute("SELECT txid_current()")
        pid = idle.info.backend_pid
        held = reader.refresh().horizon
        idle.rollback()
    assert held is not None
    assert (held.kind, held.pid, held.application) == ("session", pid, "report")
    assert held.state == "idle in transaction"
    assert held.age_s >= 0
    assert reader.refresh().horizon is None
