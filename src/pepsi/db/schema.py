"""Installing, upgrading and checking the `pepsi` schema.

The build's schema version is the number of its last migration; its
fingerprint is a hash of the migrations' text. The database records both, so
a program can tell whether the database is older, newer, or the same version
built from other files (SPEC P-13), and refuse to run (exit 78) unless it is
current.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from enum import Enum
from functools import cache
from importlib import resources

import psycopg
from psycopg import sql

from pepsi.db import roles
from pepsi.db.queries import query, sql_text
from pepsi.errors import PepsiError, SchemaMismatch

_MIGRATION = re.compile(r"(\d{4})_[a-z0-9_]+\.sql")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str


@cache
def migrations() -> tuple[Migration, ...]:
    """The shipped migrations in order; numbering must be 1, 2, 3 … without gaps."""
    folder = resources.files("pepsi") / "sql" / "migrations"
    found = []
    for entry in folder.iterdir():
        match = _MIGRATION.fullmatch(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), entry.name, entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise RuntimeError(f"migrations are not numbered 1..n: {[m.name for m in found]}")
    return tuple(found)


def build_version() -> int:
    return len(migrations())


def fingerprint(version: int | None = None) -> str:
    """Hash of the first `version` migrations (all by default)."""
    digest = hashlib.sha256()
    for migration in migrations()[: build_version() if version is None else version]:
        digest.update(migration.name.encode() + b"\0" + migration.text.encode() + b"\0")
    return digest.hexdigest()[:16]


class SchemaState(Enum):
    CURRENT = "current"
    MISSING = "missing"
    OLDER = "older"
    NEWER = "newer"
    DIFFERENT = "different"
    FOREIGN = "foreign"  # a `pepsi` schema Pepsi did not install


@dataclass(frozen=True)
class SchemaCheck:
    state: SchemaState
    installed: int | None
    expected: int

    def message(self) -> str:
        run = "run `pepsi setup schema`"
        match self.state:
            case SchemaState.CURRENT:
                return f"database schema is version {self.installed} (current)"
            case SchemaState.MISSING:
                return f"database has no Pepsi schema: {run} to install it"
            case SchemaState.OLDER:
                return (
                    f"database schema is version {self.installed}, older than this build's "
                    f"{self.expected}: {run} to upgrade it"
                )
            case SchemaState.NEWER:
                return (
                    f"database schema is version {self.installed}, newer than this build's "
                    f"{self.expected}: run a newer Pepsi"
                )
            case SchemaState.DIFFERENT:
                return (
                    f"database schema version {self.installed} was built from different "
                    f"files than this build's: use the build that installed it"
                )
            case SchemaState.FOREIGN:
                return "database has a `pepsi` schema that Pepsi did not install (no version)"


def check(conn: psycopg.Connection[tuple[object, ...]]) -> SchemaCheck:
    """Compare the database's schema with this build's; no writes."""
    expected = build_version()
    row = conn.execute(query("schema_exists")).fetchone()
    assert row is not None
    has_version, has_schema = bool(row[0]), bool(row[1])
    if not has_version:
        state = SchemaState.FOREIGN if has_schema else SchemaState.MISSING
        return SchemaCheck(state, None, expected)
    version_row = conn.execute(query("schema_version_get")).fetchone()
    if version_row is None:
        return SchemaCheck(SchemaState.FOREIGN, None, expected)
    installed, recorded = int(str(version_row[0])), str(version_row[1])
    if installed > expected:
        state = SchemaState.NEWER
    elif recorded != fingerprint(installed):
        state = SchemaState.DIFFERENT
    elif installed < expected:
        state = SchemaState.OLDER
    else:
        state = SchemaState.CURRENT
    return SchemaCheck(state, installed, expected)


def require_current(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    """Called by every program at start: SchemaMismatch (exit 78) unless current."""
    result = check(conn)
    if result.state is not SchemaState.CURRENT:
        raise SchemaMismatch(result.message())


def install(conn: psycopg.Connection[tuple[object, ...]], *, from_migrations: bool = False) -> str:
    """Install or upgrade the schema in one transaction; say what was done.

    A fresh database gets `schema.sql` (or, with `from_migrations`, every
    migration in turn — the tests compare the two); an older one gets the
    migrations it lacks. Concurrent installers serialise on an advisory lock.
    """
    with conn.transaction():
        conn.execute(query("schema_install_lock"))
        result = check(conn)
        match result.state:
            case SchemaState.CURRENT:
                return f"schema is current (version {result.installed}); nothing to do"
            case SchemaState.NEWER | SchemaState.DIFFERENT | SchemaState.FOREIGN:
                raise SchemaMismatch(result.message())
            case SchemaState.MISSING:
                if from_migrations:
                    _apply(conn, migrations())
                else:
                    conn.execute(sql.SQL(sql_text("schema.sql")))
                done = f"installed schema version {result.expected}"
            case SchemaState.OLDER:
                assert result.installed is not None
                _apply(conn, migrations()[result.installed :])
                done = f"upgraded schema from version {result.installed} to {result.expected}"
        conn.execute(
            query("schema_version_set"),
            {"version": result.expected, "fingerprint": fingerprint()},
        )
        roles.regrant(conn)  # what the upgrade added, for pepsi_publisher and pepsi_worker
    return done


def _apply(conn: psycopg.Connection[tuple[object, ...]], steps: tuple[Migration, ...]) -> None:
    for migration in steps:
        try:
            conn.execute(sql.SQL(migration.text))
        except psycopg.Error as exc:
            raise PepsiError(f"migration {migration.name} failed: {exc}") from exc
