"""pepsi.conf: INI sections parsed into frozen dataclasses, validated as a stage graph.

Layout of the file (see docs/configuration.md for every key):

    [pepsi]             global switches
    [pepsi-dispatch]    the dispatcher
    [pepsi-postgres]    the database (embedded by default)
    [pepsi-ingress]     publishing: deduplication window, message size limit
    [pepsi-failure-bouncer]  where failed messages without a BOUNCE_STAGE go
    [stage-NAME]        one per stage

The package: `model` (the frozen dataclasses and their defaults), `values`
(one parser per value type), `ini` (reading the file), `keys` (each
section's keys), `parse` (`parse_config`), `stage_section` (a [stage-NAME]),
`load` (finding the file, the overlay merge, `load_config`), `graph`
(NEXT/BOUNCE_STAGE checks) and `overlay` (reading `pepsi.config_override`
from the database). Importers use the names re-exported here.
"""

from __future__ import annotations

from pepsi.config.graph import next_cycles, validate_graph
from pepsi.config.ini import read_file
from pepsi.config.load import default_locations, find_config, load_config, merge_overlay
from pepsi.config.model import (
    MAX_LIFETIME,
    MAX_RUNTIME,
    MIB,
    OVERLAY_ORIGIN,
    RETRY_DELAY,
    RETRY_MAX_DELAY,
    STAGE_PREFIX,
    BouncerOptions,
    Config,
    DispatchOptions,
    IngressOptions,
    Overflow,
    PepsiOptions,
    PostgresOptions,
    RawSections,
    RawValue,
    StageConfig,
    default_data_dir,
)
from pepsi.config.overlay import OverlayRow, read_overlay, read_overlay_async, with_overlay
from pepsi.config.parse import parse_config
from pepsi.config.values import HANDLER_REF, STAGE_NAME

__all__ = [
    "HANDLER_REF",
    "MAX_LIFETIME",
    "MAX_RUNTIME",
    "MIB",
    "OVERLAY_ORIGIN",
    "RETRY_DELAY",
    "RETRY_MAX_DELAY",
    "STAGE_NAME",
    "STAGE_PREFIX",
    "BouncerOptions",
    "Config",
    "DispatchOptions",
    "IngressOptions",
    "Overflow",
    "OverlayRow",
    "PepsiOptions",
    "PostgresOptions",
    "RawSections",
    "RawValue",
    "StageConfig",
    "default_data_dir",
    "default_locations",
    "find_config",
    "load_config",
    "merge_overlay",
    "next_cycles",
    "parse_config",
    "read_file",
    "read_overlay",
    "read_overlay_async",
    "validate_graph",
    "with_overlay",
]
