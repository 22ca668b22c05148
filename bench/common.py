"""Shared by the benchmarks: a scratch database on the embedded (or $PEPSI_DSN) server,
and a process's CPU."""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
from psycopg import conninfo, sql

from pepsi.config import load_config
from pepsi.db import connect, schema

TICK = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """CPU seconds (user and system) process `pid` of this machine has used; OSError if
    it is gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def scratch_database(name: str, server: str | None = None) -> str:
    """Drop and recreate database `name` with the schema; return its DSN.

    On `server` (a DSN), else on the embedded (or $PEPSI_DSN) server.
    """
    server = server or connect.resolve(load_config(None)).dsn
    admin = conninfo.make_conninfo(server, dbname="postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = conninfo.make_conninfo(server, dbname=name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        schema.install(conn)
    return dsn


def exclusive_run(name: str, server: str | None = None) -> psycopg.Connection[tuple[object, ...]]:
    """Hold a session lock named `name` on the server for as long as the returned
    connection is open; SystemExit if another run holds it (two runs would share, and
    each drop, the same scratch database)."""
    server = server or connect.resolve(load_config(None)).dsn
    conn = psycopg.connect(conninfo.make_conninfo(server, dbname="postgres"), autocommit=True)
    row = conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (name,)).fetchone()
    if not (row and row[0]):
        conn.close()
        raise SystemExit(f"another {name} run is under way on this server; wait for it to end")
    return conn
