"""The database overlay: `pepsi.config_override` rows laid over the file.

Every program reads it through these functions (the publisher on start and
on an unknown stage; the dispatcher and the worker likewise), so the overlay
means the same thing everywhere. psycopg is imported only when a read
happens: loading the configuration alone must stay cheap (`pepsi --help`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from pepsi.config.load import load_config
from pepsi.config.model import Config

if TYPE_CHECKING:
    import psycopg

OverlayRow = tuple[str, str, str | None]  # section, key, value (NULL removes the key)


def _rows(fetched: Iterable[Sequence[Any]]) -> list[OverlayRow]:
    return [(str(s), str(k), None if v is None else str(v)) for s, k, v in fetched]


def read_overlay(conn: psycopg.Connection[Any]) -> list[OverlayRow]:
    """The overlay rows, ordered by section and key."""
    from pepsi.db.queries import query  # noqa: PLC0415  # psycopg only once a read happens

    return _rows(conn.execute(query("config_override_list")).fetchall())


async def read_overlay_async(conn: psycopg.AsyncConnection[Any]) -> list[OverlayRow]:
    """The overlay rows, ordered by section and key."""
    from pepsi.db.queries import query  # noqa: PLC0415  # psycopg only once a read happens

    cur = await conn.execute(query("config_override_list"))
    return _rows(await cur.fetchall())


def with_overlay(base: Config, overlay: Sequence[OverlayRow]) -> Config:
    """`base`'s file read again with the overlay laid over it; `base` if there is none."""
    return load_config(base.path, overlay) if overlay else base
