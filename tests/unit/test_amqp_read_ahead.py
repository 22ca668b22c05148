"""When the AMQP deliverer asks the dispatcher for a claim: only once a consumed
stage's read-ahead is down to half of its target, not after every burst of acks (each
wake is a dispatcher cycle)."""

from __future__ import annotations

import asyncio
from collections import deque

from pepsi.amqp.broker.consume.delivery import Deliverer
from pepsi.amqp.broker.consume.fetched import Fetched
from pepsi.amqp.broker.consume.readahead import LOAD_STEP
from pepsi.amqp.broker.consume.state import NoDispatch
from pepsi.amqp.model.consumers import READ_AHEAD_MIN, ChannelBook, Consumer, Delivery

STAGE = "amqp:/:q"


class Link(NoDispatch):
    """The dispatcher's side: its wakeups, counted."""

    def __init__(self) -> None:
        self.wakes = 0

    def wake(self, cause: str) -> None:
        self.wakes += 1


class Channel:
    """What a consuming channel does for the deliverer: frames, counted."""

    def __init__(self) -> None:
        self.sent = 0

    def delivery_frames(self, consumer: Consumer, tag: int, fetched: Fetched) -> bytes:
        return b"x"

    def send_frames(self, data: bytes) -> None:
        self.sent += len(data)


def deliverer_with_consumer(prefetch: int = 100) -> tuple[Deliverer, Link, Channel, Consumer]:
    deliverer = Deliverer("", 1.0)
    link, channel = Link(), Channel()
    deliverer.link = link
    book = ChannelBook(owner=channel)
    consumer = Consumer("c", "q", STAGE, book, prefetch=prefetch)
    deliverer.registry.add(consumer)
    return deliverer, link, channel, consumer


def read_ahead(deliverer: Deliverer, first: int, n: int) -> None:
    ready = deliverer.ready.setdefault(STAGE, deque())
    ready.extend(Fetched(first + i, "", "q", False, 0, None, b"", b"b") for i in range(n))


def test_acks_wake_the_dispatcher_only_when_the_read_ahead_is_half_gone() -> None:
    deliverer, link, channel, consumer = deliverer_with_consumer(prefetch=100)
    read_ahead(deliverer, 1, READ_AHEAD_MIN)

    async def rounds() -> int:
        deliverer.pump(STAGE)  # the consumer's credit: 100
        n = 1
        while not link.wakes:
            consumer.book.take(0, multiple=True)  # the client acks them all
            deliverer.credit_freed(consumer.book)  # the next 100 go out on the next turn
            await asyncio.sleep(0)
            n += 1
        return n

    # 1 000 read ahead, 100 a round: the wake comes when 500 are left, not before
    assert asyncio.run(rounds()) == 5
    assert channel.sent == 500
    assert len(deliverer.ready[STAGE]) == 500


def test_an_empty_read_ahead_asks_for_a_claim_if_someone_consumes() -> None:
    deliverer, link, _, consumer = deliverer_with_consumer()
    deliverer.pump(STAGE)
    assert link.wakes == 1
    deliverer.registry.remove(consumer)
    deliverer.pump(STAGE)
    assert link.wakes == 1  # no consumer left: nothing to claim for


def test_deliveries_are_recorded_for_the_acks() -> None:
    deliverer, _, _, consumer = deliverer_with_consumer(prefetch=2)
    read_ahead(deliverer, 7, 3)
    deliverer.pump(STAGE)
    assert consumer.book.unacked == {
        1: Delivery(7, STAGE, "c", 0),
        2: Delivery(8, STAGE, "c", 0),
    }


def test_a_large_load_goes_out_in_steps_and_every_id_stays_held() -> None:
    """A claim's rows reach the read-ahead (and the consumers) LOAD_STEP at a time, the
    loop running in between (acks are read there); an id not loaded yet is still held,
    so a reset of orphaned rows meanwhile cannot give it to anyone else."""
    deliverer, _, _, consumer = deliverer_with_consumer(prefetch=1000)
    deliverer.books.add(consumer.book)
    n = 4 * LOAD_STEP + 3
    ids = range(1, n + 1)
    claimed = [(wid, STAGE, 0) for wid in ids]
    # rows as amqp_delivery_load returns them: id, exchange, routing key, delivery count,
    # redelivered, x-death, first death, expires, header, body, pipeline properties
    rows = {wid: (wid, "", "q", 0, False, None, None, None, None, b"b", None) for wid in ids}
    deliverer._loading[STAGE] = n
    delivered_between_steps: list[int] = []

    async def load() -> None:
        async def watch() -> None:
            for _ in range(n):  # a turn of the loop per step: far fewer than n
                if len(consumer.book.unacked) >= n:
                    return
                assert sorted(deliverer.held()) == list(ids)
                delivered_between_steps.append(len(consumer.book.unacked))
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        await deliverer._load_in_steps(claimed, rows)
        await watcher

    asyncio.run(load())
    assert delivered_between_steps == [LOAD_STEP, 2 * LOAD_STEP, 3 * LOAD_STEP, 4 * LOAD_STEP]
    assert [d.wid for d in consumer.book.unacked.values()] == list(ids)  # in order
    assert sorted(deliverer.held()) == list(ids)  # delivered, not acked
    assert STAGE not in deliverer._loading


def test_rows_still_loading_count_as_ready() -> None:
    """`message_count` counts what consumers have not been sent: the read-ahead and the
    rows claimed for them whose load has not come back yet."""
    deliverer, *_ = deliverer_with_consumer()
    read_ahead(deliverer, 1, 3)
    deliverer._loading[STAGE] = 5  # claimed (running in SQL), being loaded
    assert deliverer.ready_count(STAGE) == 8
    assert deliverer.ready_count("amqp:/:other") == 0


def test_rows_loading_when_the_queue_is_purged_are_deleted_not_delivered() -> None:
    deliverer, *_ = deliverer_with_consumer()
    before = [(1, STAGE, 0), (2, STAGE, 0)]  # claimed, their load running
    deliverer._loading[STAGE] = 2
    assert deliverer.purge_loading(STAGE) == 2  # purge-ok counts them
    assert deliverer.purge_loading("amqp:/:other") == 0
    after = [(3, STAGE, deliverer._epoch[STAGE])]  # claimed after the purge
    deliverer._loading[STAGE] += 1
    rows = {wid: (wid, "", "q", 0, False, None, None, None, None, b"b", None) for wid in (1, 2, 3)}
    # the outcomes stay in memory: this test starts no task writing them to a database
    deliverer._settle_soon = lambda: None  # type: ignore[method-assign]
    deliverer._load(before + after, rows)
    assert deliverer._outcomes.acked == [(STAGE, 1), (STAGE, 2)]  # deleted by the settle
    assert [f.wid for f in deliverer.ready[STAGE]] == [3]
    assert deliverer._outcomes.unsent == []


# --- one consumer's run and round robin: what `pump` sends ------------------------------


def consumers_on_one_channel(*prefetches: int, no_ack: bool = False) -> tuple[
    Deliverer, Channel, list[Consumer]
]:  # fmt: skip
    deliverer = Deliverer("", 1.0)
    deliverer.link = Link()
    channel = Channel()
    book = ChannelBook(owner=channel)
    consumers = [
        Consumer(f"c{i}", "q", STAGE, book, no_ack=no_ack, prefetch=prefetch)
        for i, prefetch in enumerate(prefetches)
    ]
    for consumer in consumers:
        deliverer.registry.add(consumer)
    return deliverer, channel, consumers


def test_one_consumer_is_sent_what_its_prefetch_allows_in_order() -> None:
    deliverer, _, (consumer,) = consumers_on_one_channel(3)
    read_ahead(deliverer, 10, 5)
    deliverer.pump(STAGE)
    assert [(tag, d.wid) for tag, d in consumer.book.unacked.items()] == [
        (1, 10), (2, 11), (3, 12)
    ]  # fmt: skip
    assert consumer.unacked == 3
    assert consumer.credit() == 0
    assert [f.wid for f in deliverer.ready[STAGE]] == [13, 14]
    assert deliverer.delivered == 3
    deliverer.pump(STAGE)  # no credit: nothing more
    assert deliverer.delivered == 3
    consumer.book.take(2, multiple=True)  # acks 1 and 2
    deliverer.pump(STAGE)
    assert list(consumer.book.unacked) == [3, 4, 5]
    assert consumer.book.next_tag == 6


def test_the_channel_prefetch_bounds_one_consumer_too() -> None:
    deliverer, _, (consumer,) = consumers_on_one_channel(0)  # no limit of its own
    consumer.book.prefetch_global = 2
    read_ahead(deliverer, 1, 5)
    deliverer.pump(STAGE)
    assert list(consumer.book.unacked) == [1, 2]


def test_a_no_ack_consumer_takes_the_whole_read_ahead_and_nothing_stays_unacked() -> None:
    deliverer, _, (consumer,) = consumers_on_one_channel(0, no_ack=True)
    deliverer._settle_soon = lambda: None  # type: ignore[method-assign]  # no database here
    read_ahead(deliverer, 1, 1500)  # more than the credit a no-ack consumer reports
    deliverer.pump(STAGE)
    assert deliverer.delivered == 1500
    assert not deliverer.ready[STAGE]
    assert not consumer.book.unacked
    assert [wid for _, wid in deliverer._outcomes.acked] == list(range(1, 1501))


def test_expired_read_ahead_is_dead_lettered_without_using_credit() -> None:
    deliverer, _, (consumer,) = consumers_on_one_channel(2)
    deliverer._settle_soon = lambda: None  # type: ignore[method-assign]  # no database here
    deliverer.clock = lambda: 100.0
    ready = deliverer.ready.setdefault(STAGE, deque())
    ready.extend([
        Fetched(1, "", "q", False, 0, 50.0, b"", b"b"),  # expired
        Fetched(2, "", "q", False, 0, None, b"", b"b"),
        Fetched(3, "", "q", False, 0, 99.0, b"", b"b"),  # expired
        Fetched(4, "", "q", False, 0, 200.0, b"", b"b"),
        Fetched(5, "", "q", False, 0, None, b"", b"b"),
    ])  # fmt: skip
    deliverer.pump(STAGE)
    assert [d.wid for d in consumer.book.unacked.values()] == [2, 4]
    assert deliverer._outcomes.dead == [(STAGE, 1, "expired"), (STAGE, 3, "expired")]
    assert [f.wid for f in ready] == [5]


def test_several_consumers_take_turns_one_message_each() -> None:
    deliverer, _, (first, second) = consumers_on_one_channel(2, 3)
    read_ahead(deliverer, 1, 6)
    deliverer.pump(STAGE)
    assert [d.wid for d in first.book.unacked.values() if d.consumer_tag == "c0"] == [1, 3]
    assert [d.wid for d in second.book.unacked.values() if d.consumer_tag == "c1"] == [2, 4, 5]
    assert [f.wid for f in deliverer.ready[STAGE]] == [6]


def test_a_single_active_consumer_queue_feeds_only_the_oldest_consumer() -> None:
    deliverer, _, (first, second) = consumers_on_one_channel(2, 2)
    deliverer.single_active = lambda stage: True  # type: ignore[method-assign]
    read_ahead(deliverer, 1, 4)
    deliverer.pump(STAGE)
    assert first.unacked == 2
    assert second.unacked == 0


def test_rows_claimed_after_stale_ones_of_one_load_go_back_after_them() -> None:
    """Rows claimed before messages went back are sent back too, and so are the rows of a
    later claim that share their load: delivering those would put them ahead of the
    older rows going back (the order of a queue, as RabbitMQ keeps it)."""
    deliverer, _, _, consumer = deliverer_with_consumer(prefetch=10)
    deliverer._settle_soon = lambda: None  # type: ignore[method-assign]  # no database here
    deliverer._start = lambda: None  # type: ignore[method-assign]
    deliverer.deliver([(1, STAGE, None)])  # claimed at epoch 0
    deliverer.unsent(STAGE, [0])  # a message goes back: epoch 1
    deliverer.deliver([(2, STAGE, None)])  # claimed at epoch 1, loaded with the first
    claimed, deliverer._claimed = deliverer._claimed, []
    rows = {wid: (wid, "", "q", None, None, None, None, None, b"", b"b", None) for wid in (1, 2)}
    assert deliverer._load(claimed, rows) == set()
    assert [wid for _, wid in deliverer._outcomes.unsent] == [0, 1, 2]
    assert not consumer.book.unacked
    assert not deliverer.ready.get(STAGE)


def test_taking_turns_skips_expired_messages_without_using_a_turn() -> None:
    deliverer, _, (first, second) = consumers_on_one_channel(2, 2)
    deliverer._settle_soon = lambda: None  # type: ignore[method-assign]  # no database here
    deliverer.clock = lambda: 100.0
    deliverer.ready.setdefault(STAGE, deque()).extend([
        Fetched(1, "", "q", False, 0, 50.0, b"", b"b"),  # expired
        Fetched(2, "", "q", False, 0, None, b"", b"b"),
        Fetched(3, "", "q", False, 0, None, b"", b"b"),
        Fetched(4, "", "q", False, 0, None, b"", b"b"),
    ])  # fmt: skip
    deliverer.pump(STAGE)
    taken = {tag: d.wid for tag, d in first.book.unacked.items()}
    assert [d.consumer_tag for d in first.book.unacked.values()] == ["c0", "c1", "c0"]
    assert list(taken.values()) == [2, 3, 4]
    assert deliverer._outcomes.dead == [(STAGE, 1, "expired")]
    assert second.unacked == 1
