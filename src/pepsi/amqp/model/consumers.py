"""Who may receive what: consumers, their prefetch credit and the channels' unacked books.

Pure bookkeeping for the consuming half of the broker (issue 16, A-1): AMQP
consumers are one more kind of worker for a stage, and the dispatcher's one
claim feeds them. This module says how many ids a consumed stage should read
ahead (`Registry.targets`), which consumer gets the next message (`Registry.pick`,
round robin among those with credit, as RabbitMQ) and which deliveries an ack,
nack or reject settles (`ChannelBook.take`). The I/O (claimed rows read ahead,
frames sent, outcomes written) is in `broker/consume/`.

Credit follows RabbitMQ 3.x `basic.qos`: a consumer's prefetch (global=false)
bounds its own unacked deliveries, the channel's (global=true) bounds those of
all its consumers together, 0 means no limit. A consumer without a limit (and
every no-ack consumer) is limited by its socket instead: nothing is sent while
the client does not read, as with RabbitMQ's credit flow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

UNLIMITED_WINDOW = 1000  # read-ahead for a consumer without a prefetch limit
READ_AHEAD_MIN = 1000  # a consumed stage reads at least this many ahead ...
READ_AHEAD_MAX = 2000  # ... and at most this many (claimed, loaded, not yet sent)


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
    cancelled: bool = False

    def credit(self) -> int:
        """How many more messages it may be sent now."""
        if self.cancelled or not self.book.writable():
            return 0
        if self.no_ack:
            return UNLIMITED_WINDOW
        room = self.prefetch - self.unacked if self.prefetch else UNLIMITED_WINDOW
        book = self.book
        if book.prefetch_global:
            room = min(room, book.prefetch_global - book.unacked_count)
        return max(room, 0)

    def window(self) -> int:
        """How many messages worth reading ahead for it: its prefetch window."""
        if self.no_ack or not self.prefetch:
            return UNLIMITED_WINDOW
        return self.prefetch


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
    owner: object = None  # the channel handler that sends for it (consume/pump.py)

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
                tags = []
                for t in self.unacked:  # in tag order: stop at the first one past `tag`
                    if t > tag:
                        break
                    tags.append(t)
                if not tags:
                    raise UnknownTag(tag)
        else:
            return [self.take_one(tag)]
        return [self._settle(t) for t in tags]

    def take_one(self, tag: int) -> Delivery:
        """The delivery a single ack, nack or reject of `tag` settles (a consumer's
        `basic.ack`, one per message: without the lists of `take`)."""
        delivery = self.unacked.pop(tag, None)
        if delivery is None:
            raise UnknownTag(tag)
        consumer = self.consumers.get(delivery.consumer_tag or "")
        if consumer is not None:
            consumer.unacked -= 1
        return delivery

    def take_all(self) -> list[Delivery]:
        return [self._settle(t) for t in list(self.unacked)]

    def _settle(self, tag: int) -> Delivery:
        delivery = self.unacked.pop(tag)
        consumer = self.consumers.get(delivery.consumer_tag or "")
        if consumer is not None:
            consumer.unacked -= 1
        return delivery


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

    def target(self, stage: str, single_active: bool) -> int:
        """How many messages the stage should have read ahead: its active consumers'
        windows, at most READ_AHEAD_MAX."""
        consumers = self.active(self.stages.get(stage, []), single_active)
        if not consumers:
            return 0
        return min(max(sum(c.window() for c in consumers), READ_AHEAD_MIN), READ_AHEAD_MAX)

    def targets(self, single_active: Callable[[str], bool]) -> dict[str, int]:
        """`target` of every consumed stage."""
        return {stage: self.target(stage, single_active(stage)) for stage in self.stages}

    def pick(self, stage: str, single_active: bool) -> Consumer | None:
        """The next consumer in turn that has credit, or None."""
        consumers = self.active(self.stages.get(stage, []), single_active)
        n = len(consumers)
        if n == 1:  # the common case, without the turn bookkeeping
            return consumers[0] if consumers[0].credit() > 0 else None
        turn = self._turn.get(stage, 0)
        for step in range(n):
            consumer = consumers[(turn + step) % n]
            if consumer.credit() > 0:
                self._turn[stage] = (turn + step + 1) % n
                return consumer
        return None
