"""The database roles of least privilege: `pepsi_publisher` and `pepsi_worker` (issue 34).

`install` creates them (once per server) and grants them what they need in this
database; `regrant` grants again after a schema upgrade, if they exist. The SQL is
in `pepsi/sql/roles.sql`; docs/security.md says who should log in as what.
"""

from __future__ import annotations

from functools import cache

import psycopg
from psycopg import sql

from pepsi.db.queries import parse_named, sql_text
from pepsi.errors import PepsiError

PUBLISHER = "pepsi_publisher"
WORKER = "pepsi_worker"


@cache
def _queries() -> dict[str, str]:
    return parse_named(sql_text("roles.sql"))


def _run(conn: psycopg.Connection[tuple[object, ...]], name: str) -> None:
    conn.execute(sql.SQL(_queries()[name]))


def exist(conn: psycopg.Connection[tuple[object, ...]]) -> bool:
    row = conn.execute(sql.SQL(_queries()["roles_exist"])).fetchone()
    return bool(row and row[0])


def install(conn: psycopg.Connection[tuple[object, ...]]) -> str:
    """Create the roles if missing, and grant them their privileges in this database."""
    try:
        with conn.transaction():
            _run(conn, "roles_create")
        with conn.transaction():
            _run(conn, "roles_grant")
    except psycopg.errors.InsufficientPrivilege as exc:
        raise PepsiError(
            f"cannot create or grant the roles: {exc.diag.message_primary} (run "
            "`pepsi setup roles` as the schema's owner, with CREATEROLE)"
        ) from exc
    return (
        f"roles {PUBLISHER} and {WORKER} ready: make login roles members of them, e.g. "
        f"CREATE ROLE shop LOGIN PASSWORD '…' IN ROLE {PUBLISHER}"
    )


def regrant(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    """After an install or upgrade: the roles' privileges on what it added, if they exist."""
    if exist(conn):
        _run(conn, "roles_grant")
