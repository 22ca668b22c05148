"""`retry=` (Q-3): a publish that failed, or whose outcome is unknown, is published once.

Real faults on a real server: the pool's sessions terminated under it, a
read-only database (as a standby refuses writes: 25006), the server stopped
and started again (a failover's outage, on one node). Each publish call
gives exactly one row, and the publisher finds the server again as soon as
it accepts connections, not after the pool's own reconnect backoff.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pepsi.config import load_config
from pepsi.db import schema
from pepsi.db.embedded import EmbeddedServer
from pepsi.errors import DatabaseReadOnly, NotConfirmed
from pepsi.publishing import AsyncPublisher, OutgoingMessage, Publisher, Retry
from tests.scenarios.conftest import wait_until

OUTAGE = 6.0  # seconds the server is down in the outage test
CONF = "[stage-a]\nHANDLER = tests.stages:noop\n[pepsi-postgres]\nPOOL_MIN_SIZE = 2\n"


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF)
    return path


def terminate_publishers(dsn: str) -> int:
    """End every publisher session of this database, as a failover does; how many. It
    returns once they are gone (pg_terminate_backend only signals them): their goodbye
    is on the sockets by then."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        pids = [
            int(r[0])
            for r in conn.execute(
                "SELECT pid FROM pg_stat_activity"
                " WHERE application_name = 'pepsi-publish' AND datname = current_database()"
            )
        ]
        for pid in pids:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_until(
            lambda: (
                not conn.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)
                ).fetchone()
            ),
            what="the terminated sessions to end",
        )
    return len(pids)


def rows(dsn: str) -> list[tuple[int, str | None]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [
            (int(wid), mid)
            for wid, mid in conn.execute(
                "SELECT workqueue_id, message_id FROM pepsi.workqueue ORDER BY workqueue_id"
            ).fetchall()
        ]


def test_terminated_sessions_give_exactly_one_message(conf: Path, dsn: str) -> None:
    with Publisher.connect(load_config(conf), dsn) as publisher:
        wait_until(lambda: publisher.pool.get_stats()["pool_available"] >= 2, what="2 idle")
        assert terminate_publishers(dsn) >= 2
        started = time.monotonic()
        wid = publisher.publish("a", b"x", retry=True)
        took = time.monotonic() - started
    assert took < 5.0  # a fresh connection at once, not the pool's backoff (measured ~0.1 s)
    ((stored, message_id),) = rows(dsn)
    assert stored == wid
    assert message_id is not None  # generated (uuid4), deduplicated: safe to publish again


def test_sessions_the_server_ended_are_never_handed_out(conf: Path, dsn: str) -> None:
    """Idle sessions terminated (as a failover or a restart ends them) are seen at once
    (the server's goodbye waits on their sockets): the next publish gets a new session."""
    with Publisher.connect(load_config(conf), dsn) as publisher:
        wait_until(lambda: publisher.pool.get_stats()["pool_available"] >= 2, what="2 idle")
        assert terminate_publishers(dsn) >= 2
        publisher.publish("a", b"x")  # no NotConfirmed, no retry needed
        publisher.publish("a", b"y")
    assert len(rows(dsn)) == 2


def lose_the_connection_mid_publish(dsn: str, publish: Any) -> BaseException | None:
    """Run `publish` while the queue is locked, end its session while it waits: what it
    raises (an outcome it cannot know)."""
    result: dict[str, BaseException | None] = {"error": None}

    def run() -> None:
        try:
            publish()
        except BaseException as exc:  # noqa: BLE001  # the caller looks at it
            result["error"] = exc

    with psycopg.connect(dsn) as locker:
        locker.execute("LOCK TABLE pepsi.workqueue IN ACCESS EXCLUSIVE MODE")
        thread = threading.Thread(target=run)
        thread.start()
        with psycopg.connect(dsn, autocommit=True) as admin:
            waiting = (
                "SELECT pid FROM pg_stat_activity WHERE application_name = 'pepsi-publish'"
                " AND wait_event_type = 'Lock' AND datname = current_database()"
            )
            pid = wait_until(lambda: admin.execute(waiting).fetchone(), what="a blocked publish")
            admin.execute("SELECT pg_terminate_backend(%s)", pid)
        thread.join(30)
        locker.rollback()
    return result["error"]


def test_the_async_publisher_retries_too(conf: Path, dsn: str) -> None:
    async def main() -> int:
        async with AsyncPublisher(load_config(conf), dsn, retry=Retry(attempts=5)) as publisher:
            await publisher.publish("a", b"warm")
            terminate_publishers(dsn)
            return await publisher.publish("a", b"x")

    import asyncio  # noqa: PLC0415

    wid = asyncio.run(main())
    assert [w for w, _ in rows(dsn)][-1] == wid
    assert len(rows(dsn)) == 2


def test_a_read_only_database_is_retried_until_it_takes_writes(conf: Path, dsn: str) -> None:
    """25006 wrote nothing: retried (the publish waits for a primary), then one row."""
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    assert isinstance(dbname, str)
    read_only = sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = {}")
    result: dict[str, Any] = {}
    with Publisher.connect(load_config(conf), dsn) as publisher:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(read_only.format(sql.Identifier(dbname), sql.Literal("on")))
        terminate_publishers(dsn)  # its new sessions are read-only: a standby's answer

        def publish() -> None:
            try:
                result["id"] = publisher.publish("a", b"x", retry=Retry(deadline=60))
            except Exception as exc:  # noqa: BLE001  # reported below
                result["error"] = exc

        thread = threading.Thread(target=publish)
        thread.start()
        wait_until(lambda: publisher.recovering, what="a refused attempt")
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("SET default_transaction_read_only = off")  # read-only by now
            admin.execute(read_only.format(sql.Identifier(dbname), sql.Literal("off")))
        thread.join(timeout=60)
    assert "error" not in result, result
    assert [w for w, _ in rows(dsn)] == [result["id"]]


def test_without_retry_read_only_is_database_read_only(conf: Path, dsn: str) -> None:
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with Publisher.connect(load_config(conf), dsn) as publisher:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(
                    sql.Identifier(str(dbname))
                )
            )
        wait_until(lambda: publisher.pool.get_stats()["pool_available"] >= 2, what="2 idle")
        terminate_publishers(dsn)
        with pytest.raises(DatabaseReadOnly):  # a new session, read-only: 25006
            publisher.publish("a", b"x")
    assert rows(dsn) == []


def test_retry_needs_dedup_to_retry_an_unknown_outcome(conf: Path, dsn: str) -> None:
    """A message with its own id and dedup=False is not retried after a lost connection."""
    with Publisher.connect(load_config(conf), dsn, retry=True) as publisher:
        error = lose_the_connection_mid_publish(
            dsn, lambda: publisher.publish("a", b"x", message_id="mine")
        )
    assert isinstance(error, NotConfirmed), error
    assert rows(dsn) == []


def test_retry_is_refused_on_the_callers_connection(conf: Path, dsn: str) -> None:
    with (
        Publisher.connect(load_config(conf), dsn) as publisher,
        psycopg.connect(dsn) as own,
        pytest.raises(ValueError, match="connection="),
    ):
        publisher.publish("a", b"x", connection=own, retry=True)


@pytest.fixture
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    server = EmbeddedServer(tmp_path_factory.mktemp("outage") / "data")
    dsn = server.start()
    with psycopg.connect(dsn, autocommit=True) as conn:
        schema.install(conn)
    try:
        yield server
    finally:
        server.stop()


def test_an_outage_costs_the_publisher_about_a_second(
    own_server: EmbeddedServer, conf: Path
) -> None:
    """The server goes down for a few seconds and comes back: the publish waiting with
    retry= succeeds once, about a second at most after the server accepts connections
    again (psycopg_pool's own backoff, 1 s doubling, would add seconds)."""
    dsn = own_server.uri()
    assert dsn is not None
    result: dict[str, Any] = {}
    with Publisher.connect(load_config(conf), dsn, retry=Retry(deadline=60)) as publisher:
        own_server.stop()
        stopped = time.monotonic()

        def publish() -> None:
            try:
                result["id"] = publisher.publish("a", b"x")
            except Exception as exc:  # noqa: BLE001  # reported below
                result["error"] = exc
            result["done"] = time.time()

        thread = threading.Thread(target=publish)
        thread.start()
        # an outage as long as a tuned failover's last steps: the pool's own attempts
        # (1 s, 2 s, 4 s apart by default) would be far apart by its end
        wait_until(lambda: time.monotonic() - stopped > OUTAGE, OUTAGE + 5, "the outage")
        assert own_server.start() == dsn
        up = time.time()  # it accepts connections (its own start-up is not the retry's)
        thread.join(timeout=60)
    assert "error" not in result, result
    recovery = result["done"] - up
    print(f"publish confirmed {recovery:.3f}s after the server started")
    assert recovery < 3.0  # measured 0.1-1.2 s: the retry's delay is capped at 1 s
    assert [w for w, _ in rows(dsn)] == [result["id"]]


def test_the_sync_pipeline_inherits_retry(conf: Path, dsn: str) -> None:
    with Publisher.connect(load_config(conf), dsn, retry=True) as publisher:
        pipe = publisher.pipeline(concurrency=2)
        try:
            first = [pipe.submit(OutgoingMessage("a", b"warm")) for _ in range(10)]
            pipe.flush()
            terminate_publishers(dsn)  # the pipeline's own pool too
            futures = [pipe.submit(OutgoingMessage("a", b"x")) for _ in range(50)]
            pipe.flush()
        finally:
            pipe.close()
    ids = [f.result(timeout=0) for f in first + futures]
    assert sorted(ids) == [w for w, _ in rows(dsn)]
    assert len(set(ids)) == 60


def test_pepsi_ingress_retry_waits_out_a_read_only_database(conf: Path, dsn: str) -> None:
    """The producer CLI's --retry: a refused attempt is said on stderr, then the one row."""
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    assert isinstance(dbname, str)
    read_only = sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = {}")
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(read_only.format(sql.Identifier(dbname), sql.Literal("on")))
    env = {**os.environ, "PEPSI_DSN": dsn}
    command = [sys.executable, "-m", "pepsi", "-c", str(conf), "ingress", "--stage", "a"]
    with subprocess.Popen(
        [*command, "--retry", "-"], env=env, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    ) as proc:  # fmt: skip
        assert proc.stdin is not None
        assert proc.stderr is not None
        proc.stdin.write("hello")
        proc.stdin.close()
        line = proc.stderr.readline()  # blocks until the first attempt was refused
        assert "publish not done" in line
        assert "read-only" in line
        assert "trying again in" in line
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("SET default_transaction_read_only = off")
            admin.execute(read_only.format(sql.Identifier(dbname), sql.Literal("off")))
        assert proc.stdout is not None
        out = proc.stdout.read()
        assert proc.wait(60) == 0
    assert [str(w) for w, _ in rows(dsn)] == [out.strip()]
    bad = subprocess.run(
        [*command, "--retry-deadline", "0", "-"], env=env, input="x", capture_output=True,
        text=True, check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip().endswith(
        "--retry-deadline: Retry.deadline must be > 0 seconds, not 0.0"
    )


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_without_retry_a_publish_goes_on_as_soon_as_the_server_is_back(
    own_server: EmbeddedServer, conf: Path, kind: str
) -> None:
    """Issue 33: after a restart the pool handed out connections the server had closed
    (the next publish: NotConfirmed), and a publish waiting through the outage waited its
    whole CONNECT_TIMEOUT (10 s) after the pool gave up reconnecting, then DatabaseBusy."""
    dsn = own_server.uri()
    assert dsn is not None
    config = load_config(conf)
    assert config.postgres.connect_timeout >= 10.0

    async def waiting_async(publisher: AsyncPublisher) -> int:
        return await publisher.publish("a", b"waited")

    def cycle(publish_waiting: Any, publish_after: Any) -> tuple[float, int, int]:
        own_server.stop()
        stopped = time.monotonic()
        result: dict[str, Any] = {}

        def waiting() -> None:
            try:
                result["id"] = publish_waiting()
            except Exception as exc:  # noqa: BLE001  # reported below
                result["error"] = exc
            result["done"] = time.monotonic()

        thread = threading.Thread(target=waiting)
        thread.start()  # it waits for a connection through the outage
        wait_until(lambda: time.monotonic() - stopped > 3.0, 10, "a 3 s outage")
        assert own_server.start() == dsn
        back = time.monotonic()
        thread.join(timeout=30)
        assert "error" not in result, result
        after = publish_after()  # a publish made once the server is back: at once, no error
        return result["done"] - back, result["id"], after

    if kind == "sync":
        with Publisher.connect(config, dsn) as publisher:
            publisher.publish("a", b"before")  # the pool holds connections the stop will end
            waited, first, second = cycle(
                lambda: publisher.publish("a", b"waited"),
                lambda: publisher.publish("a", b"after"),
            )
    else:

        async def main() -> tuple[float, int, int]:
            async with await AsyncPublisher.connect(config, dsn) as publisher:
                await publisher.publish("a", b"before")
                loop = asyncio.get_running_loop()
                return await asyncio.to_thread(
                    cycle,
                    lambda: asyncio.run_coroutine_threadsafe(
                        waiting_async(publisher), loop
                    ).result(),
                    lambda: asyncio.run_coroutine_threadsafe(
                        publisher.publish("a", b"after"), loop
                    ).result(),
                )

        waited, first, second = asyncio.run(main())
    print(f"the waiting publish went on {waited:.3f}s after the server was back")
    assert waited < 4.0  # measured 0.05-0.6 s; before: DatabaseBusy after 10 s
    assert second > first
    assert len(rows(dsn)) == 3
