"""Schema install, upgrade, version check, and file-vs-migrations equality."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator

import psycopg
import pytest

from pepsi.db import schema
from pepsi.db.embedded import EmbeddedServer, bin_dir
from pepsi.errors import EX_CONFIG, SchemaMismatch

Conn = psycopg.Connection[tuple[object, ...]]


@pytest.fixture
def empty(empty_dsn: str) -> Iterator[Conn]:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        yield conn


def test_install_is_idempotent(empty: Conn) -> None:
    assert schema.check(empty).state is schema.SchemaState.MISSING
    assert schema.install(empty) == f"installed schema version {schema.build_version()}"
    assert schema.check(empty).state is schema.SchemaState.CURRENT
    assert "nothing to do" in schema.install(empty)
    assert schema.check(empty).state is schema.SchemaState.CURRENT
    schema.require_current(empty)


def test_older_schema_is_upgraded(empty: Conn, monkeypatch: pytest.MonkeyPatch) -> None:
    schema.install(empty)
    extra = schema.Migration(
        schema.build_version() + 1,
        f"{schema.build_version() + 1:04d}_test_extra.sql",
        "CREATE TABLE pepsi.test_extra (x int);",
    )
    shipped = schema.migrations()
    monkeypatch.setattr(schema, "migrations", lambda: (*shipped, extra))
    result = schema.check(empty)
    assert result.state is schema.SchemaState.OLDER
    assert "older than this build's" in result.message()
    with pytest.raises(SchemaMismatch) as info:
        schema.require_current(empty)
    assert info.value.exit_code == EX_CONFIG
    assert "upgraded schema from version" in schema.install(empty)
    assert schema.check(empty).state is schema.SchemaState.CURRENT
    empty.execute("SELECT x FROM pepsi.test_extra")


def test_newer_and_different_schemas_are_refused(empty: Conn) -> None:
    schema.install(empty)
    empty.execute("UPDATE pepsi.schema_version SET version = version + 5")
    newer = schema.check(empty)
    assert newer.state is schema.SchemaState.NEWER
    assert "newer than this build's" in newer.message()
    with pytest.raises(SchemaMismatch, match="newer"):
        schema.install(empty)

    empty.execute("UPDATE pepsi.schema_version SET version = version - 5, fingerprint = 'x'")
    different = schema.check(empty)
    assert different.state is schema.SchemaState.DIFFERENT
    with pytest.raises(SchemaMismatch, match="different files"):
        schema.require_current(empty)


def test_foreign_pepsi_schema_is_not_touched(empty: Conn) -> None:
    empty.execute("CREATE SCHEMA pepsi")
    assert schema.check(empty).state is schema.SchemaState.FOREIGN
    with pytest.raises(SchemaMismatch, match="did not install"):
        schema.install(empty)


def _dump(server: EmbeddedServer, dsn: str) -> str:
    pg_dump = bin_dir() / "pg_dump"
    out = subprocess.run(
        [pg_dump, "--schema-only", "--schema=pepsi", "--no-owner", "--restrict-key=x", dsn],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return re.sub(r"^--.*$", "", out, flags=re.MULTILINE)


def test_schema_file_equals_replayed_migrations(
    pg_server: EmbeddedServer, empty_dsn: str, other_empty_dsn: str
) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        schema.install(conn)
    with psycopg.connect(other_empty_dsn, autocommit=True) as conn:
        schema.install(conn, from_migrations=True)
    from_file, from_migrations = _dump(pg_server, empty_dsn), _dump(pg_server, other_empty_dsn)
    assert "CREATE TABLE pepsi.workqueue" in from_file
    assert from_file == from_migrations
