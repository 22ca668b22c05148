"""One batch of messages as one call of the publish function. Pure.

`build` checks routes and messages and makes the call: the general
`pepsi.workqueue_publish` (dedup, MAX_LENGTH, envelope fields), or
`pepsi.workqueue_publish_plain` when every message is only a stage, a header
block and a body, no stage of the batch has a MAX_LENGTH and nothing is
deduplicated (`pepsi.workqueue_publish_one` when that batch is one message).
The batch goes as typed parallel arrays, in binary.
`ids_from` maps the function's answer back onto the messages, in order.
Messages of one batch that share a deduplicated message id are sent once and
all get that message's id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pepsi.config import Config, Overflow
from pepsi.db.queries import query_text
from pepsi.publishing.errors import NoRoute
from pepsi.publishing.message import (
    Body,
    OutgoingMessage,
    Row,
    bare,
    checked_body,
    parts,
    validate,
)

# Each returns one row per message sent, in publish order. Strings, not
# sql.SQL: executed as they are, prepared by psycopg after a few runs. In
# queries.sql they stay one line with no comment: that text is what the
# server sees and what the benchmarks measured.
SQL = query_text("workqueue_publish")
PLAIN_SQL = query_text("workqueue_publish_plain")
ONE_SQL = query_text("workqueue_publish_one")


@dataclass(frozen=True)
class BatchCall:
    sql: str
    params: tuple[Any, ...]
    positions: tuple[int, ...]  # for each message given, the `ord` it was sent as (from 1)

    @property
    def size(self) -> int:
        return len(self.positions)


def check_route(config: Config, stage: str) -> None:
    if stage not in config.stages:
        known = ", ".join(sorted(config.stages)) or "none configured"
        raise NoRoute(f"no stage named {stage!r} (stages: {known})")


def build(messages: Sequence[OutgoingMessage], config: Config, *, fast: bool = True) -> BatchCall:
    """Validate and route every message (refusing the batch on the first problem).

    `fast=False` always makes the general call (the tests compare the paths).
    """
    if fast and (call := _plain(messages, config)) is not None:
        return call
    stages = config.stages
    max_size = config.ingress.max_message_size
    rows: list[Row] = []
    positions: list[int] = []
    first_of: dict[str, int] = {}
    plain = fast
    for msg in messages:
        if msg.stage not in stages:
            check_route(config, msg.stage)
        row = validate(msg, max_size=max_size)
        if row.dedup:
            plain = False
            assert row.message_id is not None  # validate refuses dedup without one
            if row.message_id in first_of:
                positions.append(first_of[row.message_id])
                continue
            first_of[row.message_id] = len(rows) + 1
        elif plain and not row.plain:
            plain = False
        rows.append(row)
        positions.append(len(rows))
    limited = sorted(
        name for name in {r.stage for r in rows} if stages[name].max_length is not None
    )
    if plain and not limited and len(rows) == 1:
        one = rows[0]
        return BatchCall(ONE_SQL, (one.stage, one.header, one.body), tuple(positions))
    columns = [list(column) for column in zip(*rows, strict=True)]
    if plain and not limited:
        named = dict(zip(Row._fields, columns, strict=True))
        params: tuple[Any, ...] = (named["stage"], named["header"], named["body"])
        return BatchCall(PLAIN_SQL, params, tuple(positions))
    limits = [stages[name] for name in limited]
    priorities = columns.pop()  # the function's last argument; NULL: all 0
    params = (
        *columns,
        limited,
        [s.max_length for s in limits],
        [s.overflow is Overflow.DROP_HEAD for s in limits],
        [s.bounce_stage for s in limits],
        float(config.ingress.dedup_window),
        priorities if any(priorities) else None,
    )
    return BatchCall(SQL, params, tuple(positions))


def _plain(messages: Sequence[OutgoingMessage], config: Config) -> BatchCall | None:
    """The fast paths' call, made without rows; None as soon as a message needs more
    (the general loop then checks every message again, in order, with the same errors)."""
    stages = config.stages
    unlimited = {name for name, stage in stages.items() if stage.max_length is None}
    max_size = config.ingress.max_message_size
    names: list[str] = []
    headers: list[bytes | None] = []
    bodies: list[bytes | None] = []
    for msg in messages:
        stage = msg.stage
        if type(stage) is not str or stage not in unlimited or not bare(msg):
            return None
        header, body = parts(msg, max_size=max_size)
        names.append(stage)
        headers.append(header)
        bodies.append(body)
    if not names:
        return None
    positions = tuple(range(1, len(names) + 1))
    if len(names) == 1:
        return BatchCall(ONE_SQL, (names[0], headers[0], bodies[0]), positions)
    return BatchCall(PLAIN_SQL, (names, headers, bodies), positions)


def single(stage: str, body: Body | None, config: Config) -> BatchCall:
    """`build([OutgoingMessage(stage, body)], config)` without making the message, for a
    known stage without MAX_LENGTH (the caller's check): a single publish's short way."""
    max_size = config.ingress.max_message_size
    return BatchCall(ONE_SQL, (stage, None, checked_body(body, max_size=max_size)), (1,))


def ids_from(call: BatchCall, answer: Sequence[tuple[Any, ...]]) -> list[int]:
    """The id of each message given to `build`, in order."""
    if call.sql != SQL:  # the fast paths: one id per message, in order
        return [int(row[0]) for row in answer]
    by_ord = {int(row[0]): int(row[1]) for row in answer}
    return [by_ord[position] for position in call.positions]
