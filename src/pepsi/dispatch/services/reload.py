"""Live reconfiguration (P-10): the stage table rebuilt from the file and the overlay.

`pepsi config reload|set|unset` send `NOTIFY config_changed`; SIGHUP does the
same. The dispatcher reads the file again with the database overlay
(`pepsi.config_override`) and, if it parses, swaps its stage table and
retires every live worker, so the next message is both routed and run with
the new values. A graph that does not parse ends the dispatcher (exit 78)
after an orderly stop: keeping the old table while the retired workers'
replacements read the new overlay would route one pipeline and run another.
An overlay that cannot be read (a database error) is not a new
configuration: the current table stays and the reload is retried.
`[pepsi-dispatch]` itself is not reloaded (its connections exist before the
overlay can be read): a change there takes effect at the next start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pepsi.config import Config, StageConfig, load_config, read_overlay, with_overlay
from pepsi.db import connect, schema


@dataclass(frozen=True)
class StageChanges:
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()

    def describe(self) -> str:
        parts = [
            f"{what} {', '.join(names)}"
            for what, names in (
                ("added", self.added),
                ("removed", self.removed),
                ("changed", self.changed),
            )
            if names
        ]
        return "; ".join(parts) or "no stage changed"


def diff(old: Mapping[str, StageConfig], new: Mapping[str, StageConfig]) -> StageChanges:
    """What a reload does to the stage table (pure)."""
    return StageChanges(
        added=tuple(name for name in new if name not in old),
        removed=tuple(name for name in old if name not in new),
        changed=tuple(name for name in new if name in old and new[name] != old[name]),
    )


def load(path: Path | None, dsn: str, timeout: float) -> Config:
    """The file's configuration with the database overlay laid over it.

    ConfigError if it does not parse; DatabaseUnavailable or a psycopg error
    if the overlay cannot be read; SchemaMismatch if the schema is another
    build's.
    """
    config = load_config(path)
    with connect.connect(dsn, timeout=timeout, application_name="pepsi-dispatch") as conn:
        schema.require_current(conn)
        return with_overlay(config, read_overlay(conn))
