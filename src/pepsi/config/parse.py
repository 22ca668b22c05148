"""Parsing the sections: raw sections into one validated `Config`.

Parsing is pure: `parse_config` takes the raw sections and either returns a
`Config` or raises one ConfigError naming the file, section and key. Each
section's keys are parsed by its table (`keys`), a stage's by
`stage_section`; what is here are the checks that span keys or sections.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pepsi.config import values as v
from pepsi.config.graph import validate_graph
from pepsi.config.ingress import ingress_options
from pepsi.config.keys import SECTIONS, parse_section
from pepsi.config.model import (
    STAGE_PREFIX,
    AmqpOptions,
    BouncerOptions,
    Config,
    DispatchOptions,
    PepsiOptions,
    PostgresOptions,
    RawSections,
    StageConfig,
    WebOptions,
    origin_of,
)
from pepsi.config.stage_section import build_stage
from pepsi.errors import ConfigError


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
            parsed[section] = parse_section(section, keys, SECTIONS[section])
        elif section.startswith(STAGE_PREFIX):
            name = section[len(STAGE_PREFIX) :]
            origin = next(iter(keys.values())).origin if keys else file
            if not v.STAGE_NAME.fullmatch(name):
                raise ConfigError(
                    "stage names are lower-case letters, digits, '-' and '_' (at most 63)",
                    file=origin,
                    section=section,
                )
            stages[name] = build_stage(name, section, keys, origin)
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
