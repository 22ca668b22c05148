"""The publish batcher (pepsi.amqp.publisher.Batcher) on its own."""

from __future__ import annotations

import asyncio

import psycopg

from pepsi.amqp.publisher import Batcher, Item, Unit
from pepsi.publishing.message import Row


def rows_in(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    row = conn.execute("SELECT count(*) FROM pepsi.workqueue").fetchone()
    assert row is not None
    return int(str(row[0]))


def test_close_commits_what_is_queued_then_refuses(dsn: str) -> None:
    async def scenario() -> list[BaseException | None]:
        batcher = Batcher(dsn, 5.0)
        outcomes: list[BaseException | None] = []
        row = Row._make(("amqp:/:q", "m", *(None,) * 13))
        batcher.submit(Unit([Item([row])], lambda _items, error: outcomes.append(error)))
        await batcher.close()
        batcher.submit(Unit([Item([row])], lambda _items, error: outcomes.append(error)))
        return outcomes

    first, second = asyncio.run(scenario())
    assert first is None
    assert isinstance(second, RuntimeError)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert rows_in(conn) == 1
