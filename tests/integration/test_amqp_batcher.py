"""The publish batcher (pepsi.amqp.broker.publish.batcher.Batcher) on its own."""

from __future__ import annotations

import asyncio

import psycopg

from pepsi.amqp.broker.publish.batcher import HIGH_WATER_BYTES, Batcher
from pepsi.amqp.broker.publish.units import Item, Unit
from pepsi.publishing.message import Row


def rows_in(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    row = conn.execute("SELECT count(*) FROM pepsi.workqueue").fetchone()
    assert row is not None
    return int(str(row[0]))


def test_close_commits_what_is_queued_then_refuses(dsn: str) -> None:
    async def scenario() -> list[BaseException | None]:
        batcher = Batcher(dsn, 5.0)
        outcomes: list[BaseException | None] = []
        row = Row._make(("amqp:/:q", "m", *(None,) * 13, 0))
        batcher.submit(Unit([Item([row])], lambda _items, error: outcomes.append(error)))
        await batcher.close()
        batcher.submit(Unit([Item([row])], lambda _items, error: outcomes.append(error)))
        return outcomes

    first, second = asyncio.run(scenario())
    assert first is None
    assert isinstance(second, RuntimeError)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert rows_in(conn) == 1


def test_a_commit_wakes_the_dispatcher_in_process_not_through_notify(dsn: str) -> None:
    """The batcher runs in the dispatcher's process: after each commit it calls
    `on_committed` (the dispatcher's wake), and pepsi.amqp_publish sends no NOTIFY
    (migration 0017). A publish from outside still notifies."""
    with psycopg.connect(dsn, autocommit=True) as listener:
        heard: list[str] = []
        listener.add_notify_handler(lambda n: heard.append(n.channel))
        listener.execute("LISTEN workqueue")

        async def scenario() -> tuple[BaseException | None, int]:
            batcher = Batcher(dsn, 5.0)
            woken: list[int] = []
            batcher.on_committed = lambda stages: woken.append(1)
            done: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
            row = Row._make(("amqp:/:q", "m", *(None,) * 13, 0))
            batcher.submit(Unit([Item([row])], lambda _items, error: done.set_result(error)))
            error = await done
            await batcher.close()
            return error, len(woken)

        assert asyncio.run(scenario()) == (None, 1)
        # A notification sent by that commit would reach this session with its next
        # statement's answer (the commit signalled it before it returned).
        listener.execute("SELECT 1")
        assert heard == []
        assert rows_in(listener) == 1
        listener.execute("SELECT pepsi.workqueue_publish_one('s', NULL, 'b'::bytea)")
        listener.execute("SELECT 1")
        assert heard == ["workqueue"]  # the listener does hear notifications


def test_the_queue_is_bounded_in_bytes_as_well_as_rows(dsn: str) -> None:
    """Issue 34: 20 000 queued rows of 128 MiB each were allowed. Past HIGH_WATER_BYTES
    queued, publishers wait (`has_room` false, `connection.blocked` through on_blocked)
    until the batcher has taken them; then room again."""
    mib = 1024 * 1024
    big = Row._make(("amqp:/:q", "m", *(None,) * 13, 0))._replace(body=b"x" * (24 * mib))

    async def scenario() -> tuple[bool, list[str | None], list[BaseException | None]]:
        batcher = Batcher(dsn, 5.0)
        reasons: list[str | None] = []
        batcher.on_blocked = reasons.append
        done: list[BaseException | None] = []
        for _ in range(3):  # 72 MiB queued: over the 64 MiB mark
            batcher.submit(Unit([Item([big])], lambda _items, error: done.append(error)))
        blocked = not batcher.has_room
        await batcher.room()
        await batcher.close()
        return blocked, reasons, done

    blocked, reasons, done = asyncio.run(scenario())
    assert blocked
    assert reasons == ["publishes are waiting for the database", None]
    assert done == [None, None, None]
    assert 3 * 24 * mib > HIGH_WATER_BYTES
