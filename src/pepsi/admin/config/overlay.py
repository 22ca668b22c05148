"""Editing the database overlay (`pepsi.config_override`) and asking for a reload (P-10).

`pepsi config set|unset` change rows of the overlay and `pepsi config
reload` only asks: each ends with `NOTIFY config_changed`, in the same
transaction as its change, so the dispatcher rebuilds its stage table from
exactly what was committed. A change is checked first by the parser that
checks pepsi.conf, laid over the file as the dispatcher will: a change that
would leave a configuration the dispatcher cannot load is refused and
nothing is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from pepsi.config import Config, load_config, read_overlay
from pepsi.db.queries import query
from pepsi.errors import ConfigError


@dataclass(frozen=True)
class Change:
    section: str
    key: str
    value: str | None  # None: unset (the row goes; the file's value applies again)


def parse_assignment(text: str, *, with_value: bool) -> Change:
    """`SECTION.KEY=VALUE` (set) or `SECTION.KEY` (unset); ConfigError if malformed."""
    target, eq, value = text.partition("=")
    section, dot, key = target.strip().rpartition(".")
    if not dot or not section or not key.strip() or (with_value and not eq):
        form = "SECTION.KEY=VALUE" if with_value else "SECTION.KEY"
        raise ConfigError(f"expected {form}, got {text!r}")
    if not with_value and eq:
        raise ConfigError(f"unset takes SECTION.KEY without a value, got {text!r}")
    return Change(section.strip(), key.strip().upper(), value.strip() if with_value else None)


def apply(conn: psycopg.Connection[Any], base: Config, changes: Sequence[Change]) -> Config:
    """Check the changes over the file and the current overlay, write them, notify.

    One transaction: nothing is written if the result does not load.
    Returns the configuration the dispatcher will load.
    """
    with conn.transaction():
        rows = {(s, k.upper()): v for s, k, v in read_overlay(conn)}
        for change in changes:
            if change.value is None:
                rows.pop((change.section, change.key), None)
            else:
                rows[(change.section, change.key)] = change.value
        config = load_config(base.path, [(s, k, v) for (s, k), v in rows.items()])
        for change in changes:
            params = {"section": change.section, "key": change.key, "value": change.value}
            name = "config_override_delete" if change.value is None else "config_override_upsert"
            conn.execute(query(name), params)
        conn.execute(query("config_notify_changed"))
    return config


def request_reload(conn: psycopg.Connection[Any]) -> None:
    """`pepsi config reload`: the dispatcher reads the file and the overlay again."""
    conn.execute(query("config_notify_changed"))
