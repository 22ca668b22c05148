"""Shared fixtures: one embedded PostgreSQL per test session, a template
database holding the schema, and a fresh database per test that needs one."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo, sql

from pepsi.cli import OneLineFormatter
from pepsi.db import schema
from pepsi.db.embedded import EmbeddedServer
from tests import commits
from tests.scenarios.conftest import wait_until

TEMPLATE = "pepsi_template"


def with_dbname(dsn: str, dbname: str) -> str:
    return conninfo.make_conninfo(dsn, dbname=dbname)


@pytest.fixture(autouse=True)
def _pepsi_logging_undone() -> Iterator[None]:
    """A test that runs `pepsi.cli.main` in this process leaves the root logger its
    handler, on the sys.stderr pytest captured for that test and closes after it: a
    thread of a later test that logs would print '--- Logging error ---'. Undone here."""
    root = logging.getLogger()
    level = root.level
    yield
    for handler in root.handlers[:]:
        if isinstance(handler.formatter, OneLineFormatter):
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    server = EmbeddedServer(tmp_path_factory.mktemp("pg") / "data")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def admin_dsn(pg_server: EmbeddedServer) -> str:
    dsn = pg_server.uri()
    assert dsn is not None
    return with_dbname(dsn, "postgres")


@pytest.fixture(scope="session")
def template_dsn(admin_dsn: str) -> str:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(TEMPLATE)))
    dsn = with_dbname(admin_dsn, TEMPLATE)
    with psycopg.connect(dsn, autocommit=True) as conn:
        schema.install(conn)
    return dsn


def _fresh(admin_dsn: str, template: str) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        )
    yield with_dbname(admin_dsn, name)
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def no_autovacuum(admin_dsn: str) -> Iterator[None]:
    """Autovacuum off on this test process's own server while the test runs, for
    tests that count commits (tests/commits.py): per-table settings cannot stop
    an autovacuum worker's visit to a database, the server setting can."""
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute("ALTER SYSTEM SET autovacuum = off")
        admin.execute("SELECT pg_reload_conf()")
        # the launcher exits once it reads the setting; a worker ends its visit
        wait_until(
            lambda: commits.server_processes(admin, "autovacuum") == 0,
            what="autovacuum to stop",
        )
    try:
        yield
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM RESET autovacuum")
            admin.execute("SELECT pg_reload_conf()")


@pytest.fixture
def dsn(admin_dsn: str, template_dsn: str) -> Iterator[str]:
    """A fresh database with the current schema installed."""
    yield from _fresh(admin_dsn, TEMPLATE)


@pytest.fixture
def empty_dsn(admin_dsn: str) -> Iterator[str]:
    """A fresh database without the schema."""
    yield from _fresh(admin_dsn, "template0")


@pytest.fixture
def other_empty_dsn(admin_dsn: str) -> Iterator[str]:
    """A second fresh database without the schema."""
    yield from _fresh(admin_dsn, "template0")


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    with psycopg.connect(dsn, autocommit=True) as connection:
        yield connection


@pytest.fixture
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No PEPSI_DSN, no config found in the default locations."""
    monkeypatch.delenv("PEPSI_DSN", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    monkeypatch.chdir(tmp_path)
    return tmp_path
