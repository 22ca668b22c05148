"""Counting a database's committed transactions (pg_stat_database.xact_commit).

Tests use the count as a measure of round trips. Two things besides the code
under test move it: a backend that is still exiting (it leaves pg_stat_activity
before it writes its counters), and an autovacuum worker's visit, which commits
transactions of its own even when it finds nothing to do. `committed` waits out
the first; the `no_autovacuum` fixture (tests/conftest.py) prevents the second.
"""

from __future__ import annotations

from collections.abc import Collection

import psutil
import psycopg

from tests.scenarios.conftest import wait_until

Admin = psycopg.Connection[tuple[object, ...]]


def postmaster(admin: Admin) -> psutil.Process:
    row = admin.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    parent = psutil.Process(int(str(row[0]))).parent()
    assert parent is not None
    return parent


def server_processes(admin: Admin, title: str, keep: Collection[int] = ()) -> int:
    """The server's processes whose title contains the word `title`, except `keep`."""
    count = 0
    for child in postmaster(admin).children():
        try:
            count += child.pid not in keep and title in " ".join(child.cmdline()).split()
        except psutil.NoSuchProcess:
            continue
    return count


def committed(admin: Admin, dbname: str, keep: Collection[int] = ()) -> int:
    """xact_commit of `dbname` once its backends, except the pids in `keep`, are gone."""

    def settled() -> int | None:
        if server_processes(admin, dbname, keep):
            return None
        admin.execute("SELECT pg_stat_clear_snapshot()")
        row = admin.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (dbname,)
        ).fetchone()
        assert row is not None
        return int(str(row[0])) + 1

    return int(wait_until(settled, what=f"the backends of {dbname} to exit")) - 1
