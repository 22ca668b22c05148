"""The synchronous `Publisher`: blocking calls on a `psycopg_pool.ConnectionPool`.

The routes, options and errors are `client_core.py`'s, as the async side's;
what is here is the blocking I/O: the pool, the confirm deadline on a timer
thread, and retries that sleep. Its pipeline is the async one on an event
loop thread of its own (`pipeline.SyncPipeline`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar
from weakref import WeakKeyDictionary

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from pepsi import telemetry
from pepsi.admin import serving
from pepsi.config import Config, read_overlay
from pepsi.db import connect as db_connect
from pepsi.errors import DatabaseUnavailable, PepsiError, classify
from pepsi.publishing import batch, pool_wait, single
from pepsi.publishing import retry as retrying
from pepsi.publishing.async_client import AsyncPublisher
from pepsi.publishing.client_core import (
    AnyConn,
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
from pepsi.publishing.pipeline import SyncPipeline
from pepsi.publishing.retry import Retry

T = TypeVar("T")


class Publisher(PublisherCore):
    """Synchronous publisher over a small connection pool.

    `confirm_timeout` (seconds, None: wait) and `retry` (a `Retry`, True for
    the defaults) are the defaults of every publish call; see `publish_many`.
    """

    def __init__(
        self,
        config: Config,
        dsn: str,
        *,
        confirm_timeout: float | None = None,
        retry: Retry | bool = False,
    ) -> None:
        super().__init__(config, dsn, confirm_timeout=confirm_timeout, retry=retry)
        self.pool = ConnectionPool(dsn, **pool_options(config, dsn))
        self.spare = pool_wait.Spare(self.pool)
        self.cursors: WeakKeyDictionary[AnyConn, psycopg.Cursor[Any]] = WeakKeyDictionary()

    @classmethod
    def connect(
        cls,
        config: Config | Path | str | None = None,
        dsn: str | None = None,
        *,
        confirm_timeout: float | None = None,
        retry: Retry | bool = False,
    ) -> Self:
        """An open publisher for `config` (a Config, or a path; default locations if None)."""
        config = config_of(config)
        publisher = cls(
            config,
            dsn or db_connect.resolve(config).dsn,
            confirm_timeout=confirm_timeout,
            retry=retry,
        )
        publisher.open()
        return publisher

    def open(self) -> None:
        """Open the pool, check the schema, read the overlay (nothing if already open)."""
        if self.opened:
            return
        timeout = self.base.postgres.connect_timeout
        # One direct connection first: a refusal is one line at once, where the
        # pool would retry until CONNECT_TIMEOUT; SchemaMismatch (78) likewise.
        require_schema(self.dsn, timeout)
        try:
            self.pool.open(wait=True, timeout=timeout)
        except PoolTimeout:
            self.pool.close()
            raise self._unreachable() from None
        try:
            with self.pool.connection() as conn:
                self._refresh(conn)
                self._note_served(serving.served(conn))
        except psycopg.Error as exc:
            self.pool.close()
            raise domain_error(exc) from exc
        except BaseException:
            self.pool.close()
            raise
        self.opened = True

    def refresh(self) -> None:
        """Re-read the configuration overlay (stages added in the database)."""
        self._run(None, self._refresh)

    def _refresh(self, conn: AnyConn) -> None:
        self._apply(read_overlay(conn))

    def publish(
        self,
        stage: str | OutgoingMessage,
        body: Any = None,
        *,
        connection: AnyConn | None = None,
        confirm_timeout: float | None = None,
        retry: Retry | bool | None = None,
        **fields: Any,
    ) -> int:
        """Publish one message; return its id once confirmed. `stage` and the fields of
        OutgoingMessage, or an OutgoingMessage alone."""
        if self._lean(stage, fields, connection, confirm_timeout, retry):
            call = batch.single(stage, body, self.current)  # the same checks, the same call
            return self._attempt(None, self.confirm_timeout, self.pool.timeout, call)[0]
        return self.publish_many(
            [as_message(stage, body, fields)],
            connection=connection,
            confirm_timeout=confirm_timeout,
            retry=retry,
        )[0]

    def publish_many(
        self,
        messages: Iterable[OutgoingMessage],
        *,
        connection: AnyConn | None = None,
        confirm_timeout: float | None = None,
        retry: Retry | bool | None = None,
    ) -> list[int]:
        """Publish a batch: one transaction, one confirm, one NOTIFY.

        `confirm_timeout`: seconds to wait for the confirm, then NotConfirmed
        (None: the publisher's). `retry`: a Retry, True (defaults) or False
        (None: the publisher's); messages without a message id get one, with
        dedup=True, so that a retry cannot publish them twice.
        """
        items = list(messages)
        if not items:
            return []
        if self.unserved:
            self._warn_unserved(items)
        timeout, rule = self._options(confirm_timeout, retry, connection)
        if rule is not None:
            items = retrying.idempotent(items)
        if self.base.pepsi.share_telemetry:  # P-11: a publish span, its context in each message
            with telemetry.for_publisher(self.base).publish(items) as traced:
                return self._publish(traced, connection, timeout, rule)
        return self._publish(items, connection, timeout, rule)

    def _publish(
        self,
        items: list[OutgoingMessage],
        connection: AnyConn | None,
        timeout: float | None,
        rule: Retry | None,
    ) -> list[int]:
        if connection is not None:
            if self._needs_refresh(items):
                self._run(connection, self._refresh)
            call = batch.build(items, self.current)
            answer = self._run(
                connection, lambda conn: self._execute(conn, call, timeout, pooled=False)
            )
            return batch.ids_from(call, answer)
        if rule is None:
            return self._attempt(items, timeout, self.pool.timeout)
        tries = retrying.Attempts(rule, idempotent=retrying.all_deduplicated(items))
        while True:
            tries.begin()
            try:
                return self._attempt(items, timeout, self._pool_wait(tries.remaining()))
            except PepsiError as exc:
                pause = tries.failed(exc)
                if pause is None:
                    raise
                log_retry(exc, pause)
            time.sleep(pause)

    def _attempt(
        self,
        items: list[OutgoingMessage] | None,
        timeout: float | None,
        wait: float,
        call: batch.BatchCall | None = None,
    ) -> list[int]:
        """One try on a pool connection; a broken one drains the pool (a failover).
        `items`, or their `call` made already (then `items` is None)."""
        self._require_open()
        lost = False
        try:
            conn = self.spare.take(wait)
            try:
                if call is None:
                    assert items is not None
                    if self._needs_refresh(items):
                        self._refresh(conn)
                    call = batch.build(items, self.current)
                answer = self._execute(conn, call, timeout, pooled=True)
            except BaseException as exc:
                lost = self._lost(conn, exc)
                self.pool.putconn(conn)
                raise
            self.spare.give(conn)
        except psycopg.Error as exc:
            self._failed(lost, exc)
            raise domain_error(exc) from exc
        except DatabaseUnavailable as exc:
            self._failed(lost, exc)
            raise
        self.recovering = False
        return batch.ids_from(call, answer)

    def _cursor(self, conn: AnyConn) -> psycopg.Cursor[Any]:
        cursor = self.cursors.get(conn)
        if cursor is None:
            cursor = self.cursors[conn] = conn.cursor()
        return cursor

    def _failed(self, lost: bool, exc: BaseException) -> None:
        if classify(exc) is not None:
            self.recovering = True
        if lost:
            self.spare.release()
            self.pool.drain()  # the others are likely on the old primary too

    def _run(self, connection: AnyConn | None, work: Callable[[AnyConn], T]) -> T:
        self._require_open()
        try:
            if connection is not None:
                return work(connection)
            with self.pool.connection() as conn:
                return work(conn)
        except psycopg.Error as exc:
            raise domain_error(exc) from exc

    def _execute(
        self, conn: AnyConn, call: batch.BatchCall, timeout: float | None, *, pooled: bool
    ) -> list[tuple[Any, ...]]:
        """`call` on `conn`: its own transaction (a pool's connection, or the caller's
        in autocommit), or a savepoint in the caller's. Only a pool's connection gets
        the single publish's prepared statement (`single.py`): a caller's session is
        left as it was."""
        deadline: ConfirmDeadline | None = None
        try:
            if owns_transaction(conn):
                cancelled = SyncRepWatch()
                conn.add_notice_handler(cancelled)
                timer: threading.Timer | None = None
                if timeout is not None:  # a thread that shuts the socket down, never a cancel
                    deadline = ConfirmDeadline(conn)
                    timer = threading.Timer(timeout, deadline.fire)
                    timer.daemon = True
                    timer.start()
                try:  # one round trip: a single message by libpq, others on the pooled
                    if pooled and call.sql is batch.ONE_SQL:  # connection's own cursor
                        answer: list[tuple[Any, ...]] = single.publish(conn, call.params)
                    else:  # (a new one costs 3 to 6 µs)
                        cursor = self._cursor(conn) if pooled else conn.cursor()
                        answer = cursor.execute(call.sql, call.params).fetchall()
                finally:
                    conn.remove_notice_handler(cancelled)
                    if deadline is not None and timer is not None:
                        deadline.finish()
                        timer.cancel()
                if deadline is not None and deadline.fired:  # the answer won the race
                    conn.close()  # its socket is shut: the pool must not hand it out again
                cancelled.check()
                return answer
            with conn.transaction():  # a savepoint in the caller's transaction
                return conn.execute(call.sql, call.params).fetchall()
        except psycopg.Error as exc:
            if deadline is not None and deadline.fired:
                conn.close()
                assert timeout is not None
                raise ConfirmDeadline.error(timeout) from exc
            raise publish_error(exc) from exc

    def pipeline(
        self, *, max_outstanding: int = 1000, max_batch: int = 500, concurrency: int = 2
    ) -> SyncPipeline:
        """Pipelined publishing: the async pipeline on an event loop thread of its own."""
        self._require_open()
        return SyncPipeline(
            lambda: AsyncPublisher(
                self.base, self.dsn, confirm_timeout=self.confirm_timeout, retry=self.retry or False
            ),
            max_outstanding=max_outstanding,
            max_batch=max_batch,
            concurrency=concurrency,
        )

    def close(self) -> None:
        self.opened = False
        self.lean = frozenset()
        self.spare.release()
        self.pool.close()

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
