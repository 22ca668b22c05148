"""The database in use, for `pepsi db`: embedded or given by a DSN, its server, schema, queue."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pepsi.admin.queue import count_by_stage_status
from pepsi.config import Config
from pepsi.db import connect, schema
from pepsi.db.embedded import EmbeddedServer
from pepsi.db.queries import query
from pepsi.errors import NotEmbedded


@dataclass(frozen=True)
class DatabaseStatus:
    source: str  # "embedded server in DIR (running, pid N)", "$PEPSI_DSN", ...
    running: bool  # False: the embedded server is stopped, and nothing more was read
    url: str | None = None  # without its password
    server_version: str | None = None
    schema: schema.SchemaCheck | None = None
    queue: Mapping[str, Mapping[str, int]] | None = None  # read only with the current schema


def embedded_server(config: Config, action: str) -> EmbeddedServer:
    """The embedded server, for `action`; refused when a DSN is configured."""
    dsn = connect.configured_dsn(config)
    if dsn:
        raise NotEmbedded(
            f"cannot {action} the embedded server: a DSN is configured "
            f"({connect.Target(dsn, None).source}), so Pepsi uses that server"
        )
    return EmbeddedServer(config.postgres.data_dir)


def database_status(config: Config) -> DatabaseStatus:
    """What `pepsi db status` shows; never starts the embedded server."""
    dsn = connect.configured_dsn(config)
    if dsn is None:
        server = EmbeddedServer(config.postgres.data_dir)
        status = server.status()
        state = f"running, pid {status.pid}" if status.running else "stopped"
        source = f"embedded server in {status.data_dir} ({state})"
        if not status.running:
            return DatabaseStatus(source, running=False)
        dsn = server.uri()
        assert dsn is not None
    else:
        source = connect.Target(dsn, None).source
    with connect.connect(
        dsn, timeout=config.postgres.connect_timeout, application_name="pepsi-db"
    ) as conn:
        version = conn.execute(query("server_version")).fetchone()
        check = schema.check(conn)
        current = check.state is schema.SchemaState.CURRENT
        queue = count_by_stage_status(conn) if current else None
    return DatabaseStatus(
        source=source,
        running=True,
        url=connect.redact(dsn),
        server_version=None if version is None else str(version[0]),
        schema=check,
        queue=queue,
    )
