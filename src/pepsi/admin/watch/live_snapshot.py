"""The dispatcher's live snapshot as a reader gets it: one notification, or the parts of one.

`parse` reads one `NOTIFY pepsi_live` payload (version 1, written by
`pepsi.dispatch.services.live`) into a `Part`; a snapshot too large for one
notification comes in several, and `Assembler` joins them into the whole
`LiveSnapshot`. Pure: no connection, no clock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class StageLive:
    counters: Mapping[str, int]  # processed, failed, ... since the dispatcher's start
    in_flight: int = 0
    workers: int = 0


@dataclass(frozen=True)
class Part:
    """One notification: a snapshot, or one part of it."""

    pid: int
    started: float  # the dispatcher's start, Unix time
    at: float  # when taken, the dispatcher's wall clock
    seq: int
    quiet_since: float
    interval: float
    heartbeat: float  # the longest silence of an idle dispatcher
    final: bool
    dispatch: Mapping[str, int]
    stages: Mapping[str, StageLive]
    part: int = 1
    parts: int = 1
    dropped: int = 0  # stages left out of the snapshot (too many to send)
    executing: tuple[int, ...] = ()  # the messages workers have started (their heads)
    executing_complete: bool = True  # False: more were started than the snapshot names


# A whole snapshot is a part that is the only one.
LiveSnapshot = Part


def parse(payload: str) -> Part:
    """One notification's payload; ValueError if it is not one of ours."""
    try:
        data = json.loads(payload)
        if not isinstance(data, dict) or data.get("v") != 1:
            raise ValueError("not a version 1 live snapshot")
        fields = [str(name) for name in data["fields"]]
        stages = {}
        for name, values in dict(data["stages"]).items():
            row = dict(zip(fields, (int(v) for v in values), strict=True))
            in_flight, workers = row.pop("in_flight", 0), row.pop("workers", 0)
            stages[str(name)] = StageLive(row, in_flight, workers)
        return Part(
            pid=int(data["pid"]),
            started=float(data["start"]),
            at=float(data["t"]),
            seq=int(data["seq"]),
            quiet_since=float(data.get("quiet_since") or data["t"]),
            interval=float(data["interval"]),
            heartbeat=float(data["heartbeat"]),
            final=bool(data.get("final", False)),
            dispatch={str(k): int(v) for k, v in dict(data["dispatch"]).items()},
            stages=stages,
            part=int(data.get("part", 1)),
            parts=int(data.get("parts", 1)),
            dropped=int(data.get("dropped", 0)),
            executing=tuple(int(i) for i in data.get("executing", ())),
            executing_complete=bool(data.get("executing_complete", True)),
        )
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a live snapshot: {exc}") from None


class Assembler:
    """Joins the parts of a split snapshot; a part of another snapshot drops the rest."""

    def __init__(self) -> None:
        self._key: tuple[int, float, int] | None = None
        self._parts: dict[int, Part] = {}

    def add(self, part: Part) -> LiveSnapshot | None:
        """The whole snapshot once its last part came; None until then."""
        if part.parts <= 1:
            self._key, self._parts = None, {}
            return part
        key = (part.pid, part.started, part.seq)
        if key != self._key:
            self._key, self._parts = key, {}
        self._parts[part.part] = part
        if len(self._parts) < part.parts:
            return None
        stages: dict[str, StageLive] = {}
        for n in sorted(self._parts):
            stages.update(self._parts[n].stages)
        self._key, self._parts = None, {}
        return Part(
            pid=part.pid, started=part.started, at=part.at, seq=part.seq,
            quiet_since=part.quiet_since, interval=part.interval, heartbeat=part.heartbeat,
            final=part.final, dispatch=part.dispatch, stages=stages, dropped=part.dropped,
            executing=part.executing, executing_complete=part.executing_complete,
        )  # fmt: skip
