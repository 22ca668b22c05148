"""A publish batch's rows as the arguments of the publish functions.

Without a length limit in the batch, the batcher calls `pepsi.amqp_publish`
(`LEAN_SQL`, `lean_params`: only the columns a publish fills); with one,
`pepsi.workqueue_publish` (`call_params`), which enforces the limits. `split` sorts a
batch's rows by what their queue's limit asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from pepsi.amqp.broker.publish.units import Item, Limit
from pepsi.db.queries import query_text
from pepsi.publishing.message import Row

DEDUP_WINDOW: Final = 86400.0  # the function's argument; AMQP publishes never deduplicate
LEAN_SQL: Final = query_text("amqp_publish")
# The Row fields pepsi.amqp_publish takes, in its arguments' order, and those it does not
# (a basic.publish never sets them; dedup is False).
_LEAN_FIELDS: Final = tuple(Row._fields.index(name) for name in (
    "stage", "message_id", "origin_user", "origin_peer", "content_type", "correlation_id",
    "properties", "expires", "header", "body", "priority",
))  # fmt: skip
LEAN_BODIES: Final = len(_LEAN_FIELDS) - 2  # the bodies: never packed (see arrays)
_PRIORITY: Final = Row._fields.index("priority")
_DEDUP: Final = Row._fields.index("dedup")
_ENVELOPE_FIELDS: Final = tuple(
    Row._fields.index(name) for name in ("sender", "recipients", "header_from", "subject")
)


def call_params(rows: Sequence[Row], limits: dict[str, Limit]) -> tuple[Any, ...]:
    """The arguments of `pepsi.workqueue_publish` for `rows`, with their stages' limits."""
    columns = [list(column) for column in zip(*rows, strict=True)]
    priorities = columns.pop()  # the function's last argument; NULL: all 0
    stages = sorted(limits)
    return (
        *columns,
        stages,
        [limits[s][0] for s in stages],
        [limits[s][1] for s in stages],
        [None] * len(stages),  # BOUNCE_STAGE: no dead-letter route for AMQP queues yet
        DEDUP_WINDOW,
        priorities if any(priorities) else None,
    )


def lean_params(
    rows: Sequence[Row], running: Sequence[bool] | None = None
) -> tuple[Any, ...] | None:
    """The arguments of `pepsi.amqp_publish` for `rows`, or None when a row carries a
    field only `pepsi.workqueue_publish` takes (dedup or an envelope field). `running`:
    which rows are written running, for consumers that wait (None: none)."""
    columns = list(zip(*rows, strict=True))
    if any(columns[_DEDUP]):
        return None
    n = len(rows)
    for index in _ENVELOPE_FIELDS:
        if columns[index].count(None) != n:
            return None
    lean = [list(columns[i]) for i in _LEAN_FIELDS]
    if not any(columns[_PRIORITY]):
        lean[-1] = None  # type: ignore[call-overload]  # NULL: all 0, nothing to send
    return (*lean, list(running) if running is not None and any(running) else None)


def split(
    items: Sequence[Item],
) -> tuple[list[Row], dict[str, Limit], dict[str, list[tuple[Item, Row]]]]:
    """Rows for one call (unlimited and drop-head stages, with those limits), and the rows
    of each reject-publish stage with their items, in order. Resets `refused` (to
    `rejected`: refused at publish already)."""
    free: list[Row] = []
    free_limits: dict[str, Limit] = {}
    guarded: dict[str, list[tuple[Item, Row]]] = {}
    for item in items:
        item.refused = item.rejected
        for row in item.rows:
            limit = item.limits.get(row.stage)
            if limit is not None and not limit[1]:
                guarded.setdefault(row.stage, []).append((item, row))
            else:
                free.append(row)
                if limit is not None:
                    free_limits[row.stage] = limit
    return free, free_limits, guarded


__all__ = ["DEDUP_WINDOW", "LEAN_BODIES", "LEAN_SQL", "call_params", "lean_params", "split"]
