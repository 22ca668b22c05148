"""Which built-ins exist, their option keys, and their parsed options (pure).

The configuration parser reads `PROGRAM = pepsi-stage-NAME`, parses the
section's extra keys with `BUILTINS[NAME].keys` and builds the options with
`BUILTINS[NAME].build`, once at load. The worker imports `handler`, the
stage function, only when it runs that stage.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pepsi.config.values import stage_ref
from pepsi.stages.condition import Condition, Const, Truthy, parse_condition, render
from pepsi.stages.mail_options import (
    BOUNCE_MAIL_KEYS,
    DKIM_KEYS,
    INTERNET_KEYS,
    SMARTHOST_KEYS,
    SRS_KEYS,
    DkimOptions,
    RelayOptions,
    SrsOptions,
)

PROGRAM_PREFIX = "pepsi-stage-"
# Pepsi's own bookkeeping in the state: a SET of these would corrupt it.
RESERVED_STATE = frozenset({
    "strikes", "temporary_failures", "last_error", "failed_stage", "failure_class",
    "pause_reason", "bounced_from", "bounced_status",
})  # fmt: skip
_STATE_KEY = re.compile(r"[A-Za-z_][\w-]*")


class OptionError(ValueError):
    """A built-in's options do not fit together; `key` is the one to name."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(problem)
        self.key = key


@dataclass(frozen=True)
class IfOptions:
    condition: Condition
    then: str
    otherwise: str | None  # None: NEXT (finish without one)

    @property
    def routes(self) -> tuple[tuple[str, str], ...]:
        pairs = (("THEN", self.then), ("ELSE", self.otherwise))
        return tuple((key, target) for key, target in pairs if target is not None)

    def describe(self) -> str:
        return f"if {render(self.condition)}"


@dataclass(frozen=True)
class SetOptions:
    values: tuple[tuple[str, Any], ...]  # (state key, JSON scalar), in the order written

    @property
    def routes(self) -> tuple[tuple[str, str], ...]:
        return ()

    def describe(self) -> str:
        return "set " + ", ".join(f"{k}={v!r}" for k, v in self.values)


@dataclass(frozen=True)
class BounceOptions:
    reason: str | None = None  # None: "bounced at stage NAME"
    dsn_stage: str | None = None  # mail: the failure report goes there (issue 32)
    hostname: str | None = None  # the report's Reporting-MTA; None: the machine's name

    @property
    def routes(self) -> tuple[tuple[str, str], ...]:
        return ()

    @property
    def spawns(self) -> tuple[tuple[str, str], ...]:
        return (("DSN_STAGE", self.dsn_stage),) if self.dsn_stage else ()

    def describe(self) -> str:
        return "bounce" + (f" ({self.reason})" if self.reason else "")


@dataclass(frozen=True)
class DiscardOptions:
    @property
    def routes(self) -> tuple[tuple[str, str], ...]:
        return ()

    def describe(self) -> str:
        return "discard"


BuiltinOptions = (
    IfOptions
    | SetOptions
    | BounceOptions
    | DiscardOptions
    | RelayOptions
    | DkimOptions
    | SrsOptions
)
Spec = Mapping[str, tuple[str, Callable[[str], Any]]]


@dataclass(frozen=True)
class Builtin:
    name: str
    handler: str  # module:function, imported by the worker only
    keys: Spec  # the built-in's own keys in [stage-NAME]
    build: Callable[[str, Mapping[str, Any]], BuiltinOptions]  # (stage name, parsed keys)


def _build_if(stage: str, values: Mapping[str, Any]) -> IfOptions:
    if "condition" not in values:
        raise OptionError("IF", "required by pepsi-stage-if (the condition)")
    if "then" not in values:
        raise OptionError("THEN", "required by pepsi-stage-if (the stage when IF holds)")
    for key, target in (("THEN", values["then"]), ("ELSE", values.get("otherwise"))):
        if target == stage:
            raise OptionError(key, "an if stage cannot route to itself (messages would loop)")
    return IfOptions(values["condition"], values["then"], values.get("otherwise"))


def _build_set(_stage: str, values: Mapping[str, Any]) -> SetOptions:
    if "values" not in values:
        raise OptionError("SET", "required (KEY = VALUE, …: the state keys to write)")
    return SetOptions(values["values"])


def _build_bounce(_stage: str, values: Mapping[str, Any]) -> BounceOptions:
    return BounceOptions(**values)


def _build_smarthost(_stage: str, values: Mapping[str, Any]) -> RelayOptions:
    if "host" not in values:
        raise OptionError("HOST", "required by pepsi-stage-relay-to-smarthost (the smarthost)")
    if ("auth_user" in values) != ("auth_secret_file" in values):
        key = "AUTH_USER" if "auth_user" in values else "AUTH_SECRET_FILE"
        raise OptionError(key, "set AUTH_USER and AUTH_SECRET_FILE together")
    if "auth_user" in values and values.get("tls", "starttls") == "none":
        raise OptionError(
            "AUTH_USER", "AUTH over a plain connection would send the secret in clear: set TLS"
        )
    return RelayOptions(**values)


def _build_internet(_stage: str, values: Mapping[str, Any]) -> RelayOptions:
    return RelayOptions(**values, tls="may")


def _build_dkim(_stage: str, values: Mapping[str, Any]) -> DkimOptions:
    for key, attr in (("DOMAIN", "domain"), ("SELECTOR", "selector"), ("KEY_FILE", "key_file")):
        if attr not in values:
            raise OptionError(key, "required by pepsi-stage-dkim-sign")
    return DkimOptions(**values)


def _build_srs(_stage: str, values: Mapping[str, Any]) -> SrsOptions:
    for key, attr in (("DOMAIN", "domain"), ("SECRET_FILE", "secret_file")):
        if attr not in values:
            raise OptionError(key, "required by pepsi-stage-srs")
    return SrsOptions(**values)


def _build_discard(_stage: str, _values: Mapping[str, Any]) -> DiscardOptions:
    return DiscardOptions()


def assignments(text: str) -> tuple[tuple[str, Any], ...]:
    """`key=value, other=1`: values are numbers, true/false/null, quoted or bare strings."""
    items: list[tuple[str, Any]] = []
    for part in _split_commas(text):
        key, sep, raw = part.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not _STATE_KEY.fullmatch(key):
            raise ValueError(f"expected KEY=VALUE (a state key, then =), got {part.strip()!r}")
        if key in RESERVED_STATE:
            raise ValueError(f"state.{key} is Pepsi's own bookkeeping and cannot be set")
        if any(key == seen for seen, _ in items):
            raise ValueError(f"{key} is set twice")
        if not raw:
            raise ValueError(f'{key} has no value (write "" for an empty string)')
        items.append((key, _literal(raw)))
    return tuple(items)


def _split_commas(text: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    quote = ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char == ",":
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    if quote:
        raise ValueError(f"string not closed (missing {quote})")
    parts.append("".join(current))
    if not any(p.strip() for p in parts):
        raise ValueError("must not be empty")
    return parts


def _literal(raw: str) -> Any:
    """A literal of the condition language; any other text is a bare string."""
    if raw[0] in "\"'" or raw.lower() in ("true", "false", "null") or raw.lstrip("-")[:1].isdigit():
        try:
            cond = parse_condition(raw)
        except ValueError:
            cond = None
        if isinstance(cond, Truthy) and isinstance(cond.operand, Const):
            return cond.operand.value
        if raw[0] in "\"'":
            raise ValueError(f"not one quoted string: {raw!r}")
    return raw


def reason(text: str) -> str:
    value = text.strip()
    if not value:
        raise ValueError("must not be empty")
    return value


_IF_KEYS: Spec = {
    "IF": ("condition", parse_condition),
    "THEN": ("then", stage_ref),
    "ELSE": ("otherwise", stage_ref),
}
_SET_KEYS: Spec = {"SET": ("values", assignments)}
BUILTINS: Mapping[str, Builtin] = {
    "if": Builtin("if", "pepsi.stages.if_:run", _IF_KEYS, _build_if),
    "set": Builtin("set", "pepsi.stages.set_:run", _SET_KEYS, _build_set),
    "tag": Builtin("tag", "pepsi.stages.set_:run", _SET_KEYS, _build_set),  # set's other name
    "discard": Builtin("discard", "pepsi.stages.discard:run", {}, _build_discard),
    "bounce": Builtin(
        "bounce",
        "pepsi.stages.bounce:run",
        {"REASON": ("reason", reason), **BOUNCE_MAIL_KEYS},
        _build_bounce,
    ),
    "relay-to-smarthost": Builtin(
        "relay-to-smarthost", "pepsi.stages.relay:to_smarthost", SMARTHOST_KEYS, _build_smarthost
    ),
    "relay-to-internet": Builtin(
        "relay-to-internet", "pepsi.stages.relay:to_internet", INTERNET_KEYS, _build_internet
    ),
    "dkim-sign": Builtin("dkim-sign", "pepsi.stages.dkim:run", DKIM_KEYS, _build_dkim),
    "srs": Builtin("srs", "pepsi.stages.srs:run", SRS_KEYS, _build_srs),
}


def builtin_named(program: str) -> Builtin | None:
    """The built-in `PROGRAM = pepsi-stage-NAME` names, if it names one."""
    name = program.strip()
    if not name.startswith(PROGRAM_PREFIX):
        return None
    return BUILTINS.get(name[len(PROGRAM_PREFIX) :])
