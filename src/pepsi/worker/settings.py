"""Per-address settings (W-9): which overrides apply to a message, and the split. Pure.

`pepsi.settings` holds, per (address, stage), options as pepsi.conf spells
them ({"RETRY_DELAY": "10s"}). The worker's load query returns, with each
row, the overrides of its correspondent at the stage: the envelope sender of
a `state.local_origin` message, else each recipient. Here they are parsed by
the same value parsers as pepsi.conf and laid over the stage's
`StageConfig`; recipients are grouped by the overrides they resolve to. One
group: the message runs under it. Several: the row is split (the first group
stays on it, each other group becomes a new pending row at the same stage).

Only the options that act on one message may be overridden (`OVERRIDABLE`):
its failure timing and its dead-letter route. PROGRAM, HANDLER and NEXT
shape the stage graph; PARALLELISM, QUEUE_LIMIT, MAX_MESSAGES, MAX_RUNTIME,
FUSION, MAX_LENGTH, OVERFLOW and TTL act on workers or on the whole queue,
where no single address is in charge.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pepsi.config import StageConfig
from pepsi.config.parse import STAGE_KEYS
from pepsi.config.values import is_amqp_stage

OVERRIDABLE: Mapping[str, tuple[str, Callable[[str], Any]]] = {
    key: STAGE_KEYS[key]
    for key in ("MAX_LIFETIME", "RETRY_DELAY", "RETRY_MAX_DELAY", "BOUNCE_STAGE")
}
RECHECK_INTERVAL = 5.0  # seconds between a worker's looks for a stage's first override
ADDRESS_LIMIT = 320  # RFC 5321's longest path: 64 + 1 + 255

_ADDRESS = re.compile(r"[^\s@\x00-\x1f\x7f]+(?:@[^\s@\x00-\x1f\x7f]+)?")

Overrides = Mapping[str, str]  # one address's options at one stage: KEY -> value text
Parsed = tuple[tuple[str, Any], ...]  # sorted (field, value) pairs: hashable, comparable


def normalise_address(address: str) -> str:
    """The address as `pepsi.settings` keys it (lower-cased); ValueError if it is not one."""
    value = address.strip()
    if not value or len(value) > ADDRESS_LIMIT or not _ADDRESS.fullmatch(value):
        raise ValueError(f"not an address: {address!r} (expected local@domain, no spaces)")
    return value.lower()


def parse_option(key: str, value: str, stages: Container[str]) -> tuple[str, Any]:
    """(StageConfig field, parsed value) of one override; ValueError with the problem."""
    name = key.strip().upper()
    if name not in OVERRIDABLE:
        known = ", ".join(OVERRIDABLE)
        if name in STAGE_KEYS:
            raise ValueError(f"{name} cannot be set per address (only {known})")
        raise ValueError(f"unknown key {name} (per address: {known})")
    attr, parse = OVERRIDABLE[name]
    try:
        parsed = parse(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    if attr == "bounce_stage" and parsed not in stages and not is_amqp_stage(parsed):
        raise ValueError(f"{name}: no stage named {parsed!r}")
    return attr, parsed


def parse_overrides(options: Overrides, stages: Container[str]) -> tuple[Parsed, list[str]]:
    """The usable overrides, sorted, and a problem per unusable one.

    An option stored before the configuration changed (a BOUNCE_STAGE whose
    stage is gone) is skipped rather than failing every message of the address.
    """
    parsed: dict[str, Any] = {}
    problems = []
    for key, value in options.items():
        try:
            attr, typed = parse_option(key, str(value), stages)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        parsed[attr] = typed
    return tuple(sorted(parsed.items())), problems


def overlay(stage: StageConfig, parsed: Parsed) -> StageConfig:
    """The stage's options with `parsed` laid over them."""
    return replace(stage, **dict(parsed)) if parsed else stage


@dataclass(frozen=True)
class Plan:
    """What the settings do to one message: its recipient groups, each with its options.

    One group: no split. `groups[0]` stays on the row; `problems` name the
    stored options that could not be used (to log).
    """

    groups: tuple[tuple[str, ...], ...]
    options: tuple[StageConfig, ...]
    problems: tuple[str, ...] = ()

    @property
    def split(self) -> bool:
        return len(self.groups) > 1


def plan(
    stage: StageConfig,
    recipients: Sequence[str],
    sender: str | None,
    state: Mapping[str, Any],
    *,
    overrides: Mapping[str, Overrides] | None,
    stages: Container[str],
) -> Plan:
    """Group the message's correspondents by the overrides they resolve to (W-9).

    `overrides` maps lower-cased addresses to their options at this stage. A
    locally originated message is its sender's (one group, never split);
    otherwise each recipient brings its own, and recipients that resolve to
    the same options share a group, in the order of their first member.
    """
    every = tuple(recipients)
    if not overrides:
        return Plan((every,), (stage,))
    problems: list[str] = []
    cache: dict[str, Parsed] = {}

    def resolve(address: str | None) -> Parsed:
        key = (address or "").lower()
        if key not in cache:
            cache[key], bad = parse_overrides(overrides.get(key) or {}, stages)
            problems.extend(f"{key}: {p}" for p in bad)
        return cache[key]

    if state.get("local_origin") is True:
        return Plan((every,), (overlay(stage, resolve(sender)),), tuple(problems))
    groups: dict[Parsed, list[str]] = {}
    for recipient in every:
        groups.setdefault(resolve(recipient), []).append(recipient)
    if len(groups) <= 1:
        parsed = next(iter(groups), ())
        return Plan((every,), (overlay(stage, parsed),), tuple(problems))
    return Plan(
        tuple(tuple(members) for members in groups.values()),
        tuple(overlay(stage, parsed) for parsed in groups),
        tuple(problems),
    )


class OverrideCheck:
    """Whether a worker should load with the settings, without a statement per batch.

    The worker asks the database whether its stage has any override at most
    every RECHECK_INTERVAL seconds while the answer is no; once it is yes,
    every load carries the overrides and says whether any remain.
    """

    def __init__(self, clock: Callable[[], float], interval: float = RECHECK_INTERVAL) -> None:
        self.clock = clock
        self.interval = interval
        self.exists = False
        self.checked: float | None = None

    def due(self) -> bool:
        """Whether to ask the database now (never while overrides are known to exist)."""
        if self.exists:
            return False
        return self.checked is None or self.clock() - self.checked >= self.interval

    def record(self, exists: bool) -> None:
        self.exists = exists
        self.checked = self.clock()
