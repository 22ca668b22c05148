"""A connection for an operator's command: refused unless the schema is this build's."""

from __future__ import annotations

import psycopg

from pepsi.config import Config
from pepsi.db import connect, schema


def open_current(
    config: Config, *, application_name: str = "pepsi"
) -> psycopg.Connection[tuple[object, ...]]:
    """An autocommit connection to the database in use (started if embedded).

    DatabaseUnavailable when it cannot be reached, SchemaMismatch (exit 78)
    when its schema is missing or another build's.
    """
    target = connect.resolve(config)
    conn = connect.connect(
        target.dsn, timeout=config.postgres.connect_timeout, application_name=application_name
    )
    try:
        schema.require_current(conn)
    except BaseException:
        conn.close()
        raise
    return conn
