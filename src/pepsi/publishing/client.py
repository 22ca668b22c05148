"""Publishers: the sync `Publisher`, the async `AsyncPublisher`, and `Pipeline`.

A publish is one round trip on a connection of the publisher's pool: one call
of `pepsi.workqueue_publish` in its own transaction (autocommit), committed
with synchronous_commit on before the call returns — the confirm. With
`connection=`, the call joins the caller's transaction instead (the outbox
pattern): the messages exist if and only if that transaction commits, and
their NOTIFY is delivered at that commit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from pepsi.config import (
    Config,
    OverlayRow,
    load_config,
    read_overlay,
    read_overlay_async,
    with_overlay,
)
from pepsi.db import connect as db_connect
from pepsi.db import schema
from pepsi.errors import DatabaseUnavailable
from pepsi.publishing import batch
from pepsi.publishing.errors import NotConfirmed, Rejected
from pepsi.publishing.message import OutgoingMessage

REJECTED = "PP001"  # raised by pepsi.workqueue_publish when a stage is full
AnyConn = psycopg.Connection[Any]
AnyAConn = psycopg.AsyncConnection[Any]


def _message(stage: str, body: Any, fields: dict[str, Any]) -> OutgoingMessage:
    if "recipients" in fields and fields["recipients"] is not None:
        recipients = fields["recipients"]
        if not isinstance(recipients, str | bytes):
            fields["recipients"] = tuple(recipients)
    return OutgoingMessage(stage, body, **fields)


def _require_schema(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        schema.require_current(conn)


def _translate(exc: psycopg.Error) -> Exception:
    if exc.sqlstate == REJECTED:
        return Rejected(str(exc.diag.message_primary), exc.diag.message_detail)
    if isinstance(exc, psycopg.OperationalError):
        return NotConfirmed(f"connection lost before the confirm: {db_connect.one_line(exc)}")
    return exc


def _pool_options(config: Config) -> dict[str, Any]:
    """The publishers' pools: [pepsi-postgres] sizes, autocommit connections."""
    pg = config.postgres
    return {
        "min_size": pg.pool_min_size,
        "max_size": pg.pool_max_size,
        "kwargs": {"autocommit": True, "application_name": "pepsi-publish"},
        "timeout": pg.connect_timeout,
        "open": False,
    }


class _Routes:
    """The configuration plus its database overlay, re-read on an unknown stage."""

    def __init__(self, config: Config) -> None:
        self.base = config
        self.current = config

    def apply(self, overlay: Sequence[OverlayRow]) -> None:
        self.current = with_overlay(self.base, overlay)

    def needs_refresh(self, messages: Sequence[OutgoingMessage]) -> bool:
        return any(m.stage not in self.current.stages for m in messages)


class Publisher:
    """Synchronous publisher over a small connection pool."""

    def __init__(self, config: Config, dsn: str) -> None:
        self.routes = _Routes(config)
        self.dsn = dsn
        pg = config.postgres
        self.pool = ConnectionPool(dsn, **_pool_options(config))
        try:
            self.pool.open(wait=True, timeout=pg.connect_timeout)
        except PoolTimeout:
            self.pool.close()
            raise DatabaseUnavailable(
                f"cannot connect to the database ({db_connect.redact(dsn)})"
            ) from None
        try:
            with self.pool.connection() as conn:
                schema.require_current(conn)  # SchemaMismatch (78), never a traceback
                self._refresh(conn)
        except BaseException:
            self.pool.close()
            raise

    @classmethod
    def connect(cls, config: Config | Path | str | None = None, dsn: str | None = None) -> Self:
        """A publisher for `config` (a Config, or a path; default locations if None)."""
        if not isinstance(config, Config):
            config = load_config(Path(config) if config is not None else None)
        return cls(config, dsn or db_connect.resolve(config).dsn)

    @property
    def config(self) -> Config:
        return self.routes.current

    def _refresh(self, conn: AnyConn) -> None:
        self.routes.apply(read_overlay(conn))

    def publish(
        self, stage: str, body: Any = None, *, connection: AnyConn | None = None, **fields: Any
    ) -> int:
        """Publish one message; return its id once confirmed. See OutgoingMessage."""
        return self.publish_many([_message(stage, body, fields)], connection=connection)[0]

    def publish_many(
        self, messages: Iterable[OutgoingMessage], *, connection: AnyConn | None = None
    ) -> list[int]:
        """Publish a batch: one transaction, one confirm, one NOTIFY."""
        items = list(messages)
        if not items:
            return []
        if self.routes.needs_refresh(items):
            self._with_connection(connection, self._refresh)
        call = batch.build(items, self.config)
        answer = self._with_connection(connection, lambda conn: self._execute(conn, call))
        return batch.ids_from(call, answer)

    def _with_connection(self, connection: AnyConn | None, work: Any) -> Any:
        if connection is not None:
            return work(connection)
        try:
            with self.pool.connection() as conn:
                return work(conn)
        except PoolTimeout:
            raise DatabaseUnavailable("no database connection available (pool timeout)") from None

    def _execute(self, conn: AnyConn, call: batch.BatchCall) -> list[tuple[Any, ...]]:
        try:
            if conn.autocommit and conn.info.transaction_status.name == "IDLE":
                return conn.execute(call.sql, call.params).fetchall()  # one round trip
            with conn.transaction():  # a savepoint in the caller's transaction
                return conn.execute(call.sql, call.params).fetchall()
        except psycopg.Error as exc:
            raise _translate(exc) from exc

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncPublisher:
    """Asynchronous publisher over a small connection pool; see `Publisher`."""

    def __init__(self, config: Config, dsn: str) -> None:
        self.routes = _Routes(config)
        self.dsn = dsn
        self.pool = AsyncConnectionPool(dsn, **_pool_options(config))

    @classmethod
    async def connect(
        cls, config: Config | Path | str | None = None, dsn: str | None = None
    ) -> Self:
        if not isinstance(config, Config):
            config = load_config(Path(config) if config is not None else None)
        if dsn is None:
            dsn = (await asyncio.to_thread(db_connect.resolve, config)).dsn
        publisher = cls(config, dsn)
        await publisher.open()
        return publisher

    async def open(self) -> None:
        timeout = self.routes.base.postgres.connect_timeout
        try:
            await self.pool.open(wait=True, timeout=timeout)
        except PoolTimeout:
            await self.pool.close()
            raise DatabaseUnavailable(
                f"cannot connect to the database ({db_connect.redact(self.dsn)})"
            ) from None
        try:
            async with self.pool.connection() as conn:
                await asyncio.to_thread(_require_schema, self.dsn)
                await self._refresh(conn)
        except BaseException:
            await self.pool.close()
            raise

    @property
    def config(self) -> Config:
        return self.routes.current

    async def refresh(self) -> None:
        """Re-read the configuration overlay (stages added in the database)."""
        async with self.pool.connection() as conn:
            await self._refresh(conn)

    async def _refresh(self, conn: AnyAConn) -> None:
        self.routes.apply(await read_overlay_async(conn))

    async def publish(
        self, stage: str, body: Any = None, *, connection: AnyAConn | None = None, **fields: Any
    ) -> int:
        ids = await self.publish_many([_message(stage, body, fields)], connection=connection)
        return ids[0]

    async def publish_many(
        self, messages: Iterable[OutgoingMessage], *, connection: AnyAConn | None = None
    ) -> list[int]:
        items = list(messages)
        if not items:
            return []
        if self.routes.needs_refresh(items):
            if connection is not None:
                await self._refresh(connection)
            else:
                async with self.pool.connection() as conn:
                    await self._refresh(conn)
        call = batch.build(items, self.config)
        if connection is not None:
            answer = await self._execute(connection, call)
        else:
            try:
                async with self.pool.connection() as conn:
                    answer = await self._execute(conn, call)
            except PoolTimeout:
                raise DatabaseUnavailable(
                    "no database connection available (pool timeout)"
                ) from None
        return batch.ids_from(call, answer)

    async def _execute(self, conn: AnyAConn, call: batch.BatchCall) -> list[tuple[Any, ...]]:
        try:
            if conn.autocommit and conn.info.transaction_status.name == "IDLE":
                return await (await conn.execute(call.sql, call.params)).fetchall()
            async with conn.transaction():
                return await (await conn.execute(call.sql, call.params)).fetchall()
        except psycopg.Error as exc:
            raise _translate(exc) from exc

    def pipeline(
        self, *, max_outstanding: int = 1000, max_batch: int = 500, concurrency: int = 2
    ) -> Pipeline:
        return Pipeline(
            self, max_outstanding=max_outstanding, max_batch=max_batch, concurrency=concurrency
        )

    async def close(self) -> None:
        await self.pool.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class Pipeline:
    """Pipelined publishing with a bound on unconfirmed messages.

    `submit()` validates the message and returns a future of its id at once;
    it waits only while `max_outstanding` messages are unconfirmed (RabbitMQ's
    outstanding-confirms limiter). Sender tasks gather what is queued into
    batches of up to `max_batch`, one transaction each, on `concurrency`
    connections. A batch that is refused fails the futures of its messages.
    """

    def __init__(
        self, publisher: AsyncPublisher, *, max_outstanding: int, max_batch: int, concurrency: int
    ) -> None:
        if max_outstanding < 1 or max_batch < 1 or concurrency < 1:
            raise ValueError("max_outstanding, max_batch and concurrency must be at least 1")
        self.publisher = publisher
        self.max_batch = max_batch
        self.slots = asyncio.Semaphore(max_outstanding)
        self.queue: asyncio.Queue[tuple[OutgoingMessage, asyncio.Future[int]]] = asyncio.Queue()
        self.senders = [asyncio.create_task(self._send()) for _ in range(concurrency)]
        self.outstanding: set[asyncio.Future[int]] = set()

    async def submit(self, message: OutgoingMessage) -> asyncio.Future[int]:
        if message.stage not in self.publisher.config.stages:
            await self.publisher.refresh()  # a stage added to the overlay since
        batch.build([message], self.publisher.config)  # refuse a bad message now, not later
        await self.slots.acquire()
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.outstanding.add(future)
        future.add_done_callback(self._settled)
        self.queue.put_nowait((message, future))
        return future

    def _settled(self, future: asyncio.Future[int]) -> None:
        self.outstanding.discard(future)
        self.slots.release()

    async def _send(self) -> None:
        while True:
            items = [await self.queue.get()]
            while len(items) < self.max_batch and not self.queue.empty():
                items.append(self.queue.get_nowait())
            try:
                ids = await self.publisher.publish_many([m for m, _ in items])
            except Exception as exc:  # noqa: BLE001  # each future carries its batch's refusal
                for _, future in items:
                    if not future.done():
                        future.set_exception(exc)
            else:
                for (_, future), wid in zip(items, ids, strict=True):
                    if not future.done():
                        future.set_result(wid)

    async def flush(self) -> None:
        """Wait until every submitted message is confirmed or refused."""
        if self.outstanding:
            await asyncio.wait(list(self.outstanding))

    async def close(self) -> None:
        await self.flush()
        for task in self.senders:
            task.cancel()
        for task in self.senders:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
