"""A publisher's pool connection, through a database outage.

Two gaps of psycopg_pool, each measured with a real server stopped for 5.8 s:

- A connection the server closed while it sat in the pool (a restart, a
  failover, an idle timeout) was handed out as good: the first publish after
  the server came back failed with NotConfirmed. `take()` polls the
  socket of what the pool gives: an idle connection has nothing to read unless
  the server said goodbye (its FATAL message, or EOF). No round trip, a few
  µs; such a connection is closed (the pool replaces it) and the next one
  asked for at once (the pool's own `check` would sleep before that).
- psycopg_pool replaces a lost connection for `reconnect_timeout`, then gives
  up until a client asks again; a client already waiting then waited its
  whole timeout (CONNECT_TIMEOUT, 10 s) even after the server was back, and
  got DatabaseBusy. `take()` asks again every SLICE seconds, so each
  ask makes the pool try to connect, and a waiting publish goes on within
  about a second of the server's return.

And one cost: the pool's own taking and giving back is about 15 µs of a
single publish's client CPU; `Spare` keeps the last connection for the next
publish (see there).
"""

from __future__ import annotations

import select
import time
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

SLICE = 0.5  # seconds a client waits for the pool before it asks again

Conn = psycopg.Connection[Any]
AConn = psycopg.AsyncConnection[Any]


def said_goodbye(conn: Conn | AConn) -> bool:
    """Whether an idle connection is closed, or has something to read (the server's end)."""
    if conn.closed:
        return True
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return bool(poller.poll(0))


def take(pool: ConnectionPool[Any], timeout: float) -> Conn:
    """`pool.getconn(timeout)`, asking again every SLICE seconds, and never a connection
    the server ended; PoolTimeout at the end. The caller gives it back with `putconn`
    (no `with conn:` either: the pool's own reset does what its exit would)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn: Conn = pool.getconn(timeout=_slice(deadline))
        except PoolTimeout:
            if time.monotonic() >= deadline:
                raise
            continue
        if not said_goodbye(conn):
            return conn
        conn.close()
        pool.putconn(conn)  # closed: the pool makes a new one


async def atake(pool: AsyncConnectionPool[Any], timeout: float) -> AConn:
    """The async `take()`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn: AConn = await pool.getconn(timeout=_slice(deadline))
        except PoolTimeout:
            if time.monotonic() >= deadline:
                raise
            continue
        if not said_goodbye(conn):
            return conn
        await conn.close()
        await pool.putconn(conn)  # closed: the pool makes a new one


def _slice(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise PoolTimeout("no connection from the pool in time")
    return min(SLICE, left)


SPARE_SECONDS = 1.0  # a spare goes back to the pool at least this often (its checks apply)


class Spare:
    """The last connection a publish gave back, kept out of the pool for the next one.

    Taking a connection from psycopg_pool and giving it back cost a single
    publish about 15 µs of client CPU (its lock, statistics, logging and
    checks: a tenth of the publish). A connection given back after a publish
    that worked waits here instead and the next publish takes it first, after
    the same goodbye check as a pooled one. It goes back to the pool at least
    every SPARE_SECONDS (the pool's lifetime and drain apply to it), on
    `release()` (drain, close) and always when the pool has one connection
    only (a client waiting in the pool would not see it here).
    """

    def __init__(self, pool: ConnectionPool[Any]) -> None:
        self.pool = pool
        self.keep = pool.max_size > 1
        self.held: list[Conn] = []  # list.pop and .append are atomic: no lock
        self.due = 0.0

    def take(self, timeout: float) -> Conn:
        """The spare if it is still good, else `take(pool, timeout)`."""
        try:
            conn = self.held.pop()
        except IndexError:
            return take(self.pool, timeout)
        if said_goodbye(conn):
            conn.close()
            self.pool.putconn(conn)  # closed: the pool makes a new one
            return take(self.pool, timeout)
        return conn

    def give(self, conn: Conn) -> None:
        """Back after a publish that worked: the spare, or the pool's."""
        now = time.monotonic()
        if self.keep and not self.held and now < self.due and not conn.closed:
            self.held.append(conn)
        else:
            self.due = now + SPARE_SECONDS
            self.pool.putconn(conn)

    def release(self) -> None:
        while self.held:
            self.pool.putconn(self.held.pop())


class ASpare:
    """The async `Spare` (one event loop: no two tasks between a check and its use)."""

    def __init__(self, pool: AsyncConnectionPool[Any]) -> None:
        self.pool = pool
        self.keep = pool.max_size > 1
        self.held: list[AConn] = []
        self.due = 0.0

    async def take(self, timeout: float) -> AConn:
        if self.held:
            conn = self.held.pop()
            if not said_goodbye(conn):
                return conn
            await conn.close()
            await self.pool.putconn(conn)
        return await atake(self.pool, timeout)

    async def give(self, conn: AConn) -> None:
        now = time.monotonic()
        if self.keep and not self.held and now < self.due and not conn.closed:
            self.held.append(conn)
        else:
            self.due = now + SPARE_SECONDS
            await self.pool.putconn(conn)

    async def release(self) -> None:
        while self.held:
            await self.pool.putconn(self.held.pop())
