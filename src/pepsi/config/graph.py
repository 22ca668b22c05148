"""The stage graph: NEXT, BOUNCE_STAGE, built-in routes (THEN, ELSE) and the stages
built-ins make messages in (DSN_STAGE) must name stages; cycles are warnings."""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from pepsi.config.model import STAGE_PREFIX, RawSections, StageConfig, origin_of
from pepsi.config.values import is_amqp_stage
from pepsi.errors import ConfigError


def validate_graph(stages: Mapping[str, StageConfig], raw: RawSections) -> list[str]:
    """Check that every stage named by NEXT/BOUNCE_STAGE/THEN/ELSE exists; return warnings."""
    for stage in stages.values():
        section = STAGE_PREFIX + stage.name
        keys = raw.get(section, {})
        edges = (
            ("NEXT", stage.next), ("BOUNCE_STAGE", stage.bounce_stage), *stage.routes,
            *stage.spawns,  # must exist, but a message made there is a new message: no cycle
        )  # fmt: skip
        for key, target in edges:
            if target is not None and target not in stages and not is_amqp_stage(target):
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
        if stage.next is not None and _ignores_next(stage):
            warnings.append(
                f"[stage-{stage.name}] NEXT has no effect: pepsi-stage-{stage.builtin} "
                + ("goes to THEN or ELSE" if stage.builtin == "if" else "never advances")
            )
    warnings.extend(
        f"stages {' -> '.join([*cycle, cycle[0]])} form a NEXT cycle: "
        "messages finish only if a stage ends them"
        for cycle in next_cycles(stages)
    )
    warnings.extend(
        f"stages {' -> '.join([*cycle, cycle[0]])} form a cycle through a built-in's routes: "
        "messages finish only if a stage ends them"
        for cycle in route_cycles(stages)
    )
    return warnings


def _ignores_next(stage: StageConfig) -> bool:
    """A built-in that never goes on to NEXT: discard, bounce, an if with an ELSE."""
    if stage.builtin in ("discard", "bounce"):
        return True
    return any(key == "ELSE" for key, _ in stage.routes)


def route_cycles(stages: Mapping[str, StageConfig]) -> list[list[str]]:
    """Cycles that take at least one built-in route (THEN, ELSE), one per back edge.

    Pure NEXT cycles are `next_cycles`' to report; a depth-first search over
    NEXT and the routes finds the others.
    """
    edges = {
        name: [t for t in (s.next, *(target for _, target in s.routes)) if t in stages]
        for name, s in stages.items()
    }
    pure = {frozenset(cycle) for cycle in next_cycles(stages)}
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()
    done: set[str] = set()
    for root in stages:
        if root in done:
            continue
        path: list[str] = [root]
        stack = [iter(edges[root])]
        while stack:
            target = next(stack[-1], None)
            if target is None:
                done.add(path.pop())
                stack.pop()
            elif target in path:
                cycle = path[path.index(target) :]
                key = frozenset(cycle)
                if key not in seen and key not in pure:
                    seen.add(key)
                    found.append(cycle)
            elif target not in done:
                path.append(target)
                stack.append(iter(edges[target]))
    return found


def next_cycles(stages: Mapping[str, StageConfig]) -> list[list[str]]:
    """Cycles in the NEXT graph (each stage has at most one NEXT, so they are disjoint)."""
    cycles: list[list[str]] = []
    done: set[str] = set()
    for start in stages:
        path: list[str] = []
        node: str | None = start
        while node is not None and node not in done and node not in path and node in stages:
            path.append(node)
            node = stages[node].next
        if node is not None and node in path:
            cycles.append(path[path.index(node) :])
        done.update(path)
    return cycles
