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
