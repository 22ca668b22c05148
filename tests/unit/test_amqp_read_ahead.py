"""When the AMQP deliverer asks the dispatcher for a claim: only once a consumed
stage's read-ahead is down to half of its target, not after every burst of acks (each
wake is a dispatcher cycle)."""

from __future__ import annotations

import asyncio
from collections import deque

from pepsi.amqp.consumers import READ_AHEAD_MIN, ChannelBook, Consumer, Delivery
from pepsi.amqp.delivery import LOAD_STEP, Deliverer, Fetched

STAGE = "amqp:/:q"


class Link:
    def __init__(self) -> None:
        self.wakes = 0

    def wake(self, cause: str) -> None:
        self.wakes += 1

    def returned(self, stage: str, ids: list[int]) -> None:
        pass

    def consumed(self, stage: str, ids: list[int]) -> None:
        pass


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
