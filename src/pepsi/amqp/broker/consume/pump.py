"""Sending: the read-ahead to its consumers as their credit allows, as basic.deliver frames.

`pump` takes a stage's `ready` buffer round robin to its consumers, each one's run
encoded by its channel (`Sender.delivery_frames`) and written once per channel. It
runs when a load comes in, and when an ack (or nack, reject, recover, qos) frees
credit (`credit_freed`): at once, without a round trip to the database. An expired
message found on the way is dead-lettered instead; when the read-ahead runs low the
dispatcher is woken to claim more.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from pepsi.amqp.broker.consume.fetched import Fetched
from pepsi.amqp.broker.consume.state import DelivererState
from pepsi.amqp.model.consumers import ChannelBook, Consumer, Delivery


class Sender(Protocol):
    """The channel side of a delivery (BrokerChannel)."""

    open: bool

    def delivery_frames(self, consumer: Consumer, tag: int, fetched: Fetched) -> bytes: ...

    def send_frames(self, data: bytes) -> None: ...


class Pump(DelivererState):
    """The read-ahead out to consumers (a part of `delivery.Deliverer`)."""

    def pump(self, stage: str) -> None:
        """Send the stage's read-ahead to its consumers, round robin, as far as their
        credit goes; what no consumer will take (none left) goes back to pending."""
        ready = self.ready.get(stage)
        if not ready:
            self._claim_if_low(stage)
            return
        registry = self.registry
        if not registry.count(stage):
            self._unready(stage)
            return
        single = self.single_active(stage)
        acked: list[tuple[str, int]] = []
        now = self.clock()
        active = registry.active(registry.of(stage), single)
        if len(active) == 1:  # the common case: one run, as far as its credit goes
            owner: Sender = active[0].book.owner  # type: ignore[assignment]
            sent_bytes, expired, parts = self._pump_one(stage, ready, active[0], now, acked)
            frames = {id(owner): (owner, parts)} if parts else {}
        else:
            sent_bytes, expired, frames = self._pump_turns(stage, ready, single, now, acked)
        if not sent_bytes and not frames:
            return
        self._ready_bytes[stage] = self._ready_bytes.get(stage, 0) - sent_bytes
        for sender, parts in frames.values():
            self.delivered += len(parts)
            sender.send_frames(b"".join(parts))
        if acked or expired:
            self._outcomes.acked += acked
            self._settle_soon()
        self._claim_if_low(stage)

    def _pump_turns(
        self, stage: str, ready: deque[Fetched], single: bool, now: float,
        acked: list[tuple[str, int]],
    ) -> tuple[int, bool, dict[int, tuple[Sender, list[bytes]]]]:  # fmt: skip
        """`pump` for several consumers: round robin, one message per turn, as far as their
        credit goes. The bytes taken from the read-ahead, whether some had expired, and the
        frames to send, per channel."""
        frames: dict[int, tuple[Sender, list[bytes]]] = {}
        sent_bytes = 0
        expired = False
        while ready:
            consumer = self.registry.pick(stage, single)
            if consumer is None:
                break
            taken, gone, parts = self._pump_one(stage, ready, consumer, now, acked, most=1)
            sent_bytes += taken
            expired = expired or gone
            if parts:
                sender: Sender = consumer.book.owner  # type: ignore[assignment]
                out = frames.get(id(sender))
                if out is None:
                    out = frames[id(sender)] = (sender, [])
                out[1].extend(parts)
        return sent_bytes, expired, frames

    def _pump_one(
        self,
        stage: str,
        ready: deque[Fetched],
        consumer: Consumer,
        now: float,
        acked: list[tuple[str, int]],
        *,
        most: int | None = None,
    ) -> tuple[int, bool, list[bytes]]:
        """What `consumer`'s credit allows (at `most` messages), taken from the read-ahead
        in one run: its credit counted down here instead of asked per message, its book
        written directly; expired messages go to be dead-lettered on the way. The bytes
        taken from the read-ahead, whether some had expired, and the frames to send."""
        book = consumer.book
        # A no-ack consumer's credit does not go down as it is sent messages: all of them.
        credit = len(ready) if consumer.no_ack and consumer.credit() else consumer.credit()
        if most is not None:
            credit = min(credit, most)
        if not credit:
            return 0, False, []
        sender: Sender = book.owner  # type: ignore[assignment]
        encode = sender.delivery_frames
        parts: list[bytes] = []
        unacked = book.unacked
        tag = book.next_tag
        sent_bytes = 0
        expired = False
        while credit and ready:
            fetched = ready.popleft()
            sent_bytes += len(fetched.body)
            if fetched.expires is not None and fetched.expires <= now:  # expired read ahead
                self._outcomes.dead.append((stage, fetched.wid, "expired"))
                expired = True
                continue
            parts.append(encode(consumer, tag, fetched))
            if consumer.no_ack:
                acked.append((stage, fetched.wid))
            else:
                unacked[tag] = Delivery(fetched.wid, stage, consumer.tag, fetched.delivery_count)
                consumer.unacked += 1
            tag += 1
            credit -= 1
        book.next_tag = tag
        return sent_bytes, expired, parts

    def _claim_if_low(self, stage: str) -> None:
        """Wake the dispatcher when the stage's read-ahead is down to half of what its
        consumers should have (`capacities` then asks for the rest), and only then: a
        dispatcher cycle per burst of acks cost more than the claims."""
        target = self.registry.target(stage, self.single_active(stage))
        have = len(self.ready.get(stage, ())) + self._loading.get(stage, 0)
        if target and have * 2 <= target:
            self.link.wake("credit")  # only credit: a queue found empty is not claimed

    def pump_all(self) -> None:
        """A client reads again: every stage's read-ahead may move."""
        for stage in list(self.ready):
            self.pump(stage)

    def credit_freed(self, book: ChannelBook) -> None:
        """An ack, nack, reject, recover or qos on this channel: its consumers may take
        more. Sent once the frames read meanwhile are handled (acks come in bursts): one
        write for the lot."""
        for consumer in book.consumers.values():
            self._to_pump.add(consumer.stage)
        if not self._pump_scheduled:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump_later)

    def _pump_later(self) -> None:
        self._pump_scheduled = False
        stages, self._to_pump = self._to_pump, set()
        for stage in stages:
            self.pump(stage)

    def takes_now(self, stage: str) -> bool:
        """Whether a message published to `stage` now would go straight to a consumer:
        its consumers have room for it beyond what is read ahead or loading before it
        (RabbitMQ's x-message-ttl = 0 delivers then, and only then)."""
        ahead = len(self.ready.get(stage, ())) + self._loading.get(stage, 0)
        room = 0
        for consumer in self.registry.of(stage):
            room += consumer.credit()
            if room > ahead:
                return True
        return False


__all__ = ["Pump", "Sender"]
