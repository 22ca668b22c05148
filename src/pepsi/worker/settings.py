"""Per-address settings (W-9): which overrides apply to a message, and the split. Pure.

`pepsi.settings` holds, per (address, stage), options as pepsi.conf spells
them ({"RETRY_DELAY": "10s"}). The worker's load query returns, with each
row, the overrides of its correspondent at the stage: the envelope sender of
a `state.local_origin` message, else each recipient; an entry without `@`
is a domain's, for every address at it (the address's own laid over it).
Here they are parsed by the same value parsers as pepsi.conf and laid over
the stage's `StageConfig`; recipients are grouped by the overrides they
resolve to. One group: the message runs under it. Several: the row is split
(the first group stays on it, each other group becomes a new pending row at
the same stage).

Every option a stage reads per message may be overridden: the failure
timing and dead-letter route of any stage (`PER_MESSAGE`), and all of a
built-in's own keys (SET, IF/THEN/ELSE, REASON, a relay's HOST or TLS, a
DKIM SELECTOR or KEY_FILE …), whose options are built again from the
section's values with the override laid over them, as the file's are. What
acts on the graph or the stage as a whole stays refused, with the reason
(`REFUSED`). An override that no longer fits (the configuration changed
since: a stage it names is gone, or the built-in's options do not build)
makes that message fail, permanently, and no other.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pepsi.config import StageConfig
from pepsi.config.keys import STAGE_KEYS
from pepsi.config.values import is_amqp_stage
from pepsi.stages.options import BUILTINS, OptionError

PER_MESSAGE: Mapping[str, tuple[str, Callable[[str], Any]]] = {
    key: STAGE_KEYS[key]
    for key in ("MAX_LIFETIME", "RETRY_DELAY", "RETRY_MAX_DELAY", "BOUNCE_STAGE")
}
_GRAPH = "shapes the stage graph for every message"
_WORKERS = "acts on the stage's workers, not on one message"
_QUEUE = "acts on the stage's queue as a whole"
REFUSED: Mapping[str, str] = {
    "PROGRAM": _GRAPH, "HANDLER": _GRAPH, "NEXT": _GRAPH, "PARALLELISM": _WORKERS,
    "QUEUE_LIMIT": _WORKERS, "MAX_MESSAGES": _WORKERS, "MAX_RUNTIME": _WORKERS,
    "FUSION": _WORKERS, "MAX_LENGTH": _QUEUE, "OVERFLOW": _QUEUE, "TTL": _QUEUE,
}  # fmt: skip
BUILTIN_FIELD = "builtin."  # a built-in's own key in Parsed: "builtin.<attr>"
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


def parse_option(
    key: str, value: str, stage: StageConfig, stages: Container[str]
) -> tuple[str, Any]:
    """(field, parsed value) of one override of `stage`; ValueError with the problem.

    The field is a StageConfig attribute, or BUILTIN_FIELD + the built-in's attribute.
    """
    name = key.strip().upper()
    builtin = BUILTINS.get(stage.builtin) if stage.builtin else None
    own = builtin.keys if builtin is not None else {}
    if name in PER_MESSAGE:
        attr, parse = PER_MESSAGE[name]
    elif name in own:
        attr, parse = own[name]
        attr = BUILTIN_FIELD + attr
    elif name in REFUSED:
        raise ValueError(f"{name} cannot be set per address: it {REFUSED[name]}")
    else:
        known = ", ".join([*PER_MESSAGE, *own])
        raise ValueError(f"unknown key {name} for [stage-{stage.name}] (per address: {known})")
    try:
        parsed = parse(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    if attr == "bounce_stage" and parsed not in stages and not is_amqp_stage(parsed):
        raise ValueError(f"{name}: no stage named {parsed!r}")
    return attr, parsed


def parse_overrides(
    options: Overrides, stage: StageConfig, stages: Container[str]
) -> tuple[Parsed, str | None]:
    """The overrides, parsed and sorted, and the problem that makes them unusable (None:
    none): the first option that does not parse any more, or a built-in's options that
    do not build with them (`overlay`)."""
    parsed: dict[str, Any] = {}
    for key, value in options.items():
        try:
            attr, typed = parse_option(key, str(value), stage, stages)
        except ValueError as exc:
            return (), str(exc)
        parsed[attr] = typed
    result = tuple(sorted(parsed.items(), key=lambda item: item[0]))
    try:
        overlay(stage, result, stages)
    except ValueError as exc:
        return (), str(exc)
    return result, None


def overlay(stage: StageConfig, parsed: Parsed, stages: Container[str] = ()) -> StageConfig:
    """The stage's options with `parsed` laid over them; a built-in's own options built
    again from its section's values and the overrides. ValueError if they do not build,
    or route to a stage that is not there (with `stages`)."""
    if not parsed:
        return stage
    plain = {attr: value for attr, value in parsed if not attr.startswith(BUILTIN_FIELD)}
    own = {
        attr.removeprefix(BUILTIN_FIELD): value
        for attr, value in parsed
        if attr.startswith(BUILTIN_FIELD)
    }
    if own and stage.builtin is not None:
        values = {**dict(stage.builtin_values), **own}
        try:
            options = BUILTINS[stage.builtin].build(stage.name, values)
        except OptionError as exc:
            raise ValueError(f"{exc.key}: {exc}") from None
        targets = (*getattr(options, "routes", ()), *getattr(options, "spawns", ()))
        for key, target in targets:
            if stages and target not in stages and not is_amqp_stage(target):
                raise ValueError(f"{key}: no stage named {target!r}")
        plain["builtin_options"] = options
        plain["builtin_values"] = tuple(sorted(values.items(), key=lambda item: item[0]))
    return replace(stage, **plain)


def domain_of(address: str) -> str | None:
    """The domain an address's domain entry is keyed by; None for an address without one."""
    _, at, domain = address.rpartition("@")
    return domain if at and domain else None


@dataclass(frozen=True)
class Plan:
    """What the settings do to one message: its recipient groups, each with its options.

    One group: no split. `groups[0]` stays on the row; `problems` name the
    stored options that could not be used (to log).
    """

    groups: tuple[tuple[str, ...], ...]
    options: tuple[StageConfig, ...]
    errors: tuple[str | None, ...] = ()  # per group: why its overrides cannot be used

    @property
    def split(self) -> bool:
        return len(self.groups) > 1

    @property
    def error(self) -> str | None:
        """Why the row's own group (the first) fails, permanently; None: it runs."""
        return self.errors[0] if self.errors else None


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

    `overrides` maps lower-cased addresses (and domains) to their options at this
    stage. A locally originated message is its sender's (one group, never split);
    otherwise each recipient brings its own, and recipients that resolve to the same
    options share a group, in the order of their first member. A group whose
    overrides cannot be used carries the reason, and fails.
    """
    every = tuple(recipients)
    if not overrides:
        return Plan((every,), (stage,))
    cache: dict[str, tuple[Parsed, str | None]] = {}

    def resolve(address: str | None) -> tuple[Parsed, str | None]:
        key = (address or "").lower()
        if key not in cache:
            domain = domain_of(key)
            options = {
                **(overrides.get(domain) or {} if domain else {}),
                **(overrides.get(key) or {}),
            }
            cache[key] = parse_overrides(options, stage, stages)
        return cache[key]

    def options_of(resolved: tuple[Parsed, str | None]) -> StageConfig:
        parsed, error = resolved
        return stage if error is not None else overlay(stage, parsed)

    if state.get("local_origin") is True:
        resolved = resolve(sender)
        return Plan((every,), (options_of(resolved),), (resolved[1],))
    groups: dict[tuple[Parsed, str | None], list[str]] = {}
    for recipient in every:
        groups.setdefault(resolve(recipient), []).append(recipient)
    if len(groups) <= 1:
        resolved = next(iter(groups), ((), None))
        return Plan((every,), (options_of(resolved),), (resolved[1],))
    return Plan(
        tuple(tuple(members) for members in groups.values()),
        tuple(options_of(resolved) for resolved in groups),
        tuple(error for _, error in groups),
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
