"""Direct delivery (issue 36): which rows of a publish batch go straight to waiting
consumers, what they are sent as, and the deliverer's room for them."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from pepsi.amqp.broker.consume.delivery import Deliverer
from pepsi.amqp.broker.consume.fetched import Fetched, fetched_row
from pepsi.amqp.broker.consume.state import NoDispatch, subtract
from pepsi.amqp.broker.publish.columns import routing_json
from pepsi.amqp.broker.publish.direct import choose, delivery, route
from pepsi.amqp.broker.publish.units import Item, Unit, rows_per_stage
from pepsi.amqp.model.consumers import READ_AHEAD_MIN, ChannelBook, Consumer
from pepsi.publishing.message import Row

Q, R = "amqp:/:q", "amqp:/:r"


def row(stage: str, properties: str | None = None, body: bytes = b"b") -> Row:
    props = routing_json("", stage.rsplit(":", 1)[1]) if properties is None else properties
    return Row(stage, None, False, None, None, None, None, None, None, None, None, props,
               None, b"\x90\x00", body)  # fmt: skip


def test_rows_go_direct_in_order_while_their_queue_has_room() -> None:
    rows = [row(Q), row(R), row(Q), row(Q), row(R)]
    flags, taken = choose(rows, {Q: 2, R: 5}, {})
    assert flags == [True, True, True, False, True]
    assert taken == {Q: 2, R: 2}


def test_after_a_row_stays_pending_its_queue_takes_no_more() -> None:
    # the second row has no route (not an AMQP publish's): it stays pending, and the
    # third, though there is room, must not pass it
    rows = [row(Q), row(Q, properties='{"x": 1}'), row(Q)]
    flags, taken = choose(rows, {Q: 10}, {})
    assert flags == [True, False, False]
    assert taken == {Q: 1}
    assert choose([row(Q), row(R)], {R: 1}, {}) == ([False, True], {R: 1})  # Q: no room
    assert choose([row(Q)], {}, {}) == ([False], {})


def test_routes_are_read_from_the_properties_and_remembered() -> None:
    routes: dict[str, tuple[str, str] | None] = {}
    text = routing_json("ex", "key")
    assert route(text, routes) == ("ex", "key")
    assert routes == {text: ("ex", "key")}
    assert route(None, routes) is None
    assert route("not json", routes) is None
    assert route('{"exchange": "ex"}', routes) is None  # no routing key
    assert route('["ex"]', routes) is None


def test_a_direct_row_is_sent_as_a_claim_would_send_it() -> None:
    when = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
    published = row(Q, body=b"payload")._replace(expires=when)
    fetched = fetched_row(delivery(42, published, "ex", "key"), "q", quorum=True)
    assert fetched == Fetched(42, "ex", "key", False, 0, when.timestamp(), b"\x90\x00", b"payload")
    plain = fetched_row(delivery(7, row(Q)._replace(header=None, body=None), "", "q"), "q")
    assert (plain.raw_properties, plain.body, plain.expires) == (b"\x00\x00", b"", None)


def test_direct_rows_are_not_pending() -> None:
    units = [Unit([Item([row(Q), row(Q), row(R)])], lambda items, error: None)]
    assert rows_per_stage(units, {Q: 1}) == {Q: 1, R: 1}
    assert rows_per_stage(units, {Q: 2, R: 1}) == {}  # nothing pending: no news


class Link(NoDispatch):
    """The dispatcher's side: what it knows pending, and the direct rows it is told of."""

    def __init__(self, pending: dict[str, int | None]) -> None:
        self.pending = pending
        self.direct_count = 0
        self.wakes: list[str] = []

    def wake(self, cause: str) -> None:
        self.wakes.append(cause)

    def known_pending(self, stage: str) -> int | None:
        return self.pending.get(stage)

    def direct(self, count: int) -> None:
        self.direct_count += count


class Channel:
    def __init__(self) -> None:
        self.sent: list[int] = []

    def delivery_frames(self, consumer: Consumer, tag: int, fetched: Fetched) -> bytes:
        self.sent.append(fetched.wid)
        return b"x"

    def send_frames(self, data: bytes) -> None:
        pass


def consumed(pending: dict[str, int | None]) -> tuple[Deliverer, Link, Channel]:
    deliverer = Deliverer("", 1.0)
    link, channel = Link(pending), Channel()
    deliverer.link = link
    deliverer.registry.add(Consumer("c", "q", Q, ChannelBook(owner=channel), prefetch=10))
    return deliverer, link, channel


def test_a_per_stage_count_keeps_only_stages_with_some() -> None:
    counts = {"a": 3, "b": 1}
    subtract(counts, "a", 2)
    subtract(counts, "b", 1)
    subtract(counts, "c", 1)  # a release after its count went: nothing left to hold
    assert counts == {"a": 1}
    subtract(counts, "a", 5)
    assert counts == {}


def test_room_only_where_consumers_wait_and_nothing_is_pending() -> None:
    deliverer, _, _ = consumed({Q: 0})
    assert deliverer.direct_room([Q]) == {Q: READ_AHEAD_MIN}
    assert deliverer.direct_room([R]) == {}  # no consumer
    unsure: list[dict[str, int | None]] = [{Q: 3}, {Q: None}, {}]
    for pending in unsure:  # rows pending, or not known: they go first
        assert consumed(pending)[0].direct_room([Q]) == {}
    deliverer._returning[Q] = 1  # a nack's requeue not written yet
    assert deliverer.direct_room([Q]) == {}


def test_reserved_room_is_taken_and_the_rows_are_sent_after_the_commit() -> None:
    deliverer, link, channel = consumed({Q: 0})
    epochs = deliverer.reserve_direct({Q: 3})
    assert deliverer.direct_room([Q]) == {Q: READ_AHEAD_MIN - 3}
    assert deliverer.capacities() == {Q: READ_AHEAD_MIN - 3}  # the claim counts them too
    rows = [(wid, Q, delivery(wid, row(Q), "", "q")) for wid in (11, 12, 13)]

    async def commit() -> None:
        deliverer.release_direct({Q: 3})
        deliverer.deliver_direct(rows, epochs)

    asyncio.run(commit())
    assert channel.sent == [11, 12, 13]
    assert (deliverer.direct_rows, link.direct_count) == (3, 3)
    assert deliverer.direct_room([Q]) == {
        Q: READ_AHEAD_MIN
    }  # sent: the consumer's, as claimed rows
    deliverer.release_direct({Q: 1})  # a failed commit's release never goes below 0
    assert deliverer._reserved == {}


def test_a_row_given_back_meanwhile_goes_first() -> None:
    deliverer, _, channel = consumed({Q: 0})
    epochs = deliverer.reserve_direct({Q: 1})
    deliverer._epoch[Q] = epochs[Q] + 1  # a nack's requeue was written meanwhile
    returned: list[int] = []
    deliverer.unsent = lambda stage, ids: returned.extend(ids)  # type: ignore[method-assign]

    async def commit() -> None:
        deliverer.release_direct({Q: 1})
        deliverer.deliver_direct([(21, Q, delivery(21, row(Q), "", "q"))], epochs)

    asyncio.run(commit())
    assert channel.sent == []
    assert returned == [21]  # pending again, after the older one
