"""pepsi.conf: INI sections parsed into frozen dataclasses, validated as a stage graph.

Layout of the file (see docs/configuration.md for every key):

    [pepsi]             global switches
    [pepsi-dispatch]    the dispatcher
    [pepsi-postgres]    the database (embedded by default)
    [pepsi-ingress]     publishing: deduplication window, message size limit
    [pepsi-failure-bouncer]  where failed messages without a BOUNCE_STAGE go
    [stage-NAME]        one per stage

Parsing is pure: `parse_config` takes the raw sections (from the file and,
optionally, the `pepsi.config_override` overlay) and either returns a `Config`
or raises one `ConfigError` naming the file, section and key. Reading files
and choosing the default location are the only I/O here.
"""

from __future__ import annotations

import configparser
import difflib
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from pepsi.durations import parse_duration
from pepsi.errors import ConfigError

OVERLAY_ORIGIN = "pepsi.config_override"
STAGE_PREFIX = "stage-"
STAGE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
HANDLER_REF = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


class Overflow(Enum):
    """What a publish does to a stage at MAX_LENGTH (R-3)."""

    REJECT_PUBLISH = "reject-publish"
    DROP_HEAD = "drop-head"


@dataclass(frozen=True)
class PepsiOptions:
    allow_fusion: bool = True
    share_telemetry: bool = False


@dataclass(frozen=True)
class DispatchOptions:
    config_file: Path | None = None
    poll_interval: float = 5.0
    stats_interval: float = 60.0
    fair_scheduling: bool = True
    fair_half_life: float = 60.0
    fair_fifo_percent: int = 10
    worker_idle_timeout: float = 5.0
    # Failure handling (W-4…W-7); the manual's timings, shortened only in tests.
    strike_delay: float = 60.0  # first strike pause; the second is twice as long
    db_error_pause: float = 30.0  # status 74: how long the message pauses
    tempfail_window: float = 300.0  # status 75: how long a halved cap lasts
    start_cooldown: float = 5.0  # a stage's rest after a worker died before ready
    metrics_address: tuple[str, int] | None = None  # Prometheus endpoint; off by default
    vacuum_after: int = 20_000  # stage passes between the dispatcher's VACUUMs; 0: never


def default_data_dir() -> Path:
    """Where the embedded server keeps its data unless DATA_DIR says otherwise."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "pepsi" / "postgres"


@dataclass(frozen=True)
class PostgresOptions:
    dsn: str | None = None
    data_dir: Path = field(default_factory=default_data_dir)
    worker_synchronous_commit: bool = False
    pool_min_size: int = 1
    pool_max_size: int = 4
    connect_timeout: float = 10.0


MIB = 1024 * 1024


@dataclass(frozen=True)
class IngressOptions:
    dedup_window: float = 24 * 3600.0
    max_message_size: int = 64 * MIB


@dataclass(frozen=True)
class BouncerOptions:
    sink: str | None = None  # a stage name; None: the table pepsi.dead_letter
    interval: float = 30.0


@dataclass(frozen=True)
class StageConfig:
    name: str
    program: str | None = None
    handler: str | None = None
    next: str | None = None
    parallelism: int = 4
    queue_limit: int = 64  # the most ids a worker holds; its window adapts below (P-6)
    max_messages: int = 100_000  # recycle a worker after this many (P-6); see docs/configuration.md
    max_runtime: float = 300.0
    max_lifetime: float = 120 * 3600.0
    retry_delay: float = 60.0  # first host-failure retry; doubles each time
    retry_max_delay: float = 3600.0
    bounce_stage: str | None = None
    fusion: bool | None = None  # None: the stage's own default
    max_length: int | None = None
    overflow: Overflow = Overflow.REJECT_PUBLISH
    ttl: float | None = None

    @property
    def capacity(self) -> int:
        """Messages in flight at once for this stage (P-6, R-5)."""
        return self.parallelism * self.queue_limit


@dataclass(frozen=True)
class Config:
    path: Path | None
    pepsi: PepsiOptions = field(default_factory=PepsiOptions)
    dispatch: DispatchOptions = field(default_factory=DispatchOptions)
    postgres: PostgresOptions = field(default_factory=PostgresOptions)
    ingress: IngressOptions = field(default_factory=IngressOptions)
    bouncer: BouncerOptions = field(default_factory=BouncerOptions)
    stages: Mapping[str, StageConfig] = field(default_factory=lambda: MappingProxyType({}))
    warnings: tuple[str, ...] = ()

    def entry_stages(self) -> list[str]:
        """Stages no other stage advances or bounces to: where publishing starts."""
        targets = {s.next for s in self.stages.values()} | {
            s.bounce_stage for s in self.stages.values()
        }
        return [name for name in self.stages if name not in targets]


# --------------------------------------------------------------------------
# Raw sections: every value remembers where it came from, for error messages.


@dataclass(frozen=True)
class RawValue:
    value: str
    origin: str  # a file name or OVERLAY_ORIGIN


RawSections = dict[str, dict[str, RawValue]]


def read_file(path: Path) -> RawSections:
    """Read an INI file into raw sections; ConfigError on anything unreadable."""
    parser = configparser.ConfigParser(
        interpolation=None,
        strict=True,
        inline_comment_prefixes=("#", ";"),
        default_section="\x00unused",  # so a [DEFAULT] section is just an unknown section
    )
    parser.optionxform = str.upper  # type: ignore[assignment,method-assign]
    name = str(path)
    try:
        with path.open(encoding="utf-8") as handle:
            parser.read_file(handle, source=name)
    except FileNotFoundError:
        raise ConfigError("configuration file not found", file=name) from None
    except (PermissionError, IsADirectoryError) as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", file=name) from None
    except UnicodeDecodeError:
        raise ConfigError("not UTF-8 text", file=name) from None
    except configparser.DuplicateSectionError as exc:
        raise ConfigError(
            f"section appears twice (line {exc.lineno})", file=name, section=exc.section
        ) from None
    except configparser.DuplicateOptionError as exc:
        raise ConfigError(
            f"key appears twice (line {exc.lineno})",
            file=name,
            section=exc.section,
            key=exc.option,
        ) from None
    except configparser.MissingSectionHeaderError as exc:
        raise ConfigError(
            f"line {exc.lineno}: a key before any [section] header", file=name
        ) from None
    except configparser.ParsingError as exc:
        lineno, line = exc.errors[0]
        text = line.strip().strip("'\"").removesuffix("\\n").strip()
        raise ConfigError(
            f"line {lineno}: cannot parse {text!r} (expected KEY = VALUE)", file=name
        ) from None
    return {
        section: {key: RawValue(value, name) for key, value in parser.items(section)}
        for section in parser.sections()
    }


def merge_overlay(raw: RawSections, overlay: Iterable[tuple[str, str, str | None]]) -> RawSections:
    """Lay `pepsi.config_override` rows (section, key, value) over the file.

    A row whose value is NULL removes the key. `[pepsi-dispatch]` is not
    reloadable (P-10), so the overlay cannot change it.
    """
    merged = {section: dict(keys) for section, keys in raw.items()}
    for section, key, value in overlay:
        if section == "pepsi-dispatch":
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


# --------------------------------------------------------------------------
# Value parsers: each returns the typed value or raises ValueError(problem).

T = TypeVar("T")


def _bool(text: str) -> bool:
    word = text.strip().lower()
    if word in ("yes", "true", "on", "1"):
        return True
    if word in ("no", "false", "off", "0"):
        return False
    raise ValueError(f"expected yes or no, got {text!r}")


def _int(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise ValueError(f"must be {bound}, got {value}")
        return value

    return parse


def _duration(minimum: float = 0.001) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = parse_duration(text)
        if value < minimum:
            raise ValueError(f"must be at least {minimum:g}s, got {text!r}")
        return value

    return parse


_SIZE = re.compile(r"(\d+)\s*([kmg]i?b?|b)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def _size(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        match = _SIZE.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"expected a size such as 512K or 64M, got {text!r}")
        unit = (match.group(2) or "").lower()[:1]
        value = int(match.group(1)) * _SIZE_UNITS[unit]
        if not low <= value <= high:
            raise ValueError(f"must be between {low} bytes and {high // MIB}M, got {text!r}")
        return value

    return parse


def _text(text: str) -> str:
    value = text.strip()
    if not value:
        raise ValueError("must not be empty")
    return value


def _listen_address(text: str) -> tuple[str, int] | None:
    """HOST:PORT (an IPv6 host in brackets), or `off`; port 0 picks a free one."""
    value = text.strip()
    if value.lower() in ("", "off", "no"):
        return None
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT such as 127.0.0.1:9464, or off; got {text!r}")
    return host, int(port)


def _path(text: str) -> Path:
    return Path(_text(text)).expanduser()


def _stage_ref(text: str) -> str:
    value = text.strip()
    if not STAGE_NAME.fullmatch(value):
        raise ValueError(f"not a stage name: {text!r}")
    return value


def _program(text: str) -> str:
    value = _text(text)
    if "/" in value and not value.startswith("/"):
        raise ValueError(f"must be a command on PATH or an absolute path, got {value!r}")
    return value


def _handler(text: str) -> str:
    value = text.strip()
    if not HANDLER_REF.fullmatch(value):
        raise ValueError(f"expected package.module:function, got {text!r}")
    return value


def _overflow(text: str) -> Overflow:
    try:
        return Overflow(text.strip().lower())
    except ValueError:
        choices = ", ".join(o.value for o in Overflow)
        raise ValueError(f"expected one of {choices}, got {text!r}") from None


# Each section: KEY -> (dataclass field, parser). Defaults live on the dataclasses.
Spec = Mapping[str, tuple[str, Callable[[str], Any]]]

PEPSI_KEYS: Spec = {
    "ALLOW_FUSION": ("allow_fusion", _bool),
    "SHARE_TELEMETRY": ("share_telemetry", _bool),
}
DISPATCH_KEYS: Spec = {
    "CONFIG_FILE": ("config_file", _path),
    "POLL_INTERVAL": ("poll_interval", _duration()),
    "STATS_INTERVAL": ("stats_interval", _duration(1.0)),
    "FAIR_SCHEDULING": ("fair_scheduling", _bool),
    "FAIR_HALF_LIFE": ("fair_half_life", _duration(1.0)),
    "FAIR_FIFO_PERCENT": ("fair_fifo_percent", _int(0, 100)),
    "WORKER_IDLE_TIMEOUT": ("worker_idle_timeout", _duration()),
    "STRIKE_DELAY": ("strike_delay", _duration()),
    "DB_ERROR_PAUSE": ("db_error_pause", _duration()),
    "TEMPFAIL_WINDOW": ("tempfail_window", _duration()),
    "START_COOLDOWN": ("start_cooldown", _duration()),
    "METRICS_ADDRESS": ("metrics_address", _listen_address),
    "VACUUM_AFTER": ("vacuum_after", _int(0)),
}
POSTGRES_KEYS: Spec = {
    "DSN": ("dsn", _text),
    "DATA_DIR": ("data_dir", _path),
    "WORKER_SYNCHRONOUS_COMMIT": ("worker_synchronous_commit", _bool),
    "POOL_MIN_SIZE": ("pool_min_size", _int(1, 1000)),
    "POOL_MAX_SIZE": ("pool_max_size", _int(1, 1000)),
    "CONNECT_TIMEOUT": ("connect_timeout", _duration(1.0)),
}
INGRESS_KEYS: Spec = {
    "DEDUP_WINDOW": ("dedup_window", _duration(1.0)),
    "MAX_MESSAGE_SIZE": ("max_message_size", _size(1024, 512 * MIB)),
}


def _sink(text: str) -> str | None:
    value = text.strip()
    if value.lower() == "table":
        return None
    return _stage_ref(value)


BOUNCER_KEYS: Spec = {
    "SINK": ("sink", _sink),
    "INTERVAL": ("interval", _duration(0.1)),
}
STAGE_KEYS: Spec = {
    "PROGRAM": ("program", _program),
    "HANDLER": ("handler", _handler),
    "NEXT": ("next", _stage_ref),
    "PARALLELISM": ("parallelism", _int(1, 1000)),
    "QUEUE_LIMIT": ("queue_limit", _int(1, 10000)),
    "MAX_MESSAGES": ("max_messages", _int(1)),
    "MAX_RUNTIME": ("max_runtime", _duration()),
    "MAX_LIFETIME": ("max_lifetime", _duration()),
    "RETRY_DELAY": ("retry_delay", _duration()),
    "RETRY_MAX_DELAY": ("retry_max_delay", _duration()),
    "BOUNCE_STAGE": ("bounce_stage", _stage_ref),
    "FUSION": ("fusion", _bool),
    "MAX_LENGTH": ("max_length", _int(1)),
    "OVERFLOW": ("overflow", _overflow),
    "TTL": ("ttl", _duration()),
}
SECTIONS: Mapping[str, Spec] = {
    "pepsi": PEPSI_KEYS,
    "pepsi-dispatch": DISPATCH_KEYS,
    "pepsi-postgres": POSTGRES_KEYS,
    "pepsi-ingress": INGRESS_KEYS,
    "pepsi-failure-bouncer": BOUNCER_KEYS,
}


def _parse_section(section: str, keys: Mapping[str, RawValue], spec: Spec) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, raw in keys.items():
        if key not in spec:
            hint = difflib.get_close_matches(key, list(spec), n=1)
            problem = "unknown key" + (f" (did you mean {hint[0]}?)" if hint else "")
            raise ConfigError(problem, file=raw.origin, section=section, key=key)
        attr, parse = spec[key]
        try:
            values[attr] = parse(raw.value)
        except ValueError as exc:
            raise ConfigError(str(exc), file=raw.origin, section=section, key=key) from None
    return values


def _origin(keys: Mapping[str, RawValue], key: str, fallback: str | None) -> str | None:
    return keys[key].origin if key in keys else fallback


def parse_config(raw: RawSections, path: Path | None = None) -> Config:
    """Turn raw sections into a validated `Config`; raise ConfigError otherwise."""
    file = str(path) if path else None
    parsed: dict[str, dict[str, Any]] = {}
    stages: dict[str, StageConfig] = {}
    for section, keys in raw.items():
        if section in SECTIONS:
            parsed[section] = _parse_section(section, keys, SECTIONS[section])
        elif section.startswith(STAGE_PREFIX):
            name = section[len(STAGE_PREFIX) :]
            origin = next(iter(keys.values())).origin if keys else file
            if not STAGE_NAME.fullmatch(name):
                raise ConfigError(
                    "stage names are lower-case letters, digits, '-' and '_' (at most 63)",
                    file=origin,
                    section=section,
                )
            stages[name] = _build_stage(name, section, keys, origin)
        else:
            origin = next(iter(keys.values())).origin if keys else file
            raise ConfigError(
                "unknown section (expected [pepsi], [pepsi-dispatch], [pepsi-postgres], "
                "[pepsi-ingress], [pepsi-failure-bouncer] or [stage-NAME])",
                file=origin,
                section=section,
            )

    postgres_values = parsed.get("pepsi-postgres", {})
    data_dir = postgres_values.get("data_dir")
    if data_dir is not None and not data_dir.is_absolute() and path is not None:
        postgres_values["data_dir"] = (path.parent / data_dir).resolve()
    postgres = PostgresOptions(**postgres_values)
    if postgres.pool_max_size < postgres.pool_min_size:
        keys = raw.get("pepsi-postgres", {})
        raise ConfigError(
            f"must be at least POOL_MIN_SIZE ({postgres.pool_min_size})",
            file=_origin(keys, "POOL_MAX_SIZE", file),
            section="pepsi-postgres",
            key="POOL_MAX_SIZE",
        )
    dispatch = DispatchOptions(**parsed.get("pepsi-dispatch", {}))
    if dispatch.config_file is not None and not dispatch.config_file.is_absolute():
        raise ConfigError(
            "must be an absolute path (stage programs start in other directories)",
            file=_origin(raw.get("pepsi-dispatch", {}), "CONFIG_FILE", file),
            section="pepsi-dispatch",
            key="CONFIG_FILE",
        )
    warnings = validate_graph(stages, raw)
    bouncer = BouncerOptions(**parsed.get("pepsi-failure-bouncer", {}))
    if bouncer.sink is not None and bouncer.sink not in stages:
        raise ConfigError(
            f"no stage named {bouncer.sink!r} (or SINK = table)",
            file=_origin(raw.get("pepsi-failure-bouncer", {}), "SINK", file),
            section="pepsi-failure-bouncer",
            key="SINK",
        )
    return Config(
        path=path,
        pepsi=PepsiOptions(**parsed.get("pepsi", {})),
        dispatch=dispatch,
        postgres=postgres,
        ingress=IngressOptions(**parsed.get("pepsi-ingress", {})),
        bouncer=bouncer,
        stages=MappingProxyType(stages),
        warnings=tuple(warnings),
    )


def _build_stage(
    name: str, section: str, keys: Mapping[str, RawValue], origin: str | None
) -> StageConfig:
    values = _parse_section(section, keys, STAGE_KEYS)
    has_program, has_handler = "program" in values, "handler" in values
    if has_program == has_handler:
        problem = (
            "set exactly one of PROGRAM or HANDLER, not both"
            if has_program
            else "set PROGRAM (an executable) or HANDLER (package.module:function)"
        )
        raise ConfigError(problem, file=origin, section=section)
    return StageConfig(name=name, **values)


def validate_graph(stages: Mapping[str, StageConfig], raw: RawSections) -> list[str]:
    """Check that every stage named by NEXT/BOUNCE_STAGE exists; return warnings."""
    for stage in stages.values():
        section = STAGE_PREFIX + stage.name
        keys = raw.get(section, {})
        for key, target in (("NEXT", stage.next), ("BOUNCE_STAGE", stage.bounce_stage)):
            if target is not None and target not in stages:
                hint = difflib.get_close_matches(target, list(stages), n=1)
                raise ConfigError(
                    f"no stage named {target!r}"
                    + (f" (did you mean {hint[0]!r}?)" if hint else f" (no [stage-{target}])"),
                    file=_origin(keys, key, None),
                    section=section,
                    key=key,
                )
        if stage.bounce_stage == stage.name:
            raise ConfigError(
                "a stage cannot bounce to itself (failures would loop)",
                file=_origin(keys, "BOUNCE_STAGE", None),
                section=section,
                key="BOUNCE_STAGE",
            )
    warnings = []
    for stage in stages.values():
        if "OVERFLOW" in raw.get(STAGE_PREFIX + stage.name, {}) and stage.max_length is None:
            warnings.append(f"[stage-{stage.name}] OVERFLOW has no effect without MAX_LENGTH")
    warnings.extend(
        f"stages {' -> '.join([*cycle, cycle[0]])} form a NEXT cycle: "
        "messages finish only if a stage ends them"
        for cycle in next_cycles(stages)
    )
    return warnings


def next_cycles(stages: Mapping[str, StageConfig]) -> list[list[str]]:
    """Cycles in the NEXT graph (each stage has at most one NEXT, so they are disjoint)."""
    cycles: list[list[str]] = []
    done: set[str] = set()
    for start in stages:
        path: list[str] = []
        node: str | None = start
        while node is not None and node not in done and node not in path:
            path.append(node)
            node = stages[node].next
        if node is not None and node in path:
            cycles.append(path[path.index(node) :])
        done.update(path)
    return cycles


# --------------------------------------------------------------------------
# Locating and loading the file.


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
