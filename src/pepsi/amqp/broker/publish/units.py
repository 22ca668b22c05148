"""What the batcher is handed: a publish's rows (`Item`), items committed together (`Unit`).

A channel makes one `Item` per publish (a row per destination queue, with the limits of
those queues) and submits it as a `Unit`: alone, or with the rest of its transaction at
tx.commit. The batcher reports each unit's outcome once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from pepsi.publishing.message import Row

Limit = tuple[int, bool]  # (MAX_LENGTH, drop-head?)


@dataclass
class Item:
    """One publish: a row per destination queue (none: unroutable, settled in order)."""

    rows: list[Row]
    limits: dict[str, Limit] = field(default_factory=dict)  # stage -> its limit
    refused: bool = False  # a reject-publish queue had no room
    rejected: bool = False  # ... by the broker's x-max-length-bytes estimate, at publish

    @property
    def size(self) -> int:
        total = 0
        for r in self.rows:
            total += len(r.body or b"") + len(r.header or b"")
        return total


class Unit:
    """Items committed together or not at all; `done` gets the outcome once.

    `done(items, None)` after the commit (each item's `refused` says whether a
    reject-publish queue refused it); `done(items, error)` if it did not commit.
    `rows` and `size` are counted once here: a unit's items do not change after.
    A plain class with slots, not a dataclass: one is made per publish.
    """

    __slots__ = ("done", "items", "rows", "size")

    def __init__(
        self, items: list[Item], done: Callable[[list[Item], BaseException | None], None]
    ) -> None:
        self.items = items
        self.done = done
        rows = size = 0
        for item in items:
            for row in item.rows:
                rows += 1
                size += len(row.body or b"") + len(row.header or b"")
        self.rows, self.size = rows, size


def rows_per_stage(
    units: Iterable[Unit], direct: Mapping[str, int] | None = None
) -> dict[str, int | None]:
    """The pending rows a commit of `units` made, per stage; None where not known: a stage
    with a length limit (the publish function may drop or refuse rows there) or a row
    with deduplication (it may have been a duplicate). `direct`: rows per stage written
    running for consumers instead (not pending; a stage left with none is left out)."""
    counts: dict[str, int | None] = {}
    for unit in units:
        for item in unit.items:
            for row in item.rows:
                known = counts.get(row.stage, 0)
                if known is None or row.dedup or row.stage in item.limits:
                    counts[row.stage] = None
                else:
                    counts[row.stage] = known + 1
    for stage, n in (direct or {}).items():
        known = counts.get(stage)
        if known is not None:
            if known > n:
                counts[stage] = known - n
            else:
                del counts[stage]
    return counts


__all__ = ["Item", "Limit", "Unit", "rows_per_stage"]
