"""The features a worker's stage uses, as telemetry counts them: names, never values (P-11)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pepsi.config import Config, StageConfig

# Stage fields that are not options, or whose value would say more than a name.
_NOT_OPTIONS = frozenset({"name", "program", "handler", "builtin", "builtin_options"})


def features(config: Config, stage: StageConfig) -> tuple[dict[str, str], list[str]]:
    """What a worker's stage uses: its kind (and built-in), and the names of options set.

    Names only, from the configuration: never values, addresses, the
    handler's module or anything of a message.
    """
    if stage.builtin is not None:
        kind = {"pepsi.stage.kind": "builtin", "pepsi.builtin": stage.builtin}
    elif stage.handler is not None:
        kind = {"pepsi.stage.kind": "handler"}
    else:
        kind = {"pepsi.stage.kind": "program"}
    default = StageConfig(name=stage.name)
    options = [
        f.name.upper()
        for f in dataclasses.fields(StageConfig)
        if f.name not in _NOT_OPTIONS and getattr(stage, f.name) != getattr(default, f.name)
    ]
    options += [f"BUILTIN.{key}" for key in _builtin_keys(stage.builtin_options)]
    if not config.pepsi.allow_fusion:
        options.append("PEPSI.ALLOW_FUSION")
    return kind, options


def _builtin_keys(options: object) -> Sequence[str]:
    if options is None or not dataclasses.is_dataclass(options):
        return ()
    return [f.name.upper() for f in dataclasses.fields(options) if getattr(options, f.name)]
