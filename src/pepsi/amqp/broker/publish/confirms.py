"""Grouping confirms: newly settled delivery tags as few basic.ack/basic.nack as can be.

Pure: `group_confirms` turns settled delivery tags into as few `basic.ack`/`basic.nack`
as `multiple=True` allows; the confirm-mode channel (`modes`) sends them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Confirm:
    """One basic.ack (ok) or basic.nack to send."""

    ok: bool
    tag: int
    multiple: bool


def group_confirms(
    settled_through: int, outcomes: Sequence[tuple[int, bool]]
) -> tuple[list[Confirm], int]:
    """The acks and nacks for newly settled tags, and the new `settled_through`.

    `settled_through`: every tag up to it is settled already. `outcomes`:
    (tag, ok) of tags settled now, above it, each once. A run of consecutive tags
    with one outcome that starts right after everything settled is one confirm
    with `multiple=True` (which settles every unsettled tag up to its own, so it
    may only be used when nothing before the run is still open); any other tag
    is confirmed alone.
    """
    ordered = sorted(outcomes)
    plan: list[Confirm] = []
    floor = settled_through
    i = 0
    while i < len(ordered):
        first, ok = ordered[i]
        j = i
        while (
            j + 1 < len(ordered)
            and ordered[j + 1][0] == ordered[j][0] + 1
            and ordered[j + 1][1] == ok
        ):
            j += 1
        last = ordered[j][0]
        if first == floor + 1:
            plan.append(Confirm(ok, last, multiple=j > i))
            floor = last
        else:
            plan.extend(Confirm(ok, tag, multiple=False) for tag, _ in ordered[i : j + 1])
        i = j + 1
    return plan, floor


__all__ = ["Confirm", "group_confirms"]
