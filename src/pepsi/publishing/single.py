"""A single publish on a pool connection, sent by libpq itself.

psycopg's cursor makes every execute a query conversion, a dump of the
parameters through its adapters, a look-up of its prepared statements and
a result loaded row by row: about 25 µs of client CPU a call, as much as
the rest of a single publish's Python. Here `workqueue_publish_one` is
prepared once on each connection under a name of its own, and a publish is
one Bind/Execute/Sync of its three parameters as they are, in binary (a
stage name is ASCII, checked by the configuration; the header block and
the body are bytes) and an 8-byte id back. Errors are psycopg's own,
made from the result (SQLSTATE, diagnostics) or raised by its wait, so
the callers treat them as any other; notices reach the connection's
handlers as ever (`confirm.SyncRepWatch`).
"""

from __future__ import annotations

from typing import Any
from weakref import WeakSet

import psycopg
from psycopg import errors, generators, pq

from pepsi.db.queries import query_text

NAME = b"pepsi_publish_one"
SQL = query_text("workqueue_publish_one_prepared").encode()
BINARY = (pq.Format.BINARY,) * 3
GONE = "26000"  # invalid_sql_statement_name: the statement was deallocated (DISCARD ALL)

Conn = psycopg.Connection[Any]
AConn = psycopg.AsyncConnection[Any]
Params = tuple[str, bytes | None, bytes | None]

_ready: WeakSet[Conn | AConn] = WeakSet()  # the connections NAME is prepared on


def publish(conn: Conn, params: Params) -> list[tuple[int]]:
    """`workqueue_publish_one(*params)` on `conn` (autocommit, idle): its one row."""
    pg = conn.pgconn
    values = _values(params)
    with conn.lock:
        if conn not in _ready:
            _check(conn, conn.wait(_prepare(pg)))
            _ready.add(conn)
        try:
            return _row(conn, conn.wait(_execute(pg, values)))
        except errors.Error as exc:
            if exc.sqlstate != GONE:
                raise
            _check(conn, conn.wait(_prepare(pg)))  # nothing ran: prepare it again, once
            return _row(conn, conn.wait(_execute(pg, values)))


async def apublish(conn: AConn, params: Params) -> list[tuple[int]]:
    """The async `publish()`."""
    pg = conn.pgconn
    values = _values(params)
    async with conn.lock:
        if conn not in _ready:
            _check(conn, await conn.wait(_prepare(pg)))
            _ready.add(conn)
        try:
            return _row(conn, await conn.wait(_execute(pg, values)))
        except errors.Error as exc:
            if exc.sqlstate != GONE:
                raise
            _check(conn, await conn.wait(_prepare(pg)))
            return _row(conn, await conn.wait(_execute(pg, values)))


def _values(params: Params) -> tuple[bytes, bytes | None, bytes | None]:
    stage, header, body = params
    return stage.encode(), header, body


def _prepare(pg: pq.abc.PGconn) -> Any:
    pg.send_prepare(NAME, SQL)
    return generators.execute(pg)


def _execute(pg: pq.abc.PGconn, values: tuple[bytes, bytes | None, bytes | None]) -> Any:
    pg.send_query_prepared(NAME, values, BINARY, pq.Format.BINARY)
    return generators.execute(pg)


def _check(conn: Conn | AConn, results: list[pq.abc.PGresult]) -> pq.abc.PGresult:
    result = results[-1]
    if result.status == pq.ExecStatus.FATAL_ERROR:
        raise errors.error_from_result(result, encoding=conn.info.encoding)
    return result


def _row(conn: Conn | AConn, results: list[pq.abc.PGresult]) -> list[tuple[int]]:
    value = _check(conn, results).get_value(0, 0)
    assert value is not None  # the function returns the new row's id
    return [(int.from_bytes(value, "big", signed=True),)]
