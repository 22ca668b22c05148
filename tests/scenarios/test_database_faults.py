"""The database goes away (W-4, W-5): a restart mid-run, connections exhausted."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo

from pepsi.db import schema
from pepsi.db.embedded import EmbeddedServer
from tests.scenarios.conftest import Pipeline, wait_until

SLOW = (
    "[stage-work]\nHANDLER = tests.stages:faulty_serial\nPARALLELISM = 2\nQUEUE_LIMIT = 2\n"
    "RETRY_DELAY = 300ms\n"
)


@pytest.fixture
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    """A server of this test's own, so that stopping it disturbs no other test."""
    server = EmbeddedServer(tmp_path_factory.mktemp("own") / "data")
    server.start()
    yield server
    server.stop()


def test_postgresql_restart_mid_run_loses_nothing(
    own_server: EmbeddedServer, tmp_path: Path
) -> None:
    dsn = own_server.uri()
    assert dsn is not None
    with psycopg.connect(dsn, autocommit=True) as conn:
        schema.install(conn)
    pipeline = Pipeline(dsn, tmp_path)
    try:
        # the manual's 74 pause (this harness shortens it): the messages whose workers lost
        # the database go on once the dispatcher has it again, not 30 s later
        pipeline.configure(SLOW, DB_ERROR_PAUSE="30s")
        ids = pipeline.publish("work", count=80, properties={"fault": "slow", "sleep": 0.03})
        dispatcher = pipeline.start()
        wait_until(
            lambda: pipeline.scalar("SELECT count(*) FROM test_effects") >= 10, what="progress"
        )
        pipeline.db.close()
        own_server.stop()
        time.sleep(2)  # the database stays away for a while (the fault, not a wait)
        own_server.start()
        back = time.monotonic()
        pipeline.db = psycopg.connect(dsn, autocommit=True)
        wait_until(pipeline.settled, timeout=90, what="the pipeline to resume by itself")
        resumed_after = time.monotonic() - back
        assert dispatcher.stop() == 0
        assert pipeline.remaining() == 0
        assert set(pipeline.effects()) == {(i, "work") for i in ids}  # nothing lost
        log = dispatcher.log
        assert "database connection lost" in log
        assert "database connection restored" in log
        assert "Traceback" not in log
        if "paused 30s (database connection lost)" in log or "go on now" in log:
            print(f"drained {resumed_after:.1f}s after the server was back")
            assert resumed_after < 20.0  # measured 2-4 s (the rest of the 80); was 30 s +
    finally:
        pipeline.close()


def test_connections_exhausted_halve_the_pool_then_recover(pipeline: Pipeline, dsn: str) -> None:
    role = "pepsi_limited"
    db = pipeline.db
    dbname = str(conninfo.conninfo_to_dict(dsn)["dbname"])
    db.execute(
        f"DO $$ BEGIN CREATE ROLE {role} LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$"
    )
    db.execute(f"ALTER ROLE {role} PASSWORD 'limited'")  # the embedded server takes SCRAM only
    for grant in (
        f"GRANT ALL ON SCHEMA pepsi TO {role}",
        f"GRANT ALL ON ALL TABLES IN SCHEMA pepsi TO {role}",
        f"GRANT ALL ON ALL SEQUENCES IN SCHEMA pepsi TO {role}",
        f"GRANT ALL ON test_effects TO {role}",
    ):
        db.execute(grant)
    pipeline.extra_env["PEPSI_DSN"] = conninfo.make_conninfo(dsn, user=role, password="limited")
    pipeline.configure(SLOW.replace("PARALLELISM = 2", "PARALLELISM = 3"))
    ids = pipeline.publish("work", count=90, properties={"fault": "slow", "sleep": 0.05})
    dispatcher = pipeline.start()
    wait_until(lambda: pipeline.workers("work") == 3, what="three workers")
    # No new connection for the limited role: the workers' connections are cut
    # and their reconnects refused (53300), so they answer 75.
    count = pipeline.scalar("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", dbname)
    db.execute(f'ALTER DATABASE "{dbname}" CONNECTION LIMIT {int(count) - 3}')
    db.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = 'pepsi-worker:work'"
    )
    wait_until(lambda: "out of database connections (75)" in dispatcher.log, what="a 75")
    db.execute(f'ALTER DATABASE "{dbname}" CONNECTION LIMIT -1')
    wait_until(pipeline.settled, timeout=90, what="recovery")
    assert dispatcher.stop() == 0
    log = dispatcher.log
    assert "limited to 1 workers" in log or "limited to 2 workers" in log
    assert set(pipeline.effects()) == {(i, "work") for i in ids}
    assert pipeline.by_status() == {}
    assert "Traceback" not in log
