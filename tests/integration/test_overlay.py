"""The database overlay as every program reads it (pepsi.config.overlay)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pepsi.config import load_config, read_overlay, read_overlay_async, with_overlay
from pepsi.db.embedded import DATABASE, EmbeddedServer
from pepsi.errors import ConfigError

Conn = psycopg.Connection[tuple[Any, ...]]

ROWS = [
    ("stage-inbound", "PARALLELISM", "9"),
    ("stage-added", "HANDLER", "tests.stages:noop"),
    ("stage-inbound", "MAX_LENGTH", None),
]


def insert(conn: Conn, rows: list[tuple[str, str, str | None]]) -> None:
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO pepsi.config_override (section, key, value) VALUES (%s, %s, %s)", rows
        )


@pytest.fixture
def base(tmp_path: Path) -> Path:
    path = tmp_path / "pepsi.conf"
    path.write_text("[stage-inbound]\nHANDLER = tests.stages:noop\nMAX_LENGTH = 10\n")
    return path


def test_read_overlay_sync_and_async(conn: Conn, dsn: str) -> None:
    assert read_overlay(conn) == []
    insert(conn, ROWS)
    expected = sorted(ROWS, key=lambda row: (row[0], row[1]))  # by section, then key
    assert read_overlay(conn) == expected

    async def read() -> list[tuple[str, str, str | None]]:
        async with await psycopg.AsyncConnection.connect(dsn) as aconn:
            return await read_overlay_async(aconn)

    assert asyncio.run(read()) == expected


def test_with_overlay_reads_the_file_again_under_the_rows(conn: Conn, base: Path) -> None:
    config = load_config(base)
    assert with_overlay(config, read_overlay(conn)) is config  # no rows: nothing re-read
    insert(conn, ROWS)
    merged = with_overlay(config, read_overlay(conn))
    assert sorted(merged.stages) == ["added", "inbound"]
    assert merged.stages["inbound"].parallelism == 9
    assert merged.stages["inbound"].max_length is None  # a NULL value removes the key
    assert merged.path == config.path


def test_with_overlay_refuses_the_dispatcher_section(conn: Conn, base: Path) -> None:
    insert(conn, [("pepsi-dispatch", "POLL_INTERVAL", "1s")])
    with pytest.raises(ConfigError, match=r"^pepsi.config_override: \[pepsi-dispatch\]"):
        with_overlay(load_config(base), read_overlay(conn))


def test_embedded_start_finds_its_database(pg_server: EmbeddedServer) -> None:
    # The session's server created the database on its first start; a second
    # start finds it and creates nothing.
    uri = pg_server.start()
    with psycopg.connect(uri) as conn:
        assert conn.execute("SELECT current_database()").fetchone() == (DATABASE,)
