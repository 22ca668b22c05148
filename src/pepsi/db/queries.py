"""Named SQL: `sql/queries.sql` split on `-- name:` headers, loaded once."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from psycopg import sql

_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def sql_text(filename: str) -> str:
    """The text of a file shipped in `pepsi/sql/`."""
    return (resources.files("pepsi") / "sql" / filename).read_text(encoding="utf-8")


def parse_named(text: str) -> dict[str, str]:
    """Split a file of named queries; a name given twice is an error."""
    parts = _HEADER.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        queries[name] = body.strip()
    return queries


@cache
def _all() -> dict[str, str]:
    return parse_named(sql_text("queries.sql"))


def query_text(name: str) -> str:
    """The named query as a plain string, for a hot path that executes it as is.

    psycopg prepares a statement by its text after a few runs; a string goes
    out as it is, where `query()` is composed again on every execute.
    """
    try:
        return _all()[name]
    except KeyError:
        raise KeyError(f"no query named {name!r} in queries.sql") from None


def query(name: str) -> sql.SQL:
    """The named query, ready to execute."""
    return sql.SQL(query_text(name))
