"""One batch of messages as one call of `pepsi.workqueue_publish`. Pure.

`build` checks routes and messages and makes the call's parameters;
`ids_from` maps the function's answer back onto the messages, in order.
Messages of one batch that share a deduplicated message id are sent once and
all get that message's id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg.types.json import Jsonb

from pepsi.config import Config, Overflow
from pepsi.publishing.errors import NoRoute
from pepsi.publishing.message import OutgoingMessage, validate

SQL = (
    "SELECT out_ord, out_id, out_inserted FROM pepsi.workqueue_publish("
    "%(rows)s::jsonb, %(headers)s::bytea[], %(bodies)s::bytea[], %(limits)s::jsonb, "
    "%(window)s)"
)


@dataclass(frozen=True)
class BatchCall:
    params: dict[str, Any]
    positions: tuple[int, ...]  # for each message given, the `ord` it was sent as

    @property
    def size(self) -> int:
        return len(self.positions)


def check_route(config: Config, stage: str) -> None:
    if stage not in config.stages:
        known = ", ".join(sorted(config.stages)) or "none configured"
        raise NoRoute(f"no stage named {stage!r} (stages: {known})")


def build(messages: Sequence[OutgoingMessage], config: Config) -> BatchCall:
    """Validate and route every message (refusing the batch on the first problem)."""
    rows: list[dict[str, Any]] = []
    headers: list[bytes | None] = []
    bodies: list[bytes | None] = []
    positions: list[int] = []
    first_of: dict[str, int] = {}
    for msg in messages:
        check_route(config, msg.stage)
        row = validate(msg, max_size=config.ingress.max_message_size)
        if row["dedup"] and row["message_id"] in first_of:
            positions.append(first_of[row["message_id"]])
            continue
        ord_ = len(rows) + 1
        if row["dedup"]:
            first_of[row["message_id"]] = ord_
        headers.append(row.pop("_header"))
        bodies.append(row.pop("_body"))
        rows.append({"ord": ord_, **row})
        positions.append(ord_)
    limits = [
        {
            "stage": name,
            "max_length": stage.max_length,
            "drop_head": stage.overflow is Overflow.DROP_HEAD,
            "bounce": stage.bounce_stage,
        }
        for name in sorted({r["stage"] for r in rows})
        if (stage := config.stages[name]).max_length is not None
    ]
    params = {
        "rows": Jsonb(rows),
        "headers": headers,
        "bodies": bodies,
        "limits": Jsonb(limits),
        "window": config.ingress.dedup_window,
    }
    return BatchCall(params, tuple(positions))


def ids_from(call: BatchCall, answer: Sequence[tuple[Any, ...]]) -> list[int]:
    """The id of each message given to `build`, in order."""
    by_ord = {int(row[0]): int(row[1]) for row in answer}
    return [by_ord[position] for position in call.positions]
