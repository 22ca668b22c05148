"""A publish whose wait for a synchronous standby is cancelled is not a confirm (Q-2).

On a server of its own that requires a standby that never comes
(`synchronous_standby_names = 'ghost'`), a publish waits in SyncRep; a
`pg_cancel_backend` makes PostgreSQL commit locally with only a WARNING, a
`pg_terminate_backend` likewise and then ends the session. The publisher
must raise NotConfirmed, never return the ids, on every path (sync, async,
pipeline, a caller's autocommit connection). `confirm_timeout=` ends the
wait by closing the connection: the rows stay invisible until a standby
confirms (here: until the requirement is lifted), the outcome unknown, not
lost. `retry=` publishes again under the same message id: exactly one row.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pepsi.config import load_config
from pepsi.db import schema
from pepsi.db.embedded import EmbeddedServer
from pepsi.errors import DatabaseLost, NotConfirmed
from pepsi.publishing import AsyncPublisher, OutgoingMessage, Publisher, Retry
from tests.scenarios.conftest import wait_until

CONF = "[stage-a]\nHANDLER = tests.stages:noop\n"


@pytest.fixture(scope="module")
def waiting_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server whose commits wait for a synchronous standby that does not exist."""
    server = EmbeddedServer(tmp_path_factory.mktemp("syncrep") / "data")
    dsn = server.start()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            schema.install(conn)
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'ghost'")
            conn.execute("SELECT pg_reload_conf()")
        yield dsn
    finally:
        server.stop()


def waiting(dsn: str, *, besides: frozenset[int] = frozenset()) -> int:
    """The pid of a publisher's backend waiting for the standby (not one of `besides`)."""
    # this session must not wait for the standby itself: it only reads
    with psycopg.connect(dsn, autocommit=True) as admin:
        deadline = time.monotonic() + 30
        while True:
            pids = admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
                " AND application_name = 'pepsi-publish'"
            ).fetchall()
            found = [int(pid) for (pid,) in pids if int(pid) not in besides]
            if found:
                return found[0]
            assert time.monotonic() < deadline, "the publish never waited for the standby"
            time.sleep(0.02)


def signal_the_wait(dsn: str, how: str = "cancel") -> int:
    """Cancel (or terminate) the publisher's backend once it waits for the standby."""
    pid = waiting(dsn)
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"SELECT pg_{how}_backend(%s)", (pid,))
    return pid


def cancel_the_wait(dsn: str) -> int:
    return signal_the_wait(dsn, "cancel")


def stored(dsn: str, message_id: str | None = None) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        if message_id is None:
            row = conn.execute("SELECT count(*) FROM pepsi.workqueue").fetchone()
        else:
            row = conn.execute(
                "SELECT count(*) FROM pepsi.workqueue WHERE message_id = %s", (message_id,)
            ).fetchone()
        return int(row[0]) if row else 0


def require_standby(dsn: str, name: str) -> None:
    """Set synchronous_standby_names ('' releases every commit waiting for one)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL("ALTER SYSTEM SET synchronous_standby_names = {}").format(
                psycopg.sql.Literal(name)
            )
        )
        conn.execute("SELECT pg_reload_conf()")
    # the reload is asynchronous: a session started once it is done has the new value
    wait_until(lambda: _setting(dsn) == name, what=f"synchronous_standby_names = {name!r}")


def _setting(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SHOW synchronous_standby_names").fetchone()
    return str(row[0]) if row else ""


@pytest.fixture
def released(waiting_dsn: str) -> Iterator[str]:
    """The waiting server, whose test may lift the standby requirement; put back after."""
    try:
        yield waiting_dsn
    finally:
        require_standby(waiting_dsn, "")  # let any commit still waiting finish first
        wait_until(lambda: not _any_waiting(waiting_dsn), what="no commit waiting")
        require_standby(waiting_dsn, "ghost")


def _any_waiting(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
        ).fetchone()
        return bool(row and row[0])


def test_a_cancelled_wait_for_the_standby_is_not_confirmed(
    waiting_dsn: str, tmp_path: Path
) -> None:
    conf = tmp_path / "pepsi.conf"
    conf.write_text("[stage-a]\nHANDLER = tests.stages:noop\n")
    result: dict[str, Any] = {}
    before = stored(waiting_dsn)
    with Publisher.connect(load_config(conf), waiting_dsn) as publisher:

        def publish() -> None:
            try:
                result["ids"] = publisher.publish("a", b"x")
            except NotConfirmed as exc:
                result["error"] = exc

        thread = threading.Thread(target=publish)
        thread.start()
        cancel_the_wait(waiting_dsn)
        thread.join(timeout=30)
    assert "ids" not in result
    assert "synchronous standby" in str(result["error"])
    assert stored(waiting_dsn) == before + 1  # committed locally: why it is not a confirm


def test_the_async_publisher_too(waiting_dsn: str, tmp_path: Path) -> None:
    conf = tmp_path / "pepsi.conf"
    conf.write_text("[stage-a]\nHANDLER = tests.stages:noop\n")

    async def main() -> BaseException | None:
        async with AsyncPublisher(load_config(conf), waiting_dsn) as publisher:
            task = asyncio.ensure_future(publisher.publish("a", b"x"))
            await asyncio.to_thread(cancel_the_wait, waiting_dsn)
            try:
                await task
            except NotConfirmed as exc:
                return exc
        return None

    error = asyncio.run(main())
    assert isinstance(error, NotConfirmed)


def test_a_terminated_wait_is_not_confirmed_either(waiting_dsn: str, tmp_path: Path) -> None:
    conf = tmp_path / "pepsi.conf"
    conf.write_text(CONF)
    result: dict[str, Any] = {}
    with Publisher.connect(load_config(conf), waiting_dsn) as publisher:

        def publish() -> None:
            try:
                result["ids"] = publisher.publish("a", b"x")
            except DatabaseLost as exc:  # NotConfirmed is one
                result["error"] = exc

        thread = threading.Thread(target=publish)
        thread.start()
        signal_the_wait(waiting_dsn, "terminate")
        thread.join(timeout=30)
        assert "ids" not in result
        assert isinstance(result["error"], NotConfirmed)
        assert "dedup=True" in str(result["error"])


def test_the_async_publisher_on_a_terminated_wait(waiting_dsn: str, tmp_path: Path) -> None:
    conf = tmp_path / "pepsi.conf"
    conf.write_text(CONF)

    async def main() -> BaseException | None:
        async with AsyncPublisher(load_config(conf), waiting_dsn) as publisher:
            task = asyncio.ensure_future(publisher.publish("a", b"x"))
            await asyncio.to_thread(signal_the_wait, waiting_dsn, "terminate")
            try:
                await task
            except NotConfirmed as exc:
                return exc
        return None

    assert isinstance(asyncio.run(main()), NotConfirmed)


@pytest.mark.parametrize("how", ["cancel", "terminate"])
def test_the_pipeline_fails_the_futures(waiting_dsn: str, tmp_path: Path, how: str) -> None:
    conf = tmp_path / "pepsi.conf"
    conf.write_text(CONF)
    with (
        Publisher.connect(load_config(conf), waiting_dsn) as publisher,
        publisher.pipeline(concurrency=1) as pipe,
    ):
        future = pipe.submit(OutgoingMessage("a", b"x"))
        signal_the_wait(waiting_dsn, how)
        assert isinstance(future.exception(timeout=30), NotConfirmed)


def test_a_callers_autocommit_connection_too(waiting_dsn: str, tmp_path: Path) -> None:
    conf = tmp_path / "pepsi.conf"
    conf.write_text(CONF)
    result: dict[str, Any] = {}
    with (
        Publisher.connect(load_config(conf), waiting_dsn) as publisher,
        psycopg.connect(waiting_dsn, autocommit=True, application_name="pepsi-publish") as own,
    ):

        def publish() -> None:
            try:
                result["ids"] = publisher.publish("a", b"x", connection=own)
            except NotConfirmed as exc:
                result["error"] = exc

        thread = threading.Thread(target=publish)
        thread.start()
        cancel_the_wait(waiting_dsn)
        thread.join(timeout=30)
    assert "ids" not in result
    assert isinstance(result["error"], NotConfirmed)


def test_confirm_timeout_closes_the_connection_and_the_row_waits(
    released: str, tmp_path: Path
) -> None:
    conf = tmp_path / "pepsi.conf"
    conf.write_text(CONF)
    with Publisher.connect(load_config(conf), released, confirm_timeout=0.5) as publisher:
        started = time.monotonic()
        with pytest.raises(NotConfirmed, match=r"confirm_timeout=0\.5s") as timed_out:
            publisher.publish("a", b"x", message_id="ct-sync")
        took = time.monotonic() - started
        assert 0.5 <= took < 5.0  # the deadline, plus the error's way back: not forever
        assert "same message_id and dedup=True" in str(timed_out.value)
        # not cancelled: the backend still waits for a standby, the row invisible
        waiting(released)
        assert stored(released, "ct-sync") == 0
        # the closed connection is not handed out again: a fresh one times out the same way
        with pytest.raises(NotConfirmed, match=r"confirm_timeout=0\.2s"):
            publisher.publish("a", b"y", message_id="ct-sync-2", confirm_timeout=0.2)
    assert stored(released, "ct-sync") == 0  # still unknown, not lost: a standby comes
    require_standby(released, "")
    wait_until(lambda: stored(released, "ct-sync") == 1, what="the row once confirmed")


def bodies(dsn: str, body: bytes) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pepsi.workqueue_body WHERE body = %s", (body,)
        ).fetchone()
        return int(row[0]) if row else 0


def test_a_bare_publishs_confirm_timeout_too(released: str, tmp_path: Path) -> None:
    """publish(stage, body): its statement sent by libpq (publishing/single.py), the
    socket shut down under it all the same; the next one gets a fresh connection."""
    conf = tmp_path / "pepsi.conf"
    conf.write_text(CONF)
    with Publisher.connect(load_config(conf), released, confirm_timeout=0.5) as publisher:
        first = publisher.pool.getconn()
        publisher.pool.putconn(first)
        started = time.monotonic()
        with pytest.raises(NotConfirmed, match=r"confirm_timeout=0\.5s"):
            publisher.publish("a", b"bare-1")
        assert 0.5 <= time.monotonic() - started < 5.0
        assert first.closed
        waiting(released)
        with pytest.raises(NotConfirmed, match=r"confirm_timeout=0\.5s"):
            publisher.publish("a", b"bare-2")
    assert bodies(released, b"bare-1") == bodies(released, b"bare-2") == 0
    require_standby(released, "")
    wait_until(lambda: bodies(released, b"bare-1") == 1, what="the row once confirmed")
    wait_until(lambda: bodies(released, b"bare-2") == 1, what="the second once confirmed")


def test_confirm_timeout_of_the_async_publisher(released: str, tmp_path: Path) -> None:
    conf = tmp_path / "pepsi.conf"
    conf.write_text(CONF)

    async def main() -> float:
        async with AsyncPublisher(load_config(conf), released) as publisher:
            started = time.monotonic()
            with pytest.raises(NotConfirmed, match=r"confirm_timeout=0\.5s"):
                await publisher.publish("a", b"x", message_id="ct-async", confirm_timeout=0.5)
            return time.monotonic() - started

    took = asyncio.run(main())
    assert 0.5 <= took < 5.0
    waiting(released)
    assert stored(released, "ct-async") == 0
    require_standby(released, "")
    wait_until(lambda: stored(released, "ct-async") == 1, what="the row once confirmed")


def test_retry_after_a_terminated_commit_publishes_exactly_once(
    released: str, tmp_path: Path
) -> None:
    """The commit happened locally, the answer never came: the retry finds it by message id."""
    conf = tmp_path / "pepsi.conf"
    conf.write_text(CONF)
    result: dict[str, Any] = {}
    with Publisher.connect(load_config(conf), released, retry=Retry(deadline=60)) as publisher:

        def publish() -> None:
            result["id"] = publisher.publish("a", b"x", message_id="rt-1", dedup=True)

        thread = threading.Thread(target=publish)
        thread.start()
        first = signal_the_wait(released, "terminate")  # committed locally, then gone
        waiting(released, besides=frozenset({first}))  # the retry, waiting on its own commit
        require_standby(released, "")  # a standby: the retry is confirmed
        thread.join(timeout=30)
        assert not thread.is_alive()
    assert stored(released, "rt-1") == 1
    with psycopg.connect(released, autocommit=True) as conn:
        row = conn.execute(
            "SELECT workqueue_id FROM pepsi.workqueue WHERE message_id = 'rt-1'"
        ).fetchone()
    assert row is not None
    assert result["id"] == row[0]
