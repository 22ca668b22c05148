"""Statistics (P-9): counted in the dispatcher's memory, written in one statement.

Counters are deltas since the last flush. The loop flushes them every
STATS_INTERVAL, when the pipeline goes idle (at most once a second) and at
shutdown; with nothing counted, a flush writes nothing, so an idle dispatcher
does no statistics work. Unflushed deltas are lost if the dispatcher dies:
the counters are best-effort.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

STAGE_FIELDS = ("processed", "failed", "strikes", "requeued", "busy_us")
DISPATCH_FIELDS = (
    "claims",
    "claimed",
    "stages_executed",
    "workers_started",
    "workers_crashed",
    "paused_resumed",
    "bodies_collected",
)


@dataclass
class Stats:
    stages: dict[str, Counter[str]] = field(default_factory=dict)
    dispatch: Counter[str] = field(default_factory=Counter)

    def stage(self, name: str, counter: str, n: int = 1) -> None:
        assert counter in STAGE_FIELDS, counter
        if n:
            self.stages.setdefault(name, Counter())[counter] += n

    def count(self, counter: str, n: int = 1) -> None:
        assert counter in DISPATCH_FIELDS, counter
        if n:
            self.dispatch[counter] += n

    def __bool__(self) -> bool:
        return bool(self.dispatch) or any(self.stages.values())

    def take(self) -> dict[str, Any]:
        """The deltas as the flush statement's parameters; the counters restart."""
        names = sorted(self.stages)
        params: dict[str, Any] = {"stages": names}
        for name in STAGE_FIELDS:
            params[name] = [self.stages[s][name] for s in names]
        for name in DISPATCH_FIELDS:
            params[f"d_{name}"] = self.dispatch[name]
        self.stages = {}
        self.dispatch = Counter()
        return params
