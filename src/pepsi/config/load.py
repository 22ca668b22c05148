"""Locating and loading pepsi.conf: the default places, the overlay laid over the file.

`load_config` is the one way in: find the file (-c, else the first default
that exists, else none: defaults), read it (`ini`), lay the database's
`pepsi.config_override` rows over it, and parse the result (`parse`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from pepsi.config.ini import read_file
from pepsi.config.model import OVERLAY_ORIGIN, Config, RawSections, RawValue
from pepsi.config.parse import parse_config
from pepsi.errors import ConfigError


def merge_overlay(raw: RawSections, overlay: Iterable[tuple[str, str, str | None]]) -> RawSections:
    """Lay `pepsi.config_override` rows (section, key, value) over the file.

    A row whose value is NULL removes the key. `[pepsi-dispatch]` is not
    reloadable (P-10), so the overlay cannot change it.
    """
    merged = {section: dict(keys) for section, keys in raw.items()}
    for section, key, value in overlay:
        if section in ("pepsi-dispatch", "pepsi-amqp", "pepsi-web"):
            raise ConfigError(
                "cannot be overridden in the database (not reloadable)",
                file=OVERLAY_ORIGIN,
                section=section,
                key=key.upper(),
            )
        keys = merged.setdefault(section, {})
        if value is None:
            keys.pop(key.upper(), None)
        else:
            keys[key.upper()] = RawValue(value, OVERLAY_ORIGIN)
    return merged


def default_locations() -> list[Path]:
    """Searched in order when no -c is given."""
    xdg = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return [
        Path("pepsi.conf"),
        Path(xdg) / "pepsi" / "pepsi.conf",
        Path("/etc/pepsi/pepsi.conf"),
    ]


def find_config(explicit: Path | None) -> Path | None:
    """The file to read: `explicit` if given, else the first default that exists."""
    if explicit is not None:
        return explicit
    for candidate in default_locations():
        if candidate.is_file():
            return candidate.resolve()
    return None


def load_config(
    explicit: Path | None = None,
    overlay: Iterable[tuple[str, str, str | None]] = (),
) -> Config:
    """Find, read and parse the configuration; a missing default file means defaults."""
    path = find_config(explicit)
    if path is None:
        raw: RawSections = {}
    else:
        path = path if path.is_absolute() else path.resolve()
        raw = read_file(path)
    return parse_config(merge_overlay(raw, overlay), path)
