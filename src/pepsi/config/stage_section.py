"""A `[stage-NAME]` section as a `StageConfig`: its keys, or a built-in's.

A PROGRAM of `pepsi-stage-…` names a built-in (`pepsi.stages.options`): its
own keys are parsed with the stage's and built into its options, and the
stage runs as a HANDLER in the unified `pepsi` program.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pepsi.config.keys import STAGE_KEYS, parse_section
from pepsi.config.model import RawValue, StageConfig, origin_of
from pepsi.errors import ConfigError

if TYPE_CHECKING:
    from pepsi.stages.options import Builtin


def build_stage(
    name: str, section: str, keys: Mapping[str, RawValue], origin: str | None
) -> StageConfig:
    """`[stage-NAME]` (`section`) as a StageConfig; ConfigError naming what is wrong."""
    program = keys.get("PROGRAM")
    builtin = None
    if program is not None and program.value.strip().startswith("pepsi-stage-"):
        # Imported only for a configuration that uses a built-in (a cheap worker start).
        from pepsi.stages.options import builtin_named  # noqa: PLC0415

        builtin = builtin_named(program.value)
    spec = STAGE_KEYS if builtin is None else {**STAGE_KEYS, **builtin.keys}
    values = parse_section(section, keys, spec)
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
