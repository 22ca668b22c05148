"""Direct delivery: the rows of a publish batch that go straight to waiting consumers.

A row for an AMQP queue whose consumers' read-ahead has room, and that has nothing
pending, is written `running` by the publish's own statement and handed to the
consumers when its commit returns: no claim of its own, no second commit waiting for
the disk, no turn of the dispatcher's loop (issue 36; docs/amqp.md, "Direct
delivery"). It is what the claim would have done a round trip later: the dispatcher's
process is still the only one that makes rows running for consumers (A-1). A pending
row of the queue goes first, so a queue with one (or one not known to be empty) gets
none. Pure: the deliverer says how much room each queue has (`direct_room`); `choose`
picks the rows and `delivery` builds what basic.deliver sends, as the claim's
`pepsi.amqp_claimed_delivery` would.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from pepsi.publishing.message import Row

ROUTES_KEPT = 1024  # routing JSON texts remembered (one per exchange and routing key)


class DirectTarget(Protocol):
    """The consumers' side of direct delivery (`Deliverer`, consume/readahead.py)."""

    def direct_room(self, stages: Iterable[str]) -> dict[str, int]: ...

    def reserve_direct(self, taken: Mapping[str, int]) -> dict[str, int]: ...

    def release_direct(self, taken: Mapping[str, int]) -> None: ...

    def deliver_direct(
        self, rows: Sequence[tuple[int, str, Sequence[Any]]], epochs: Mapping[str, int]
    ) -> None: ...


class Direct(NamedTuple):
    """Rows a commit wrote running for consumers: the deliverer's reservation for them
    (`taken` per stage, the stages' `epochs` then), and once committed their rows as
    `pepsi.amqp_claimed_delivery` returns them."""

    taken: dict[str, int]
    epochs: dict[str, int]
    rows: list[tuple[int, str, tuple[Any, ...]]]


def choose(
    rows: Sequence[Row], room: Mapping[str, int], routes: dict[str, tuple[str, str] | None]
) -> tuple[list[bool], dict[str, int]]:
    """Which rows go direct, in order, and how many per stage. A stage's rows go while
    its room lasts; once one of them stays pending, its later ones do too (a message
    must not pass an older one of its queue). A row whose properties do not say its
    exchange (not an AMQP publish's) stays pending."""
    left = dict(room)
    flags: list[bool] = []
    taken: dict[str, int] = {}
    for row in rows:
        stage = row.stage
        n = left.get(stage, 0)
        if n > 0 and route(row.properties, routes) is not None:
            left[stage] = n - 1
            taken[stage] = taken.get(stage, 0) + 1
            flags.append(True)
        else:
            left[stage] = 0  # closed for the rest of the batch
            flags.append(False)
    return flags, taken


def route(
    properties: str | None, routes: dict[str, tuple[str, str] | None]
) -> tuple[str, str] | None:
    """(exchange, routing key) of a row's properties JSON; None without an exchange.
    Remembered per text: a channel sends one per (exchange, routing key)."""
    if properties is None:
        return None
    if properties in routes:
        return routes[properties]
    try:
        value = json.loads(properties)
    except ValueError:
        value = None
    exchange = value.get("exchange") if isinstance(value, dict) else None
    key = value.get("routing_key") if isinstance(value, dict) else None
    result = (exchange, key) if isinstance(exchange, str) and isinstance(key, str) else None
    if len(routes) >= ROUTES_KEPT:
        routes.clear()
    routes[properties] = result
    return result


def delivery(wid: int, row: Row, exchange: str, routing_key: str) -> tuple[Any, ...]:
    """What basic.deliver sends for a row just written running, in the columns of
    `pepsi.amqp_claimed_delivery` (a first delivery: no count, no deaths)."""
    expires = None if row.expires is None else row.expires.timestamp()
    return (wid, exchange, routing_key, None, None, None, None, expires, row.header, row.body, None)


__all__ = ["ROUTES_KEPT", "Direct", "DirectTarget", "choose", "delivery", "route"]
