"""The asynchronous `AsyncPublisher`: the source of pipelined publishing.

The routes, options and errors are `client_core.py`'s, as the sync side's;
what is here is the asyncio I/O: the pool, the confirm deadline on the event
loop, and retries that sleep without blocking it. `Pipeline` streams batches
through `publish_many`, and `SyncPipeline` runs one of these on a thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from weakref import WeakKeyDictionary

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from pepsi import telemetry
from pepsi.admin import serving
from pepsi.config import Config, read_overlay_async
from pepsi.db import connect as db_connect
from pepsi.errors import DatabaseUnavailable, PepsiError, classify
from pepsi.publishing import batch, pool_wait, single
from pepsi.publishing import retry as retrying
from pepsi.publishing.client_core import (
    AnyAConn,
    PublisherCore,
    as_message,
    config_of,
    domain_error,
    log_retry,
    owns_transaction,
    pool_options,
    publish_error,
    require_schema,
)
from pepsi.publishing.confirm import ConfirmDeadline, SyncRepWatch
from pepsi.publishing.message import OutgoingMessage
from pepsi.publishing.pipeline import Pipeline
from pepsi.publishing.retry import Retry


class AsyncPublisher(PublisherCore):
    """Asynchronous publisher over a small connection pool; see `Publisher`."""

    def __init__(
        self,
        config: Config,
        dsn: str,
        *,
        confirm_timeout: float | None = None,
        retry: Retry | bool = False,
    ) -> None:
        super().__init__(config, dsn, confirm_timeout=confirm_timeout, retry=retry)
        self.pool = AsyncConnectionPool(dsn, **pool_options(config, dsn))
        self.spare = pool_wait.ASpare(self.pool)
        self.cursors: WeakKeyDictionary[AnyAConn, psycopg.AsyncCursor[Any]] = WeakKeyDictionary()

    @classmethod
    async def connect(
        cls,
        config: Config | Path | str | None = None,
        dsn: str | None = None,
        *,
        confirm_timeout: float | None = None,
        retry: Retry | bool = False,
    ) -> Self:
        """An open publisher for `config` (a Config, or a path; default locations if None)."""
        config = config_of(config)
        if dsn is None:
            dsn = (await asyncio.to_thread(db_connect.resolve, config)).dsn
        publisher = cls(config, dsn, confirm_timeout=confirm_timeout, retry=retry)
        await publisher.open()
        return publisher

    async def open(self) -> None:
        """Open the pool, check the schema, read the overlay (nothing if already open)."""
        if self.opened:
            return
        timeout = self.base.postgres.connect_timeout
        # as the sync open: a refusal or another schema is one line at once
        await asyncio.to_thread(self._require_schema, timeout)
        try:
            await self.pool.open(wait=True, timeout=timeout)
        except PoolTimeout:
            await self.pool.close()
            raise self._unreachable() from None
        try:
            async with self.pool.connection() as conn:
                await self._refresh(conn)
                self._note_served(await serving.served_async(conn))
        except psycopg.Error as exc:
            await self.pool.close()
            raise domain_error(exc) from exc
        except BaseException:
            await self.pool.close()
            raise
        self.opened = True

    def _require_schema(self, timeout: float) -> None:
        # The schema check is sync; one short connection, off the event loop.
        require_schema(self.dsn, timeout)

    async def refresh(self) -> None:
        """Re-read the configuration overlay (stages added in the database)."""
        self._require_open()
        try:
            async with self.pool.connection() as conn:
                await self._refresh(conn)
        except psycopg.Error as exc:
            raise domain_error(exc) from exc

    async def _refresh(self, conn: AnyAConn) -> None:
        self._apply(await read_overlay_async(conn))

    async def publish(
        self,
        stage: str | OutgoingMessage,
        body: Any = None,
        *,
        connection: AnyAConn | None = None,
        confirm_timeout: float | None = None,
        retry: Retry | bool | None = None,
        **fields: Any,
    ) -> int:
        """Publish one message; return its id once confirmed. `stage` and the fields of
        OutgoingMessage, or an OutgoingMessage alone."""
        if self._lean(stage, fields, connection, confirm_timeout, retry):
            call = batch.single(stage, body, self.current)  # the same checks, the same call
            return (await self._attempt(None, self.confirm_timeout, self.pool.timeout, call))[0]
        ids = await self.publish_many(
            [as_message(stage, body, fields)],
            connection=connection,
            confirm_timeout=confirm_timeout,
            retry=retry,
        )
        return ids[0]

    async def publish_many(
        self,
        messages: Iterable[OutgoingMessage],
        *,
        connection: AnyAConn | None = None,
        confirm_timeout: float | None = None,
        retry: Retry | bool | None = None,
    ) -> list[int]:
        """Publish a batch: one transaction, one confirm, one NOTIFY. See Publisher.publish_many.

        Do not bound it with asyncio.timeout/wait_for: a cancelled publish makes
        psycopg cancel the statement, and a cancelled wait for a standby commits
        locally. `confirm_timeout` closes the connection instead.
        """
        items = list(messages)
        if not items:
            return []
        self._require_open()
        if self.unserved:
            self._warn_unserved(items)
        timeout, rule = self._options(confirm_timeout, retry, connection)
        if rule is not None:
            items = retrying.idempotent(items)
        if self.base.pepsi.share_telemetry:  # P-11: a publish span, its context in each message
            with telemetry.for_publisher(self.base).publish(items) as traced:
                return await self._publish_on(connection, traced, timeout, rule)
        return await self._publish_on(connection, items, timeout, rule)

    async def _publish_on(
        self,
        connection: AnyAConn | None,
        items: list[OutgoingMessage],
        timeout: float | None,
        rule: Retry | None,
    ) -> list[int]:
        if connection is not None:
            try:
                return await self._publish(connection, items, timeout, pooled=False)
            except psycopg.Error as exc:
                raise domain_error(exc) from exc
        if rule is None:
            return await self._attempt(items, timeout, self.pool.timeout)
        tries = retrying.Attempts(rule, idempotent=retrying.all_deduplicated(items))
        while True:
            tries.begin()
            try:
                return await self._attempt(items, timeout, self._pool_wait(tries.remaining()))
            except PepsiError as exc:
                pause = tries.failed(exc)
                if pause is None:
                    raise
                log_retry(exc, pause)
            await asyncio.sleep(pause)

    async def _attempt(
        self,
        items: list[OutgoingMessage] | None,
        timeout: float | None,
        wait: float,
        call: batch.BatchCall | None = None,
    ) -> list[int]:
        """One try on a pool connection; a broken one drains the pool (a failover).
        `items`, or their `call` made already (then `items` is None)."""
        lost = False
        try:
            conn = await self.spare.take(wait)
            try:
                ids = await self._publish(conn, items, timeout, call, pooled=True)
            except BaseException as exc:
                lost = self._lost(conn, exc)
                await self.pool.putconn(conn)
                raise
            await self.spare.give(conn)
        except psycopg.Error as exc:
            await self._failed(lost, exc)
            raise domain_error(exc) from exc
        except DatabaseUnavailable as exc:
            await self._failed(lost, exc)
            raise
        self.recovering = False
        return ids

    def _cursor(self, conn: AnyAConn) -> psycopg.AsyncCursor[Any]:
        cursor = self.cursors.get(conn)
        if cursor is None:
            cursor = self.cursors[conn] = conn.cursor()
        return cursor

    async def _failed(self, lost: bool, exc: BaseException) -> None:
        if classify(exc) is not None:
            self.recovering = True
        if lost:
            await self.spare.release()
            await self.pool.drain()  # the others are likely on the old primary too

    async def _publish(
        self,
        conn: AnyAConn,
        items: list[OutgoingMessage] | None,
        timeout: float | None,
        call: batch.BatchCall | None = None,
        *,
        pooled: bool,
    ) -> list[int]:
        """As the sync `_execute`: a single publish by libpq on a pool's connection only."""
        if call is None:
            assert items is not None
            if self._needs_refresh(items):
                await self._refresh(conn)
            call = batch.build(items, self.current)
        deadline: ConfirmDeadline | None = None
        try:
            if owns_transaction(conn):
                cancelled = SyncRepWatch()
                conn.add_notice_handler(cancelled)
                timer: asyncio.TimerHandle | None = None
                if timeout is not None:  # shuts the socket down; never a cancel (see above)
                    deadline = ConfirmDeadline(conn)
                    timer = asyncio.get_running_loop().call_later(timeout, deadline.fire)
                try:  # on a pool connection: one message by libpq, others on its own cursor
                    if pooled and call.sql is batch.ONE_SQL:
                        answer: list[tuple[Any, ...]] = await single.apublish(conn, call.params)
                    else:
                        own = self._cursor(conn) if pooled else conn.cursor()
                        cursor = await own.execute(call.sql, call.params)
                        answer = await cursor.fetchall()
                finally:
                    conn.remove_notice_handler(cancelled)
                    if deadline is not None and timer is not None:
                        deadline.finish()
                        timer.cancel()
                if deadline is not None and deadline.fired:  # the answer won the race
                    await conn.close()  # its socket is shut: the pool must not reuse it
                cancelled.check()
            else:
                async with conn.transaction():
                    answer = await (await conn.execute(call.sql, call.params)).fetchall()
        except psycopg.Error as exc:
            if deadline is not None and deadline.fired:
                await conn.close()
                assert timeout is not None
                raise ConfirmDeadline.error(timeout) from exc
            raise publish_error(exc) from exc
        return batch.ids_from(call, answer)

    def pipeline(
        self, *, max_outstanding: int = 1000, max_batch: int = 500, concurrency: int = 2
    ) -> Pipeline:
        """Pipelined publishing; call it from a running event loop (it starts tasks)."""
        self._require_open()
        return Pipeline(
            self, max_outstanding=max_outstanding, max_batch=max_batch, concurrency=concurrency
        )

    async def close(self) -> None:
        self.opened = False
        self.lean = frozenset()
        await self.spare.release()
        await self.pool.close()

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
