"""Consumers' outcomes waiting for their commit: `Outcomes`, and `worth_gathering`.

Pure: the acks, returns and dead letters recorded since the last write, by kind, and
the rule by which the settle task waits a moment for more before it writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Acks alone wait up to this long for more before they are written (nothing waits on
# them: the client's credit is freed at once), so that a statement writes hundreds: each
# cost the dispatcher and PostgreSQL more than its rows did. 10 ms took two thirds of the
# statements off the consuming path; 50 ms consumed about 12 % faster again.
SETTLE_GATHER_SECONDS = 0.05
SETTLE_GATHER_ROWS = 1000  # ... and no longer once this many are waiting


@dataclass
class Outcomes:
    """Outcomes waiting for their commit, by kind; ids with their stage."""

    acked: list[tuple[str, int]] = field(default_factory=list)
    returned: list[tuple[str, int]] = field(default_factory=list)
    unsent: list[tuple[str, int]] = field(default_factory=list)
    dead: list[tuple[str, int, str]] = field(default_factory=list)  # (stage, id, reason)

    def __len__(self) -> int:
        return len(self.acked) + len(self.returned) + len(self.unsent) + len(self.dead)

    def ids(self) -> list[int]:
        return [
            *(w for _, w in self.acked),
            *(w for _, w in self.returned),
            *(w for _, w in self.unsent),
            *(w for _, w, _ in self.dead),
        ]

    def take(self, limit: int) -> Outcomes:
        taken = Outcomes()
        room = limit
        for name in ("acked", "returned", "unsent", "dead"):
            mine: list[Any] = getattr(self, name)
            part, rest = mine[:room], mine[room:]
            setattr(taken, name, part)
            setattr(self, name, rest)
            room -= len(part)
        return taken

    def put_back(self, other: Outcomes) -> None:
        self.acked[:0] = other.acked
        self.returned[:0] = other.returned
        self.unsent[:0] = other.unsent
        self.dead[:0] = other.dead


def worth_gathering(outcomes: Outcomes, *, awaited: bool, closing: bool) -> bool:
    """Whether the outcomes waiting should wait SETTLE_GATHER_SECONDS for more before they
    are written: only acks (a returned or dead-lettered message goes at once), fewer than
    SETTLE_GATHER_ROWS, no `flush()` waiting on them, the deliverer not stopping."""
    return (
        not awaited
        and not closing
        and not (outcomes.returned or outcomes.unsent or outcomes.dead)
        and len(outcomes.acked) < SETTLE_GATHER_ROWS
    )


__all__ = ["SETTLE_GATHER_ROWS", "SETTLE_GATHER_SECONDS", "Outcomes", "worth_gathering"]
