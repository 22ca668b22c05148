"""Per-address settings (W-9): `pepsi settings`, the web console.

`pepsi.settings` holds, per address and stage, options that override the
stage's `[stage-NAME]` ones for that address's messages (see
`pepsi.worker.settings` for which, and how a worker applies them). Here:
reading and writing them, validated by the same value parsers as
pepsi.conf, against the configuration's stages (the file with the database
overlay laid over it).

Addresses are stored lower-cased; options as pepsi.conf spells them
({"RETRY_DELAY": "10s"}), so the worker parses them as it parses the file.
A mistake (bad address, unknown stage or key, bad value) is a UsageError,
one line, and nothing is written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from pepsi.config import Config, StageConfig, read_overlay, with_overlay
from pepsi.db.queries import query
from pepsi.errors import UsageError
from pepsi.worker.settings import normalise_address, parse_option, parse_overrides

Connection = psycopg.Connection[Any]


@dataclass(frozen=True)
class Setting:
    """One address's overrides at one stage."""

    address: str
    stage: str
    options: dict[str, str]
    updated: datetime

    def as_dict(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "stage": self.stage,
            "options": self.options,
            "updated": self.updated.isoformat(),
        }


def address(text: str) -> str:
    """The address as stored; UsageError if it is not one."""
    try:
        return normalise_address(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _split_key(item: str) -> tuple[str, str]:
    """STAGE.KEY -> (stage, KEY), the stage as written, the key upper-cased."""
    stage, dot, key = item.partition(".")
    if not dot or not stage.strip() or not key.strip():
        raise UsageError(f"expected STAGE.KEY, got {item!r}")
    return stage.strip(), key.strip().upper()


def parse_assignments(
    items: Sequence[str], stages: Mapping[str, StageConfig]
) -> dict[str, dict[str, str]]:
    """STAGE.KEY=VALUE items -> {stage: {KEY: value}}, each value checked; UsageError if not."""
    if not items:
        raise UsageError("nothing to set (expected STAGE.KEY=VALUE ...)")
    parsed: dict[str, dict[str, str]] = {}
    for item in items:
        target, equals, value = item.partition("=")
        if not equals:
            raise UsageError(f"expected STAGE.KEY=VALUE, got {item!r}")
        stage, key = _split_key(target)
        if stage not in stages:
            raise UsageError(f"[stage-{stage}] no such stage in the configuration")
        try:
            parse_option(key, value, stages[stage], stages)
        except ValueError as exc:
            raise UsageError(f"[stage-{stage}] {exc}") from None
        parsed.setdefault(stage, {})[key] = value.strip()
    for stage, options in parsed.items():  # together, over the section: as a worker lays them
        _, problem = parse_overrides(options, stages[stage], stages)
        if problem is not None:
            raise UsageError(f"[stage-{stage}] {problem}")
    return parsed


def stages_of(conn: Connection, config: Config) -> Mapping[str, StageConfig]:
    """The stages the workers see: the file with the database overlay over it."""
    return with_overlay(config, read_overlay(conn)).stages


def _setting(row: Sequence[Any]) -> Setting:
    options = row[2] if isinstance(row[2], dict) else json.loads(row[2])
    return Setting(row[0], row[1], {str(k): str(v) for k, v in options.items()}, row[3])


def set_options(
    conn: Connection, config: Config, address_text: str, items: Sequence[str]
) -> list[Setting]:
    """Lay STAGE.KEY=VALUE items over the address's overrides; one transaction."""
    who = address(address_text)
    assignments = parse_assignments(items, stages_of(conn, config))
    result = []
    with conn.transaction():
        for stage, options in assignments.items():
            row = conn.execute(
                query("settings_merge"),
                {"address": who, "stage": stage, "options": json.dumps(options)},
            ).fetchone()
            assert row is not None
            result.append(_setting(row))
    return result


def get_settings(conn: Connection, address_text: str) -> list[Setting]:
    """The address's overrides, one per stage (none: an empty list)."""
    rows = conn.execute(
        query("settings_get_by_address"), {"address": address(address_text)}
    ).fetchall()
    return [_setting(row) for row in rows]


def list_settings(conn: Connection, stage: str | None = None) -> list[Setting]:
    """Every override, or one stage's, by address."""
    return [_setting(row) for row in conn.execute(query("settings_list"), {"stage": stage})]


def delete_settings(conn: Connection, address_text: str, items: Sequence[str] = ()) -> int:
    """Remove the address's overrides: all, a STAGE's, or STAGE.KEY options.

    Returns how many (stage rows, or stage rows touched by key removals) went.
    Stages and keys are not checked against the configuration: an override
    of a stage since removed can still be deleted.
    """
    who = address(address_text)
    if not items:
        return conn.execute(query("settings_delete_address"), {"address": who}).rowcount
    whole: set[str] = set()
    keys: dict[str, list[str]] = {}
    for item in items:
        if "." in item:
            stage, key = _split_key(item)
            keys.setdefault(stage, []).append(key)
        elif item.strip():
            whole.add(item.strip())
        else:
            raise UsageError("expected STAGE or STAGE.KEY, got ''")
    removed = 0
    with conn.transaction():
        for stage in sorted(whole):
            removed += conn.execute(
                query("settings_delete_stage"), {"address": who, "stage": stage}
            ).rowcount
        for stage, names in keys.items():
            if stage in whole:
                continue
            row = conn.execute(
                query("settings_delete_keys"), {"address": who, "stage": stage, "keys": names}
            ).fetchone()
            removed += int(row[0]) if row else 0
    return removed
