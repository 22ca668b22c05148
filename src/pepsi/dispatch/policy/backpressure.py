"""Status 75 (W-5): the connection limit is exhausted. Pure, clock injected.

The stage running the most workers gets its parallelism cap halved (floor 1)
for TEMPFAIL_WINDOW; another 75 halves it again and refreshes the window;
when the window passes, the stage is back to its PARALLELISM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Cap:
    workers: int
    until: float


def on_tempfail(
    caps: Mapping[str, Cap],
    running: Mapping[str, int],
    parallelism: Mapping[str, int],
    *,
    now: float,
    window: float,
) -> tuple[dict[str, Cap], str | None]:
    """New caps after a 75, and the stage that was halved (None if none runs)."""
    current = active(caps, now)
    busiest = max(running, key=lambda s: (running[s], s), default=None)
    if busiest is None or running[busiest] == 0:
        return current, None
    limit = current[busiest].workers if busiest in current else parallelism[busiest]
    halved = max(1, min(limit, running[busiest]) // 2)
    current[busiest] = Cap(halved, now + window)
    return current, busiest


def active(caps: Mapping[str, Cap], now: float) -> dict[str, Cap]:
    """The caps whose window has not passed."""
    return {stage: cap for stage, cap in caps.items() if cap.until > now}


def limit_for(caps: Mapping[str, Cap], stage: str, now: float) -> int | None:
    cap = caps.get(stage)
    return cap.workers if cap is not None and cap.until > now else None
