"""Who may receive what: consumers, their prefetch credit and the channels' unacked books.

Pure bookkeeping for the consuming half of the broker (issue 16, A-1): AMQP
consumers are one more kind of worker for a stage, and the dispatcher's one
claim feeds them within their credit. This module decides how much a stage can
take (`Registry.capacities`), which consumer gets which claimed id
(`Registry.assign`, round robin among consumers with credit, as RabbitMQ) and
which deliveries an ack, nack or reject settles (`ChannelBook.take`). The I/O
(fetching bodies, sending frames, writing outcomes) is in `delivery.py`.

Credit follows RabbitMQ 3.x `basic.qos`: a consumer's prefetch (global=false)
bounds its own unacked deliveries, the channel's (global=true) bounds those of
all its consumers together, 0 means no limit. A consumer without a limit (and
every no-ack consumer) takes at most `UNLIMITED_WINDOW` ids per claim beyond
what it has not been sent yet, and nothing while its socket is not being read:
the socket's back-pressure is its limit, as with RabbitMQ's credit flow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

UNLIMITED_WINDOW = 1000  # ids a consumer without a prefetch limit may have unsent


class Delivery(NamedTuple):
    """One message handed to a consumer (or to basic.get) and not yet settled."""

    wid: int
    stage: str
    consumer_tag: str | None  # None: basic.get
    delivery_count: int  # returns before this delivery (x-delivery-count)


class UnknownTag(LookupError):
    """An ack, nack or reject named a delivery tag the channel does not hold."""

    def __init__(self, tag: int) -> None:
        super().__init__(f"unknown delivery tag {tag}")
        self.tag = tag


@dataclass(eq=False)
class Consumer:
    tag: str
    queue: str
    stage: str
    book: ChannelBook
    no_ack: bool = False
    exclusive: bool = False
    prefetch: int = 0  # its own unacked limit (basic.qos global=false); 0 = none
    unacked: int = 0  # delivered, not settled
    reserved: int = 0  # claimed for it, not sent yet
    cancelled: bool = False

    def credit(self) -> int:
        """How many more ids it may be handed now."""
        if self.cancelled or not self.book.writable():
            return 0
        if self.no_ack:
            return max(UNLIMITED_WINDOW - self.reserved, 0)
        room = UNLIMITED_WINDOW - self.reserved
        if self.prefetch:
            room = min(room, self.prefetch - self.unacked - self.reserved)
        book = self.book
        if book.prefetch_global:
            room = min(room, book.prefetch_global - book.unacked_count - book.reserved)
        return max(room, 0)


def _always() -> bool:
    return True


@dataclass(eq=False)
class ChannelBook:
    """One channel's consumers, qos and unacked deliveries (by delivery tag, in order)."""

    writable: Callable[[], bool] = _always
    prefetch_global: int = 0  # basic.qos global=true: all consumers of the channel
    prefetch_consumer: int = 0  # basic.qos global=false: each consumer created after it
    consumers: dict[str, Consumer] = field(default_factory=dict)
    unacked: dict[int, Delivery] = field(default_factory=dict)
    next_tag: int = 1
    reserved: int = 0  # claimed for its consumers, not sent yet
    owner: object = None  # the channel handler that sends for it (delivery.py)

    @property
    def unacked_count(self) -> int:
        """Deliveries counted against prefetch: those of consumers (basic.get's count too,
        as in RabbitMQ, where the channel's limit covers every unacked delivery)."""
        return len(self.unacked)

    def new_tag(self) -> int:
        tag = self.next_tag
        self.next_tag += 1
        return tag

    def delivered(self, tag: int, delivery: Delivery) -> None:
        self.unacked[tag] = delivery
        consumer = self.consumers.get(delivery.consumer_tag or "")
        if consumer is not None:
            consumer.unacked += 1

    def take(self, tag: int, multiple: bool) -> list[Delivery]:
        """The deliveries an ack/nack/reject of `tag` settles (tag 0 + multiple: all)."""
        if multiple:
            if tag == 0:
                tags = list(self.unacked)
            else:
                tags = [t for t in self.unacked if t <= tag]
                if tag not in self.unacked and not tags:
                    raise UnknownTag(tag)
        else:
            if tag not in self.unacked:
                raise UnknownTag(tag)
            tags = [tag]
        return [self._settle(t) for t in tags]

    def take_all(self) -> list[Delivery]:
        return [self._settle(t) for t in list(self.unacked)]

    def _settle(self, tag: int) -> Delivery:
        delivery = self.unacked.pop(tag)
        consumer = self.consumers.get(delivery.consumer_tag or "")
        if consumer is not None:
            consumer.unacked -= 1
        return delivery


class Assignment(NamedTuple):
    consumer: Consumer
    ids: list[int]


class Registry:
    """Every consumer of every stage, in the order they take turns."""

    def __init__(self) -> None:
        self.stages: dict[str, list[Consumer]] = {}
        self._turn: dict[str, int] = {}  # where the next round robin starts, per stage

    def add(self, consumer: Consumer) -> None:
        self.stages.setdefault(consumer.stage, []).append(consumer)
        consumer.book.consumers[consumer.tag] = consumer

    def remove(self, consumer: Consumer) -> bool:
        """Cancel it; True if it was its stage's last consumer."""
        consumer.cancelled = True
        consumer.book.consumers.pop(consumer.tag, None)
        consumers = self.stages.get(consumer.stage, [])
        if consumer in consumers:
            consumers.remove(consumer)
        if consumers:
            return False
        self.stages.pop(consumer.stage, None)
        self._turn.pop(consumer.stage, None)
        return True

    def of(self, stage: str) -> list[Consumer]:
        return self.stages.get(stage, [])

    def count(self, stage: str) -> int:
        return len(self.stages.get(stage, ()))

    @staticmethod
    def active(consumers: list[Consumer], single_active: bool) -> list[Consumer]:
        """x-single-active-consumer: only the oldest consumer receives."""
        return consumers[:1] if single_active else consumers

    def capacities(self, single_active: Callable[[str], bool]) -> dict[str, int]:
        """Ids each stage's consumers can take now, for the dispatcher's claim."""
        caps: dict[str, int] = {}
        for stage, consumers in self.stages.items():
            total = sum(c.credit() for c in self.active(consumers, single_active(stage)))
            if total:
                caps[stage] = total
        return caps

    def assign(
        self, stage: str, ids: Iterable[int], single_active: bool
    ) -> tuple[list[Assignment], list[int]]:
        """Claimed ids to consumers one by one, round robin among those with credit.

        Returns what each consumer gets (its credit reserved) and the ids no
        consumer could take (credit shrank while the claim ran: requeue them).
        """
        consumers = self.active(self.stages.get(stage, []), single_active)
        credit = [c.credit() for c in consumers]
        given: list[list[int]] = [[] for _ in consumers]
        leftover: list[int] = []
        n = len(consumers)
        turn = self._turn.get(stage, 0) % n if n else 0
        for wid in ids:
            for step in range(n):
                i = (turn + step) % n
                if credit[i] > 0:
                    credit[i] -= 1
                    given[i].append(wid)
                    turn = (i + 1) % n
                    break
            else:
                leftover.append(wid)
        if n:
            self._turn[stage] = turn
        plan = []
        for consumer, wids in zip(consumers, given, strict=True):
            if wids:
                consumer.reserved += len(wids)
                consumer.book.reserved += len(wids)
                plan.append(Assignment(consumer, wids))
        return plan, leftover
