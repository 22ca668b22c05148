"""Publishers: the sync `Publisher` and the async `AsyncPublisher`.

A publish is one round trip on a connection of the publisher's pool: one call
of `pepsi.workqueue_publish` in its own transaction (autocommit), committed
with synchronous_commit on before the call returns — the confirm. With
`connection=`, the call joins the caller's transaction instead (the outbox
pattern): the messages exist if and only if that transaction commits, and
their NOTIFY is delivered at that commit.

Lifecycle, as psycopg's pools: the constructor does no I/O; `open()`, a
`with`/`async with` block or the `connect()` class method opens the pool,
checks the schema and reads the overlay. Everything but the I/O (routes,
batches, errors) is in `_Core` and `batch.py`, shared by both sides; the
sync pipeline is the async one on an event loop thread (DESIGN §9).

Confirms with replication (Q-2, Q-3): `confirm_timeout=` bounds the wait for
the confirm by shutting the connection down, never by cancelling the
statement (`confirm.py`); `retry=` tries a publish again after a failure
that wrote nothing, or whose outcome is unknown when every message is
deduplicated (`retry.py` decides). A connection found broken drains the pool:
after a failover, no connection to the old primary is handed out again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from pepsi import telemetry
from pepsi.admin import serving
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
from pepsi.errors import (
    DatabaseLost,
    DatabaseReadOnly,
    DatabaseUnavailable,
    PepsiError,
    classify,
    one_line,
)
from pepsi.publishing import batch, pool_wait
from pepsi.publishing import retry as retrying
from pepsi.publishing.confirm import SAFE_AGAIN, ConfirmDeadline, SyncRepWatch
from pepsi.publishing.errors import NotConfirmed, NotOpen, PublishFailed, Rejected
from pepsi.publishing.message import OutgoingMessage
from pepsi.publishing.pipeline import Pipeline, SyncPipeline
from pepsi.publishing.retry import Retry

log = logging.getLogger("pepsi.publish")

REJECTED = "PP001"  # raised by pepsi.workqueue_publish when a stage is full
# psycopg_pool's own reconnect attempts double from 1 s for 5 minutes: after a
# failover the pool could wait many seconds after the new primary took writes.
# Its attempts give up after this instead, and a publish regrows it on demand
# at once (getconn on an empty pool connects).
POOL_RECONNECT_TIMEOUT = 0.5
# After a lost connection, a retried publish waits at most this long for the
# pool before it counts the attempt as "not written" and tries again: each
# try regrows the pool, so the new primary is found within about a second.
RECOVERY_WAIT = 0.5
AnyConn = psycopg.Connection[Any]
AnyAConn = psycopg.AsyncConnection[Any]
T = TypeVar("T")


def _message(stage: str | OutgoingMessage, body: Any, fields: dict[str, Any]) -> OutgoingMessage:
    """publish()'s arguments as one message: a stage and fields, or a message made already."""
    if isinstance(stage, OutgoingMessage):
        if body is not None or fields:
            raise TypeError(
                "publish(message) takes the message alone: put the body and fields in "
                "OutgoingMessage(...), or call publish(stage, body, **fields)"
            )
        return stage
    if not isinstance(stage, str):
        raise TypeError(
            f"publish() takes a stage name or an OutgoingMessage first, not {type(stage).__name__}"
        )
    if "recipients" in fields and fields["recipients"] is not None:
        recipients = fields["recipients"]
        if not isinstance(recipients, str | bytes):
            fields["recipients"] = tuple(recipients)
    return OutgoingMessage(stage, body, **fields)


def _log_retry(exc: PepsiError, pause: float) -> None:
    # INFO: the CLI shows it (`pepsi ingress --retry`); a library's caller sees it if it asks
    log.info("publish not done (%s); trying again in %.1fs", one_line(exc), pause)


def _domain(exc: psycopg.Error) -> PepsiError:
    """A database error outside the publish statement as a domain error (DESIGN §4)."""
    return classify(exc) or PublishFailed(f"publish failed: {one_line(exc)}", exc.sqlstate)


def _translate(exc: psycopg.Error) -> PepsiError:
    """An error of the publish statement: refused, unknown outcome, or the database's."""
    if exc.sqlstate == REJECTED:
        return Rejected(str(exc.diag.message_primary), exc.diag.message_detail)
    domain = _domain(exc)
    if isinstance(domain, DatabaseLost) and not isinstance(domain, DatabaseReadOnly):
        return NotConfirmed(f"connection lost before the confirm ({one_line(exc)}): {SAFE_AGAIN}")
    return domain


def _owns(conn: AnyConn | AnyAConn) -> bool:
    """Whether the publish statement is its own transaction (its commit is the confirm)."""
    return conn.autocommit and conn.info.transaction_status.name == "IDLE"


def _confirm_timeout(given: float | None, default: float | None) -> float | None:
    """A call's `confirm_timeout=`: None keeps the publisher's (None there: wait)."""
    value = default if given is None else given
    if value is not None and not value > 0:
        raise ValueError(f"confirm_timeout must be > 0 seconds or None, not {value!r}")
    return value


def _pool_options(config: Config, dsn: str) -> dict[str, Any]:
    """The publishers' pools: [pepsi-postgres] sizes; autocommit connections made as
    every program's are (CONNECT_TIMEOUT, application name: `pepsi.db.connect`)."""
    pg = config.postgres
    params = db_connect.connect_params(
        dsn, application_name="pepsi-publish", timeout=pg.connect_timeout
    )
    return {
        "min_size": pg.pool_min_size,
        "max_size": pg.pool_max_size,
        "kwargs": {"autocommit": True, **params},
        "timeout": pg.connect_timeout,
        "reconnect_timeout": POOL_RECONNECT_TIMEOUT,
        "open": False,
    }


def _require_schema(dsn: str, timeout: float) -> None:
    """A publisher's first connection: the schema is this build's, or one domain error."""
    try:
        with db_connect.connect(dsn, application_name="pepsi-publish", timeout=timeout) as c:
            schema.require_current(c)  # SchemaMismatch (78)
    except psycopg.Error as exc:
        raise _domain(exc) from exc


def _config(config: Config | Path | str | None) -> Config:
    if isinstance(config, Config):
        return config
    return load_config(Path(config) if config is not None else None)


class _Core:
    """What both publishers share: the routes (configuration + overlay) and the checks."""

    def __init__(
        self,
        config: Config,
        dsn: str,
        *,
        confirm_timeout: float | None = None,
        retry: Retry | bool = False,
    ) -> None:
        self.base = config
        self.current = config
        self.dsn = dsn
        self.opened = False
        self.confirm_timeout = _confirm_timeout(confirm_timeout, None)
        self.retry = retrying.policy(retry, None)
        self.recovering = False  # a connection was lost and none has worked since
        self.unserved: set[str] = set()  # stages the running dispatcher does not serve, unsaid

    def _note_served(self, served: tuple[int | None, frozenset[str] | None]) -> None:
        """At open: the configured stages the running dispatcher does not serve."""
        pid, serves = served
        stages = dict.fromkeys(self.base.stages, 1)
        self.unserved = {s for s, _ in serving.unserved(stages, serves, running=pid is not None)}

    def _warn_unserved(self, items: Sequence[OutgoingMessage]) -> None:
        """Once per stage: a publish to a stage the running dispatcher does not serve."""
        for stage in self.unserved & {m.stage for m in items}:
            self.unserved.discard(stage)
            log.warning(
                "publishing to stage %s, which the running dispatcher does not serve (its "
                "configuration has no [stage-%s]): the messages wait there",
                stage,
                stage,
            )

    def _options(
        self, confirm_timeout: float | None, retry: Retry | bool | None, connection: object
    ) -> tuple[float | None, Retry | None]:
        """A call's deadline and retry policy. On the caller's connection there is no
        retry (only the caller can run its work again), and in the caller's transaction
        no deadline either: the confirm is the caller's COMMIT."""
        timeout = _confirm_timeout(confirm_timeout, self.confirm_timeout)
        if connection is None:
            return timeout, retrying.policy(retry, self.retry)
        if retry:
            raise ValueError("retry= cannot be used with connection= (your connection, your retry)")
        return timeout, None

    def _pool_wait(self, remaining: float) -> float:
        """How long a retried attempt waits for a pool connection: within the deadline, and
        briefly after a lost connection (each new try makes the pool connect again)."""
        wait = min(self.base.postgres.connect_timeout, remaining)
        return min(wait, RECOVERY_WAIT) if self.recovering else wait

    def _lost(self, conn: AnyConn | AnyAConn, exc: BaseException) -> bool:
        """Whether `conn` failed as a failover leaves connections: broken, or on a standby."""
        return conn.broken or isinstance(classify(exc), DatabaseReadOnly)

    @property
    def config(self) -> Config:
        """The configuration with the database overlay, as last read."""
        return self.current

    def _apply(self, overlay: Sequence[OverlayRow]) -> None:
        self.current = with_overlay(self.base, overlay)

    def _needs_refresh(self, messages: Sequence[OutgoingMessage]) -> bool:
        return any(m.stage not in self.current.stages for m in messages)

    def _require_open(self) -> None:
        if not self.opened:
            name = type(self).__name__
            raise NotOpen(f"the {name} is not open: use {name}.connect(), open() or a with block")

    def _unreachable(self) -> DatabaseUnavailable:
        return DatabaseUnavailable(
            f"cannot connect to the database ({db_connect.redact(self.dsn)})"
        )


class Publisher(_Core):
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
        self.pool = ConnectionPool(dsn, **_pool_options(config, dsn))

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
        config = _config(config)
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
        _require_schema(self.dsn, timeout)
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
            raise _domain(exc) from exc
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
        return self.publish_many(
            [_message(stage, body, fields)],
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
            answer = self._run(connection, lambda conn: self._execute(conn, call, timeout))
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
                _log_retry(exc, pause)
            time.sleep(pause)

    def _attempt(
        self, items: list[OutgoingMessage], timeout: float | None, wait: float
    ) -> list[int]:
        """One try on a pool connection; a broken one drains the pool (a failover)."""
        self._require_open()
        lost = False
        try:
            with pool_wait.connection(self.pool, wait) as conn:
                try:
                    if self._needs_refresh(items):
                        self._refresh(conn)
                    call = batch.build(items, self.current)
                    answer = self._execute(conn, call, timeout)
                except BaseException as exc:
                    lost = self._lost(conn, exc)
                    raise
        except psycopg.Error as exc:
            self._failed(lost, exc)
            raise _domain(exc) from exc
        except DatabaseUnavailable as exc:
            self._failed(lost, exc)
            raise
        self.recovering = False
        return batch.ids_from(call, answer)

    def _failed(self, lost: bool, exc: BaseException) -> None:
        if classify(exc) is not None:
            self.recovering = True
        if lost:
            self.pool.drain()  # the others are likely on the old primary too

    def _run(self, connection: AnyConn | None, work: Callable[[AnyConn], T]) -> T:
        self._require_open()
        try:
            if connection is not None:
                return work(connection)
            with self.pool.connection() as conn:
                return work(conn)
        except psycopg.Error as exc:
            raise _domain(exc) from exc

    def _execute(
        self, conn: AnyConn, call: batch.BatchCall, timeout: float | None
    ) -> list[tuple[Any, ...]]:
        deadline: ConfirmDeadline | None = None
        try:
            if _owns(conn):
                cancelled = SyncRepWatch()
                conn.add_notice_handler(cancelled)
                timer: threading.Timer | None = None
                if timeout is not None:  # a thread that shuts the socket down, never a cancel
                    deadline = ConfirmDeadline(conn)
                    timer = threading.Timer(timeout, deadline.fire)
                    timer.daemon = True
                    timer.start()
                try:
                    answer = conn.execute(call.sql, call.params).fetchall()  # one round trip
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
            raise _translate(exc) from exc

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
        self.pool.close()

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncPublisher(_Core):
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
        self.pool = AsyncConnectionPool(dsn, **_pool_options(config, dsn))

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
        config = _config(config)
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
            raise _domain(exc) from exc
        except BaseException:
            await self.pool.close()
            raise
        self.opened = True

    def _require_schema(self, timeout: float) -> None:
        # The schema check is sync; one short connection, off the event loop.
        _require_schema(self.dsn, timeout)

    async def refresh(self) -> None:
        """Re-read the configuration overlay (stages added in the database)."""
        self._require_open()
        try:
            async with self.pool.connection() as conn:
                await self._refresh(conn)
        except psycopg.Error as exc:
            raise _domain(exc) from exc

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
        ids = await self.publish_many(
            [_message(stage, body, fields)],
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
                return await self._publish(connection, items, timeout)
            except psycopg.Error as exc:
                raise _domain(exc) from exc
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
                _log_retry(exc, pause)
            await asyncio.sleep(pause)

    async def _attempt(
        self, items: list[OutgoingMessage], timeout: float | None, wait: float
    ) -> list[int]:
        """One try on a pool connection; a broken one drains the pool (a failover)."""
        lost = False
        try:
            async with pool_wait.aconnection(self.pool, wait) as conn:
                try:
                    ids = await self._publish(conn, items, timeout)
                except BaseException as exc:
                    lost = self._lost(conn, exc)
                    raise
        except psycopg.Error as exc:
            await self._failed(lost, exc)
            raise _domain(exc) from exc
        except DatabaseUnavailable as exc:
            await self._failed(lost, exc)
            raise
        self.recovering = False
        return ids

    async def _failed(self, lost: bool, exc: BaseException) -> None:
        if classify(exc) is not None:
            self.recovering = True
        if lost:
            await self.pool.drain()  # the others are likely on the old primary too

    async def _publish(
        self, conn: AnyAConn, items: list[OutgoingMessage], timeout: float | None
    ) -> list[int]:
        if self._needs_refresh(items):
            await self._refresh(conn)
        call = batch.build(items, self.current)
        deadline: ConfirmDeadline | None = None
        try:
            if _owns(conn):
                cancelled = SyncRepWatch()
                conn.add_notice_handler(cancelled)
                timer: asyncio.TimerHandle | None = None
                if timeout is not None:  # shuts the socket down; never a cancel (see above)
                    deadline = ConfirmDeadline(conn)
                    timer = asyncio.get_running_loop().call_later(timeout, deadline.fire)
                try:
                    answer = await (await conn.execute(call.sql, call.params)).fetchall()
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
            raise _translate(exc) from exc
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
        await self.pool.close()

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
