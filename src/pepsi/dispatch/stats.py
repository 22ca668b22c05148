"""Statistics (P-9): counted in the dispatcher's memory, written in one statement.

Counters are deltas since the last flush. The loop flushes them every
STATS_INTERVAL, when the pipeline goes idle (at most once a second) and at
shutdown; with nothing counted, a flush writes nothing, so an idle dispatcher
does no statistics work. Wakeups are counted but do not make a flush due by
themselves (the idle heartbeat would otherwise write every POLL_INTERVAL):
they ride along with the next flush that has something else to say.
Unflushed deltas are lost if the dispatcher dies: the counters are
best-effort. `totals` keeps everything since start for the metrics endpoint.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pepsi.protocol import Pass

STAGE_FIELDS = (
    "processed",
    "failed",
    "strikes",
    "requeued",
    "busy_us",
    "finished",
    "advanced",
    "paused",
    "retries",
    "timed_out",
)
WAKEUP_CAUSES = ("notify", "worker", "poll", "timer")
DISPATCH_FIELDS = (
    "claims",
    "claimed",
    "stages_executed",
    "workers_started",
    "workers_crashed",
    "workers_retired",
    "paused_resumed",
    "bodies_collected",
    "backpressure_events",
    *(f"wakeups_{cause}" for cause in WAKEUP_CAUSES),
)
PASSIVE = frozenset(f"wakeups_{cause}" for cause in WAKEUP_CAUSES)

# A worker's named outcome -> the stage counter it feeds ("fail" is the status).
OUTCOME_COUNTERS = {
    "finish": "finished",
    "advance": "advanced",
    "pause": "paused",
    "retry": "retries",
}


@dataclass
class Counts:
    stages: dict[str, Counter[str]] = field(default_factory=dict)
    dispatch: Counter[str] = field(default_factory=Counter)

    def add(self, other: Counts) -> None:
        for name, counter in other.stages.items():
            self.stages.setdefault(name, Counter()).update(counter)
        self.dispatch.update(other.dispatch)


@dataclass
class Stats:
    delta: Counts = field(default_factory=Counts)
    totals: Counts = field(default_factory=Counts)  # since start, for /metrics

    def stage(self, name: str, counter: str, n: int = 1) -> None:
        assert counter in STAGE_FIELDS, counter
        if n:
            self._counts(name)[counter] += n

    def _counts(self, stage: str) -> Counter[str]:
        counts = self.delta.stages.get(stage)
        if counts is None:  # not setdefault: a Counter built per call, per message
            counts = self.delta.stages[stage] = Counter()
        return counts

    def count(self, counter: str, n: int = 1) -> None:
        assert counter in DISPATCH_FIELDS, counter
        if n:
            self.delta.dispatch[counter] += n

    def wakeup(self, cause: str) -> None:
        self.count(f"wakeups_{cause}")

    def passes(self, stage: str, ok: bool, report: tuple[Pass, ...] | None) -> None:
        """A status line: fused stages count one by one from its report.

        Only the last stage of a failed pass failed; the ones before it ran.
        """
        if not report:
            self.stage(stage, "processed" if ok else "failed")
            return
        for position, entry in enumerate(report, start=1):
            counts = self._counts(entry.stage)
            counts["busy_us"] += entry.micros
            last_failed = not ok and position == len(report)
            counts["failed" if last_failed else "processed"] += 1
            counter = OUTCOME_COUNTERS.get(entry.outcome or "")
            if counter and not last_failed:
                counts[counter] += 1

    def __bool__(self) -> bool:
        """Whether a flush is due: anything counted but wakeups."""
        return any(self.delta.stages.values()) or any(
            n for k, n in self.delta.dispatch.items() if k not in PASSIVE
        )

    def empty(self) -> bool:
        return not any(self.delta.stages.values()) and not any(self.delta.dispatch.values())

    def take(self) -> dict[str, Any]:
        """The deltas as the flush statement's parameters; the deltas restart."""
        delta, self.delta = self.delta, Counts()
        self.totals.add(delta)
        names = sorted(delta.stages)
        params: dict[str, Any] = {"stages": names}
        for name in STAGE_FIELDS:
            params[name] = [delta.stages[s][name] for s in names]
        for name in DISPATCH_FIELDS:
            params[f"d_{name}"] = delta.dispatch[name]
        return params

    def snapshot(self) -> Counts:
        """Everything counted since start, flushed or not (a copy)."""
        out = Counts()
        out.add(self.totals)
        out.add(self.delta)
        return out
