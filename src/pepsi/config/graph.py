"""The stage graph: NEXT and BOUNCE_STAGE must name stages; cycles are warnings."""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from pepsi.config.model import STAGE_PREFIX, RawSections, StageConfig, origin_of
from pepsi.errors import ConfigError


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
                    file=origin_of(keys, key, None),
                    section=section,
                    key=key,
                )
        if stage.bounce_stage == stage.name:
            raise ConfigError(
                "a stage cannot bounce to itself (failures would loop)",
                file=origin_of(keys, "BOUNCE_STAGE", None),
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
