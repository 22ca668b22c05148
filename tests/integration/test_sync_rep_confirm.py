"""A publish whose wait for a synchronous standby is cancelled is not a confirm (Q-2).

On a server of its own that requires a standby that never comes
(`synchronous_standby_names = 'ghost'`), a publish waits in SyncRep; a
`pg_cancel_backend` makes PostgreSQL commit locally with only a WARNING.
The publisher must raise NotConfirmed, never return the ids.
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
from pepsi.errors import NotConfirmed
from pepsi.publishing import AsyncPublisher, Publisher


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


def cancel_the_wait(dsn: str) -> int:
    """Cancel the publisher's backend once it waits for the standby; its pid."""
    # this session must not wait for the standby itself: it only reads
    with psycopg.connect(dsn, autocommit=True) as admin:
        deadline = time.monotonic() + 30
        while True:
            found = admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
                " AND application_name = 'pepsi-publish'"
            ).fetchone()
            if found:
                admin.execute("SELECT pg_cancel_backend(%s)", (found[0],))
                return int(found[0])
            assert time.monotonic() < deadline, "the publish never waited for the standby"
            time.sleep(0.02)


def stored(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pepsi.workqueue").fetchone()
        return int(row[0]) if row else 0


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
