"""Reading the file, laying the overlay over it, and parsing the sections.

Parsing is pure: `parse_config` takes the raw sections and either returns a
`Config` or raises one ConfigError naming the file, section and key. Reading
files and choosing the default location are the only I/O here.
"""

from __future__ import annotations

import configparser
import difflib
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from pepsi.config import values as v
from pepsi.config.graph import validate_graph
from pepsi.config.ingress import INGRESS_KEYS, ingress_options
from pepsi.config.model import (
    MIB,
    OVERLAY_ORIGIN,
    STAGE_PREFIX,
    AmqpOptions,
    BouncerOptions,
    Config,
    DispatchOptions,
    PepsiOptions,
    PostgresOptions,
    RawSections,
    RawValue,
    StageConfig,
    WebOptions,
    origin_of,
)
from pepsi.errors import ConfigError

if TYPE_CHECKING:
    from pepsi.stages.options import Builtin


def read_file(path: Path) -> RawSections:
    """Read an INI file into raw sections; ConfigError on anything unreadable."""
    name = str(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError("configuration file not found", file=name) from None
    except (PermissionError, IsADirectoryError) as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", file=name) from None
    try:
        text = data.decode("utf-8-sig")  # an editor's byte-order mark is not content
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        hint = " (it looks like UTF-16)" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise ConfigError(f"line {lineno}: not UTF-8 text{hint}", file=name) from None
    return parse_ini(text, name)


def _strip_comment(line: str) -> str:
    """The line without its comment: `#` or `;` at the start or after whitespace."""
    for index, char in enumerate(line):
        if char in "#;" and (index == 0 or line[index - 1].isspace()):
            return line[:index].strip()
    return line.strip()


def _check_headers(text: str, name: str) -> None:
    """The header lines configparser misreads, as one error naming the line.

    configparser takes an unclosed `[stage-x` for a key (and reports a later
    line), and `[stage-x] y` or `[]` for sections of odd names.
    """
    for lineno, line in enumerate(text.splitlines(), start=1):
        content = _strip_comment(line)
        if not content.startswith("["):
            continue
        close = content.find("]")
        if close < 0:
            raise ConfigError(
                f"line {lineno}: section header {content!r} is not closed (expected [NAME])",
                file=name,
            )
        section, rest = content[1:close], content[close + 1 :].strip()
        if rest:
            raise ConfigError(
                f"line {lineno}: unexpected {rest!r} after the section header [{section}]",
                file=name,
            )
        if not section.strip():
            raise ConfigError(f"line {lineno}: empty section name {content!r}", file=name)


def parse_ini(text: str, name: str) -> RawSections:
    """Parse INI text with configparser (keys upper-cased, no interpolation)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # any editor's line endings
    _check_headers(text, name)
    parser = configparser.ConfigParser(
        interpolation=None,
        strict=True,
        inline_comment_prefixes=("#", ";"),
        default_section="\x00unused",  # so a [DEFAULT] section is just an unknown section
    )
    parser.optionxform = str.upper  # type: ignore[assignment,method-assign]
    try:
        parser.read_string(text, source=name)
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


# Each section: KEY -> (dataclass field, parser). Defaults live on the dataclasses.
Spec = Mapping[str, tuple[str, Callable[[str], Any]]]

PEPSI_KEYS: Spec = {
    "ALLOW_FUSION": ("allow_fusion", v.boolean),
    "SHARE_TELEMETRY": ("share_telemetry", v.boolean),
}
DISPATCH_KEYS: Spec = {
    "CONFIG_FILE": ("config_file", v.path),
    "POLL_INTERVAL": ("poll_interval", v.duration()),
    "STATS_INTERVAL": ("stats_interval", v.duration(1.0)),
    "FAIR_SCHEDULING": ("fair_scheduling", v.boolean),
    "FAIR_HALF_LIFE": ("fair_half_life", v.duration(1.0)),
    "FAIR_FIFO_PERCENT": ("fair_fifo_percent", v.integer(0, 100)),
    "WORKER_IDLE_TIMEOUT": ("worker_idle_timeout", v.duration()),
    "STRIKE_DELAY": ("strike_delay", v.duration()),
    "DB_ERROR_PAUSE": ("db_error_pause", v.duration()),
    "TEMPFAIL_WINDOW": ("tempfail_window", v.duration()),
    "START_COOLDOWN": ("start_cooldown", v.duration()),
    "METRICS_ADDRESS": ("metrics_address", v.listen_address),
    "VACUUM_AFTER": ("vacuum_after", v.integer(0)),
    "LOCK_WAIT": ("lock_wait", v.duration()),
    "WORKER_READY_TIMEOUT": ("worker_ready_timeout", v.duration()),
    "WORKER_STOP_TIMEOUT": ("worker_stop_timeout", v.duration()),
    "WORKER_KILL_GRACE": ("worker_kill_grace", v.duration()),
    "RECONNECT_MAX_DELAY": ("reconnect_max_delay", v.duration(0.1)),
}
POSTGRES_KEYS: Spec = {
    "DSN": ("dsn", v.text),
    "WORKER_DSN": ("worker_dsn", v.text),
    "DATA_DIR": ("data_dir", v.path),
    "WORKER_SYNCHRONOUS_COMMIT": ("worker_synchronous_commit", v.boolean),
    "POOL_MIN_SIZE": ("pool_min_size", v.integer(1, 1000)),
    "POOL_MAX_SIZE": ("pool_max_size", v.integer(1, 1000)),
    "CONNECT_TIMEOUT": ("connect_timeout", v.duration(1.0)),
}
BOUNCER_KEYS: Spec = {
    "SINK": ("sink", v.sink),
    "INTERVAL": ("interval", v.duration(0.1)),
}
STAGE_KEYS: Spec = {
    "PROGRAM": ("program", v.program),
    "HANDLER": ("handler", v.handler),
    "NEXT": ("next", v.stage_ref),
    "PARALLELISM": ("parallelism", v.integer(1, 1000)),
    "QUEUE_LIMIT": ("queue_limit", v.integer(1, 10000)),
    "MAX_MESSAGES": ("max_messages", v.integer(1)),
    "MAX_RUNTIME": ("max_runtime", v.duration()),
    "MAX_LIFETIME": ("max_lifetime", v.duration()),
    "RETRY_DELAY": ("retry_delay", v.duration()),
    "RETRY_MAX_DELAY": ("retry_max_delay", v.duration()),
    "BOUNCE_STAGE": ("bounce_stage", v.stage_ref),
    "FUSION": ("fusion", v.boolean),
    "MAX_LENGTH": ("max_length", v.integer(1)),
    "OVERFLOW": ("overflow", v.overflow),
    "TTL": ("ttl", v.duration()),
}
AMQP_KEYS: Spec = {
    "LISTEN": ("listen", v.listen_address),
    "HEARTBEAT": ("heartbeat", v.integer(0, 65535)),
    "FRAME_MAX": ("frame_max", v.integer(4096, 0xFFFFFFFF)),
    "CHANNEL_MAX": ("channel_max", v.integer(1, 65535)),
    "HANDSHAKE_TIMEOUT": ("handshake_timeout", v.duration(0.1)),
    "MAX_MESSAGE_SIZE": ("max_message_size", v.size(1, 512 * MIB)),
    "STAGES": ("stages", v.stage_names),
    "MAX_CONNECTIONS": ("max_connections", v.integer(1)),
    "CLIENT_CONNECTION_LIMIT": ("client_connection_limit", v.integer(1)),
    "PUBLISH_BUFFER": ("publish_buffer", v.size(MIB, 1024 * 1024 * MIB)),
    "CONNECTION_PUBLISH_BUFFER": ("connection_publish_buffer", v.size(MIB, 1024 * 1024 * MIB)),
}
WEB_KEYS: Spec = {
    "LISTEN": ("listen", v.listen_address),
    "PASSWORD": ("password", v.password_hash),
    "READ_ONLY": ("read_only", v.boolean),
    "SESSION_TTL": ("session_ttl", v.duration(60.0)),
    "PUBLIC_URL": ("public_url", v.public_url),
}
SECTIONS: Mapping[str, Spec] = {
    "pepsi": PEPSI_KEYS,
    "pepsi-dispatch": DISPATCH_KEYS,
    "pepsi-postgres": POSTGRES_KEYS,
    "pepsi-ingress": INGRESS_KEYS,
    "pepsi-failure-bouncer": BOUNCER_KEYS,
    "pepsi-amqp": AMQP_KEYS,
    "pepsi-web": WEB_KEYS,
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


def _amqp_options(
    parsed: dict[str, Any], raw: Mapping[str, Any], stages: Mapping[str, Any], file: str | None
) -> AmqpOptions:
    """[pepsi-amqp], with the checks that span keys or sections."""
    amqp = AmqpOptions(**parsed)
    for key, smaller, larger, larger_key in (
        (
            "CONNECTION_PUBLISH_BUFFER",
            amqp.connection_publish_buffer,
            amqp.max_message_size,
            "MAX_MESSAGE_SIZE",
        ),
        (
            "PUBLISH_BUFFER",
            amqp.publish_buffer,
            amqp.connection_publish_buffer,
            "CONNECTION_PUBLISH_BUFFER",
        ),
    ):
        if smaller < larger:
            raise ConfigError(
                f"{smaller} bytes is less than {larger_key} ({larger} bytes)",
                file=origin_of(raw, key, file),
                section="pepsi-amqp",
                key=key,
            )
    for name in amqp.stages:
        if name not in stages:
            raise ConfigError(
                f"no stage named {name!r}",
                file=origin_of(raw, "STAGES", file),
                section="pepsi-amqp",
                key="STAGES",
            )
    return amqp


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
            if not v.STAGE_NAME.fullmatch(name):
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
                "[pepsi-ingress], [pepsi-failure-bouncer], [pepsi-amqp], [pepsi-web] or "
                "[stage-NAME])",
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
            file=origin_of(keys, "POOL_MAX_SIZE", file),
            section="pepsi-postgres",
            key="POOL_MAX_SIZE",
        )
    dispatch = DispatchOptions(**parsed.get("pepsi-dispatch", {}))
    if dispatch.config_file is not None and not dispatch.config_file.is_absolute():
        raise ConfigError(
            "must be an absolute path (stage programs start in other directories)",
            file=origin_of(raw.get("pepsi-dispatch", {}), "CONFIG_FILE", file),
            section="pepsi-dispatch",
            key="CONFIG_FILE",
        )
    warnings = validate_graph(stages, raw)
    bouncer = BouncerOptions(**parsed.get("pepsi-failure-bouncer", {}))
    if bouncer.sink is not None and bouncer.sink not in stages:
        raise ConfigError(
            f"no stage named {bouncer.sink!r} (or SINK = table)",
            file=origin_of(raw.get("pepsi-failure-bouncer", {}), "SINK", file),
            section="pepsi-failure-bouncer",
            key="SINK",
        )
    amqp = _amqp_options(parsed.get("pepsi-amqp", {}), raw.get("pepsi-amqp", {}), stages, file)
    return Config(
        path=path,
        pepsi=PepsiOptions(**parsed.get("pepsi", {})),
        dispatch=dispatch,
        postgres=postgres,
        ingress=ingress_options(
            parsed.get("pepsi-ingress", {}), raw.get("pepsi-ingress", {}), stages, file
        ),
        bouncer=bouncer,
        amqp=amqp,
        web=WebOptions(**parsed.get("pepsi-web", {})),
        stages=MappingProxyType(stages),
        warnings=tuple(warnings),
    )


def _build_stage(
    name: str, section: str, keys: Mapping[str, RawValue], origin: str | None
) -> StageConfig:
    program = keys.get("PROGRAM")
    builtin = None
    if program is not None and program.value.strip().startswith("pepsi-stage-"):
        # Imported only for a configuration that uses a built-in (a cheap worker start).
        from pepsi.stages.options import builtin_named  # noqa: PLC0415

        builtin = builtin_named(program.value)
    spec = STAGE_KEYS if builtin is None else {**STAGE_KEYS, **builtin.keys}
    values = _parse_section(section, keys, spec)
    has_program, has_handler = "program" in values, "handler" in values
    if has_program == has_handler:
        problem = (
            "set exactly one of PROGRAM or HANDLER, not both"
            if has_program
            else "set PROGRAM (an executable) or HANDLER (package.module:function)"
        )
        raise ConfigError(problem, file=origin, section=section)
    if builtin is not None:
        values = _builtin_values(name, section, keys, values, builtin)
    return StageConfig(name=name, **values)


def _builtin_values(
    name: str,
    section: str,
    keys: Mapping[str, RawValue],
    values: dict[str, Any],
    builtin: Builtin,
) -> dict[str, Any]:
    """A built-in's options built from its own keys; it runs in the unified program."""
    from pepsi.stages.options import OptionError  # noqa: PLC0415

    own_attrs = {attr for attr, _ in builtin.keys.values()}
    own = {attr: values.pop(attr) for attr in list(values) if attr in own_attrs}
    try:
        options = builtin.build(name, own)
    except OptionError as exc:
        file = origin_of(keys, exc.key, origin_of(keys, "PROGRAM", None))
        raise ConfigError(str(exc), file=file, section=section, key=exc.key) from None
    return {
        **values,
        "handler": builtin.handler,  # the unified `pepsi` program hosts it, as a HANDLER
        "builtin": builtin.name,
        "builtin_options": options,
        "builtin_values": tuple(sorted(own.items())),
    }


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
