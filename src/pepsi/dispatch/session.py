"""The dispatcher's session: its claim connection, the singleton lock, reconnects.

Exactly one dispatcher claims on a database (P-1): the claim connection holds
a session advisory lock for its whole life, and losing the connection loses
the lock. A second dispatcher waits LOCK_WAIT for it, then gives up naming
the holder. After a reconnect the lock is taken again and the rows left
running that no worker holds go back to pending (P-2): a claim whose answer
was lost with the connection committed rows no worker was given.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from pepsi.config import Config
from pepsi.db import schema
from pepsi.db.backoff import Backoff
from pepsi.db.connect import connect as connect_sync
from pepsi.db.connect import connect_async
from pepsi.db.queries import query
from pepsi.durations import format_seconds
from pepsi.errors import AlreadyRunning, DatabaseUnavailable, classify

log = logging.getLogger("pepsi.dispatch")
AConn = psycopg.AsyncConnection[tuple[Any, ...]]

LOCK_RETRY = 0.5  # seconds between tries for a held lock


class StopRequested(Exception):
    """The dispatcher was asked to stop while it waited for the lock."""


@dataclass(frozen=True)
class SessionOptions:
    dsn: str
    connect_timeout: float
    lock_wait: float  # LOCK_WAIT
    reconnect_max: float  # RECONNECT_MAX_DELAY
    lock_retry: float = LOCK_RETRY

    @property
    def backoff(self) -> Backoff:
        """The reconnect delays: from 0.1 s, jittered, doubling up to RECONNECT_MAX_DELAY."""
        return Backoff(self.reconnect_max)

    @classmethod
    def from_config(cls, config: Config, dsn: str) -> SessionOptions:
        return cls(
            dsn,
            config.postgres.connect_timeout,
            config.dispatch.lock_wait,
            config.dispatch.reconnect_max_delay,
        )


async def connect(dsn: str, application_name: str, timeout: float) -> AConn:
    """One of the dispatcher's connections (autocommit); DatabaseUnavailable if refused."""
    return await connect_async(dsn, application_name=application_name, timeout=timeout)


class Session:
    def __init__(
        self,
        options: SessionOptions,
        stopping: Callable[[], bool],
        clock: Callable[[], float],
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.options = options
        self.stopping = stopping
        self.clock = clock
        self.rng = rng  # the backoff's jitter
        self.conn: AConn | None = None

    async def open(self) -> AConn:
        """Connect and take the lock at start; AlreadyRunning if another keeps it."""
        self.conn = await self._connect_locked(initial=True)
        return self.conn

    async def start_checks(self, stage_names: list[str]) -> None:
        """The schema is this build's (P-13); leftover running rows go back (P-2)."""
        assert self.conn is not None
        await asyncio.to_thread(_require_schema, self.options.dsn, self.options.connect_timeout)
        cur = await self.conn.execute(query("workqueue_reset_running"))
        if cur.rowcount:
            log.warning("reset %d leftover running rows to pending (P-2)", cur.rowcount)
        await self.record_stages(stage_names)
        log.info("dispatching %d stages: %s", len(stage_names), ", ".join(stage_names) or "(none)")

    async def record_stages(self, stage_names: list[str]) -> None:
        """Say which stages this dispatcher serves (pepsi.admin.serving reads it)."""
        assert self.conn is not None
        await self.conn.execute(query("dispatch_serves_set"), {"stages": stage_names})

    async def reconnect(self, restore: Callable[[AConn], Awaitable[None]]) -> bool:
        """Reconnect and re-lock, backing off; `restore` runs on the new connection.

        False if the dispatcher was asked to stop meanwhile.
        """
        await self.close()
        delays = self.options.backoff.delays(self.rng)
        while not self.stopping():
            try:
                self.conn = await self._connect_locked(initial=False)
                await restore(self.conn)
                log.info("database connection restored")
                return True
            except StopRequested:
                return False
            except (DatabaseUnavailable, psycopg.Error) as exc:
                error = classify(exc)
                if error is None:  # not the connection's fault: a bug, not a retry
                    raise
                delay = next(delays)
                log.warning("%s; retrying in %s", error, format_seconds(delay))
            await self.close()  # a connection that failed its restore is not kept
            await asyncio.sleep(delay)
        return False

    async def reset_orphans(self, held: list[int]) -> None:
        """Rows left running that no worker (nor the row writer) holds go back to pending."""
        assert self.conn is not None
        cur = await self.conn.execute(query("workqueue_reset_running_except"), {"held": held})
        if cur.rowcount:
            log.warning("reset %d claimed rows no worker holds to pending", cur.rowcount)

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.close()
            self.conn = None

    async def _connect_locked(self, *, initial: bool) -> AConn:
        options = self.options
        conn = await connect(options.dsn, "pepsi-dispatch", options.connect_timeout)
        deadline = self.clock() + options.lock_wait
        announced = False
        while True:
            row = await (await conn.execute(query("dispatcher_lock_try"))).fetchone()
            if row and row[0]:
                return conn
            if not announced and initial:
                log.warning(
                    "another dispatcher holds the lock; waiting up to %gs", options.lock_wait
                )
                announced = True
            if self.stopping():
                await conn.close()
                raise StopRequested
            if self.clock() >= deadline:
                holder = await (await conn.execute(query("dispatcher_lock_holder"))).fetchone()
                await conn.close()
                raise AlreadyRunning(_holder_text(holder, options.lock_wait))
            await asyncio.sleep(options.lock_retry)


def _require_schema(dsn: str, timeout: float) -> None:
    """The start-up schema check (P-13), on a short-lived sync connection."""
    with connect_sync(dsn, application_name="pepsi-dispatch", timeout=timeout) as conn:
        schema.require_current(conn)


def _holder_text(row: tuple[Any, ...] | None, waited: float) -> str:
    if row is None:
        return f"another dispatcher is running on this database (lock held for {waited:g}s)"
    pid, addr, host, app, _since = row
    where = host or addr or "local socket"
    return (
        f"another dispatcher is running on this database "
        f"(backend pid {pid}, client {where}, {app or 'unknown program'})"
    )
