"""The oldest transaction holding back vacuum, read from a real server (issue 13, defect 5).

Each test holds a real `idle in transaction` session in its own database and
reads who holds the horizon: the read, the metrics endpoint's probe and the
endpoint itself. `pepsi queue status` and `pepsi top` are in their own files.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pepsi.admin.horizon import Holder, Probe, read_oldest
from pepsi.db import schema
from pepsi.db.embedded import EmbeddedServer
from pepsi.dispatch.services.metrics import Gauges, MetricsServer, Snapshot
from pepsi.dispatch.stats import Counts
from pepsi.errors import DatabaseUnavailable

NOWHERE = "postgresql://127.0.0.1:1/nowhere?connect_timeout=1"


@contextmanager
def idle_in_transaction(
    dsn: str, *, application: str = "psql", statement: str = "SELECT txid_current()"
) -> Iterator[int]:
    """A session left idle inside a transaction, as a forgotten psql would be; its pid."""
    with psycopg.connect(dsn, application_name=application) as conn:  # not autocommit
        conn.execute(statement)  # BEGIN is implicit
        yield conn.info.backend_pid
        conn.rollback()


def held_for(conn: psycopg.Connection[Any], seconds: float) -> Holder:
    """Wait (with a deadline) until the oldest holder has held the horizon `seconds`."""
    deadline = time.monotonic() + 10
    while True:
        holder = read_oldest(conn)
        if holder is not None and holder.age_s > seconds:
            return holder
        assert time.monotonic() < deadline, f"no holder older than {seconds}s: {holder}"
        time.sleep(0.01)


def test_an_idle_transaction_is_found_with_its_holder(conn: Any, dsn: str) -> None:
    assert read_oldest(conn) is None  # only this (autocommit) session: nothing held
    with idle_in_transaction(dsn, application="psql") as pid:
        holder = held_for(conn, 0.05)
    assert holder.kind == "session"
    assert holder.pid == pid
    assert holder.application == "psql"
    assert holder.state == "idle in transaction"
    assert holder.user == conn.execute("SELECT current_user").fetchone()[0]
    assert holder.client  # "local" over a Unix socket, else host:port
    assert read_oldest(conn) is None  # released: nothing held any more


def test_a_snapshot_holds_it_and_a_bare_transaction_does_not(conn: Any, dsn: str) -> None:
    # Read committed, no write: no transaction id and no snapshot between statements.
    with idle_in_transaction(dsn, statement="SELECT 1"):
        assert read_oldest(conn) is None
    # Repeatable read keeps its snapshot (backend_xmin) for the whole transaction.
    with psycopg.connect(dsn, application_name="report") as other:
        other.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        other.execute("SELECT count(*) FROM pepsi.workqueue")
        holder = held_for(conn, 0.0)
        assert (holder.pid, holder.application) == (other.info.backend_pid, "report")


def test_the_oldest_of_two_is_reported(conn: Any, dsn: str) -> None:
    with idle_in_transaction(dsn, application="first") as first:
        held_for(conn, 0.05)  # so the second one is strictly younger
        with idle_in_transaction(dsn, application="second"):
            holder = read_oldest(conn)
            assert holder is not None
            assert (holder.pid, holder.application) == (first, "first")


@pytest.fixture(scope="module")
def prepared_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server of its own that allows prepared transactions (Pepsi's has none)."""
    server = EmbeddedServer(tmp_path_factory.mktemp("pp") / "data")
    with psycopg.connect(server.start(), autocommit=True) as admin:
        admin.execute("ALTER SYSTEM SET max_prepared_transactions = 2")  # read at start
    server.stop()
    dsn = server.start()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            schema.install(conn)
        yield dsn
    finally:
        server.stop()


def test_a_prepared_transaction_is_found(prepared_dsn: str) -> None:
    dsn = prepared_dsn
    conn = psycopg.connect(dsn, autocommit=True)
    with psycopg.connect(dsn) as other:
        other.execute("SELECT txid_current()")
        other.execute("PREPARE TRANSACTION 'forgotten'")
    try:
        holder = held_for(conn, 0.0)
        assert (holder.kind, holder.gid, holder.pid) == ("prepared", "forgotten", None)
    finally:
        conn.execute("ROLLBACK PREPARED 'forgotten'")
        conn.close()


def test_the_probe_reads_on_its_own_connection(conn: Any, dsn: str) -> None:
    probe = Probe(dsn, timeout=5, cache_for=0)
    try:
        assert probe() is None  # the probe's own session is not a holder
        with idle_in_transaction(dsn) as pid:
            held_for(conn, 0.0)
            holder = probe()
            assert holder is not None
            assert holder.pid == pid
    finally:
        probe.close()
    with pytest.raises(DatabaseUnavailable, match="cannot connect"):
        Probe(NOWHERE, timeout=1)()


def test_a_flood_of_scrapes_reads_once_on_one_session(conn: Any, dsn: str) -> None:
    """Issue 34, finding 12: each scrape opened a PostgreSQL session. Now one session,
    kept, and one reading every cache_for seconds however many scrapes come."""
    now = [100.0]
    probe = Probe(dsn, timeout=5, cache_for=5.0, clock=lambda: now[0])
    try:
        with idle_in_transaction(dsn) as pid:
            held_for(conn, 0.0)
            first = probe()
            assert first is not None
            assert first.pid == pid
        for _ in range(50):  # within cache_for: the same reading, no statement
            assert probe() == first
        sessions = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pepsi-metrics'"
        ).fetchone()
        assert sessions == (1,)
        now[0] += 5.0
        assert probe() is None  # read again: the holder has gone
    finally:
        probe.close()


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:  # our own endpoint
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


def test_the_metrics_endpoint_shows_the_age_and_the_pid(conn: Any, dsn: str) -> None:
    """The gauge is read on the scrape thread, on the probe's connection, not the loop's."""

    async def serve_and_scrape(probe: Probe) -> list[dict[str, float]]:
        server = MetricsServer(
            ("127.0.0.1", 0), lambda: Snapshot(Counts(), Gauges()), ["a"], horizon=probe
        )
        try:
            with idle_in_transaction(dsn) as pid:
                held_for(conn, 0.05)
                during = await asyncio.to_thread(scrape, server.url)
                during["pid"] = pid
            after = await asyncio.to_thread(scrape, server.url)
        finally:
            server.close()
        return [during, after]

    during, after = asyncio.run(serve_and_scrape(Probe(dsn, timeout=5, cache_for=0)))
    assert during["pepsi_oldest_transaction_age_seconds"] > 0.05
    assert during["pepsi_oldest_transaction_pid"] == during["pid"]
    assert after["pepsi_oldest_transaction_age_seconds"] == 0
    assert after["pepsi_oldest_transaction_pid"] == 0
    assert "pepsi_claims_total" in after  # the loop's metrics are still there

    async def unreachable() -> dict[str, float]:
        server = MetricsServer(
            ("127.0.0.1", 0), lambda: Snapshot(Counts(), Gauges()), ["a"], horizon=Probe(NOWHERE)
        )
        try:
            return await asyncio.to_thread(scrape, server.url)
        finally:
            server.close()

    # The database out of reach: the gauge is left out, the scrape still answers.
    down = asyncio.run(unreachable())
    assert "pepsi_oldest_transaction_age_seconds" not in down
    assert "pepsi_claims_total" in down
