"""A channel's consuming methods: basic.qos/consume/cancel/get/ack/nack/reject/recover.

`ConsumingChannel` is the half of `broker.BrokerChannel` that receives
messages; the bookkeeping is in `model/consumers.py` (pure) and the I/O in the
`delivery.Deliverer`. Answers and error codes are RabbitMQ 3.x's with a quorum
queue; where Pepsi differs, docs/amqp.md says so.
"""

from __future__ import annotations

import contextlib
import secrets
from typing import TYPE_CHECKING, Any, Protocol, cast

from pamqp import base, commands

from pepsi.amqp.auth.permissions import Access
from pepsi.amqp.broker.catalogue import Queue, VhostView
from pepsi.amqp.broker.consume.fetched import Fetched
from pepsi.amqp.model.consumers import ChannelBook, Consumer, Delivery, UnknownTag
from pepsi.amqp.model.exchanges import QUEUE
from pepsi.amqp.model.values import resource
from pepsi.amqp.session.connection import Connection
from pepsi.amqp.session.handler import Channel, ChannelHandler
from pepsi.amqp.wire import methods, writer
from pepsi.amqp.wire.replies import (
    ACCESS_REFUSED,
    NOT_ALLOWED,
    NOT_IMPLEMENTED,
    PRECONDITION_FAILED,
    AMQPConnectionError,
    ChannelError,
)

if TYPE_CHECKING:
    from pepsi.amqp.broker.catalogue import Catalogue
    from pepsi.amqp.broker.consume.delivery import Deliverer
    from pepsi.amqp.broker.expiry import Expiry
    from pepsi.amqp.broker.publish.batcher import Batcher


class Broker(Protocol):
    """What a consuming channel needs of the broker (`broker.Broker`, whose channels
    these are: this module does not import it back)."""

    deliverer: Deliverer
    batcher: Batcher
    catalogue: Catalogue
    expiry: Expiry

    def spawn(self, coro: Any) -> None: ...

    async def auto_delete_queue(self, vhost: str, name: str) -> None: ...


def stage_queue_text(queue: Queue, vhost: str) -> str:
    return (
        f"{resource('queue', queue.name, vhost)} is stage '{queue.stage}' of the pipeline"
        " ([pepsi-amqp] STAGES): its workers take its messages"
    )


# Encoded once, kept while they are few (a channel has a handful of consumers, a queue's
# messages a handful of exchange and routing key pairs); cleared past this many.
ENCODED_CACHE = 256
_ROUTING_FIELDS: dict[tuple[str, str], bytes] = {}


def _ids(method: type[base.Frame]) -> tuple[int, int]:
    return method.index >> 16, method.index & 0xFFFF


class ConsumingChannel(ChannelHandler):
    """basic.* for receiving; mixed into BrokerChannel, which provides the helpers."""

    broker: Broker
    vhost: str
    open: bool

    def __init__(self, channel: Channel) -> None:
        super().__init__(channel)
        connection = cast(Connection, channel.connection)  # the seam names it by its members
        self.book = ChannelBook(writable=connection.writable_now, owner=self)
        deliverer = self.broker.deliverer
        deliverer.books.add(self.book)
        connection.resumed = deliverer.pump_all  # the client reads again
        self.published: set[str] = set()  # stages published to since it last waited
        self._consumer_tags: dict[str, bytes] = {}  # consumer tag -> shortstr

    async def in_order(self) -> None:
        """Wait for what this channel did before to be written: its publishes, and every
        consumer outcome recorded so far. A channel's methods are ordered for the client
        (a get after a publish or a nack sees the message, as in RabbitMQ)."""
        if self.published:
            self.published.clear()
            await self.broker.batcher.flush()
        await self.broker.deliverer.flush()

    async def counted_in_order(self, stage: str) -> None:
        """Wait for what a count of `stage`'s messages must see: this channel's publishes
        to the stage, and every delivery given back to it or dead-lettered (by any
        channel: a consumer's closed connection returns its messages) that is not
        written yet. Celery's client declares its reply queue before every task it
        publishes to another: the declaration no longer waits for that publish's
        commit, nor for the acknowledgements of every consumer."""
        if stage in self.published:
            self.published.clear()  # the flush waits for everything submitted so far
            await self.broker.batcher.flush()
        if self.broker.deliverer.settles_into(stage):
            await self.broker.deliverer.flush()

    # provided by BrokerChannel
    def _method(self, method: base.Frame) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError

    def _queue_name(self, name: str) -> str:
        raise NotImplementedError

    def _require(self, access: Access, kind: str, name: str) -> None:
        raise NotImplementedError

    def _existing_queue(self, view: VhostView, name: str) -> Queue:
        raise NotImplementedError

    def _reply(self, method: base.Frame) -> None:
        raise NotImplementedError

    # ---- helpers ------------------------------------------------------------------------

    async def _readable_queue(self, name: str) -> Queue:
        name = self._queue_name(name)
        self._require(Access.READ, QUEUE, name)
        queue = self._existing_queue(await self.broker.catalogue.view(self.vhost), name)
        if queue.is_stage:
            raise ChannelError(ACCESS_REFUSED, stage_queue_text(queue, self.vhost))
        return queue

    def delivery_frames(self, consumer: Consumer, tag: int, fetched: Fetched) -> bytes:
        """basic.deliver, its content header (properties as stored) and body frames; the
        consumer tag and the routing fields encoded once, not per message."""
        consumer_tag = self._consumer_tags.get(consumer.tag)
        if consumer_tag is None:
            if len(self._consumer_tags) >= ENCODED_CACHE:
                self._consumer_tags.clear()
            consumer_tag = self._consumer_tags[consumer.tag] = writer.shortstr(consumer.tag)
        key = (fetched.exchange, fetched.routing_key)
        routing = _ROUTING_FIELDS.get(key)
        if routing is None:
            if len(_ROUTING_FIELDS) >= ENCODED_CACHE:
                _ROUTING_FIELDS.clear()
            routing = _ROUTING_FIELDS[key] = writer.routing_fields(*key)
        return writer.encode_deliver_fields(
            self.channel.number, consumer_tag, tag, fetched.redelivered, routing,
            raw_properties=fetched.raw_properties, body=fetched.body,
            frame_max=self.channel.connection.frame_max,
        )  # fmt: skip

    def send_frames(self, data: bytes) -> None:
        self.channel.connection.send(data)

    def server_cancel(self, consumer: Consumer) -> None:
        """Its queue was deleted: basic.cancel to a client that understands it (RabbitMQ's
        consumer_cancel_notify); others just stop receiving."""
        if self.open and self.channel.connection.client_capabilities.get("consumer_cancel_notify"):
            self.channel.send_method(
                methods.build_method(commands.Basic.Cancel, consumer_tag=consumer.tag, nowait=True)
            )

    def _take(self, tag: int, multiple: bool, method: type[base.Frame]) -> list[Delivery]:
        try:
            return self.book.take(tag, multiple)
        except UnknownTag as error:
            raise ChannelError(PRECONDITION_FAILED, str(error), *_ids(method)) from None

    # ---- qos, consume, cancel ------------------------------------------------------------

    async def basic_qos(self, method: commands.Basic.Qos) -> None:
        if method.prefetch_size:
            raise AMQPConnectionError(
                NOT_IMPLEMENTED, f"prefetch_size!=0 ({method.prefetch_size})", *_ids(type(method))
            )
        if method.global_:
            self.book.prefetch_global = int(method.prefetch_count)
        else:
            self.book.prefetch_consumer = int(method.prefetch_count)
        self._reply(commands.Basic.QosOk())
        self.broker.deliverer.credit_freed(self.book)  # more credit, maybe

    async def basic_consume(self, method: commands.Basic.Consume) -> None:
        with self._method(method):
            queue = await self._readable_queue(str(method.queue))
            tag = str(method.consumer_tag) or f"amq.ctag-{secrets.token_urlsafe(16)}"
            if tag in self.book.consumers:
                raise AMQPConnectionError(
                    NOT_ALLOWED, f"attempt to reuse consumer tag '{tag}'", *_ids(type(method))
                )
            registry = self.broker.deliverer.registry
            others = registry.of(queue.stage)
            if others and (method.exclusive or any(c.exclusive for c in others)):
                raise ChannelError(
                    ACCESS_REFUSED,
                    f"{resource('queue', queue.name, self.vhost)} in exclusive use",
                )
            consumer = Consumer(
                tag,
                queue.name,
                queue.stage,
                self.book,
                no_ack=bool(method.no_ack),
                exclusive=bool(method.exclusive),
                prefetch=self.book.prefetch_consumer,
            )
            self.broker.deliverer.queues[queue.stage] = queue
            registry.add(consumer)
        if not method.nowait:
            self._reply(methods.build_method(commands.Basic.ConsumeOk, consumer_tag=tag))
        self.broker.deliverer.pump(queue.stage)  # others of the queue may have read ahead
        self.broker.deliverer.link.wake("amqp")

    async def basic_cancel(self, method: commands.Basic.Cancel) -> None:
        consumer = self.book.consumers.get(str(method.consumer_tag))
        if consumer is not None:
            self._cancel(consumer)
        if not method.nowait:
            self._reply(
                methods.build_method(commands.Basic.CancelOk, consumer_tag=method.consumer_tag)
            )

    def _cancel(self, consumer: Consumer, *, delete_now: bool = True) -> str | None:
        """Its unacked deliveries stay the channel's (RabbitMQ); an auto-delete queue
        whose last consumer this was goes (now, or by the caller: its name)."""
        last = self.broker.deliverer.registry.remove(consumer)
        self.broker.expiry.touch(self.vhost, consumer.queue)  # x-expires counts from now
        queue = self.broker.deliverer.queues.get(consumer.stage)
        if not (last and queue is not None and queue.declaration.auto_delete):
            return None
        if delete_now:
            self.broker.spawn(self.broker.auto_delete_queue(self.vhost, queue.name))
        return queue.name

    async def consumers_closed(self) -> None:
        """The channel is gone: its consumers too, and every unacked delivery goes back,
        written before channel.close-ok is sent (the client may look at once). An
        auto-delete queue whose last consumer went is deleted after that write: at once,
        the two deadlocked on the same rows and the queue stayed."""
        emptied = [
            name
            for consumer in list(self.book.consumers.values())
            if (name := self._cancel(consumer, delete_now=False)) is not None
        ]
        deliverer = self.broker.deliverer
        returned = self.book.take_all()
        deliverer.books.discard(self.book)
        if returned:
            deliverer.requeue(returned)
            await deliverer.flush()
        for name in emptied:
            self.broker.spawn(self.broker.auto_delete_queue(self.vhost, name))

    # ---- get -----------------------------------------------------------------------------

    async def basic_get(self, method: commands.Basic.Get) -> None:
        with self._method(method):
            queue = await self._readable_queue(str(method.queue))
            self.broker.expiry.touch(self.vhost, queue.name)  # x-expires: a use
            await self.in_order()
            got = await self.broker.deliverer.get(queue)
        if got is None:
            self._reply(commands.Basic.GetEmpty())
            return
        fetched, ready = got
        tag = self.book.new_tag()
        self.channel.send_content(
            methods.build_method(
                commands.Basic.GetOk,
                delivery_tag=tag,
                redelivered=fetched.redelivered,
                exchange=fetched.exchange,
                routing_key=fetched.routing_key,
                message_count=ready,
            ),
            fetched.raw_properties,
            fetched.body,
        )
        delivery = Delivery(fetched.wid, queue.stage, None, fetched.delivery_count)
        if method.no_ack:
            self.broker.deliverer.ack([delivery])
        else:
            self.book.delivered(tag, delivery)

    # ---- outcomes ------------------------------------------------------------------------

    async def basic_ack(self, method: commands.Basic.Ack) -> None:
        self.ack_now(int(method.delivery_tag), bool(method.multiple))

    def ack_now(self, tag: int, multiple: bool) -> None:
        deliverer = self.broker.deliverer
        if multiple:
            deliverer.ack(self._take(tag, multiple, commands.Basic.Ack))
        else:
            try:
                delivery = self.book.take_one(tag)
            except UnknownTag as error:
                raise ChannelError(
                    PRECONDITION_FAILED, str(error), *_ids(commands.Basic.Ack)
                ) from None
            deliverer.ack_one(delivery)
        deliverer.credit_freed(self.book)

    async def basic_nack(self, method: commands.Basic.Nack) -> None:
        deliveries = self._take(int(method.delivery_tag), bool(method.multiple), type(method))
        self._return_or_reject(deliveries, bool(method.requeue))

    async def basic_reject(self, method: commands.Basic.Reject) -> None:
        deliveries = self._take(int(method.delivery_tag or 0), False, type(method))
        self._return_or_reject(deliveries, bool(method.requeue))

    def _return_or_reject(self, deliveries: list[Delivery], requeue: bool) -> None:
        deliverer = self.broker.deliverer
        if requeue:
            deliverer.requeue(deliveries)
        else:
            deliverer.reject(deliveries)
        deliverer.credit_freed(self.book)

    async def basic_recover(self, method: commands.Basic.Recover) -> None:
        self._recover(method)
        self._reply(commands.Basic.RecoverOk())

    async def basic_recover_async(self, method: commands.Basic.RecoverAsync) -> None:
        self._recover(method)

    def _recover(self, method: commands.Basic.Recover | commands.Basic.RecoverAsync) -> None:
        """Every unacked delivery back to its queue, redelivered (requeue=false, redelivery
        to the same consumer, is not implemented, as in RabbitMQ)."""
        if not method.requeue:
            raise AMQPConnectionError(NOT_IMPLEMENTED, "requeue=false", *_ids(type(method)))
        returned = self.book.take_all()
        if returned:
            self.broker.deliverer.requeue(returned)
            self.broker.deliverer.credit_freed(self.book)


__all__ = ["ConsumingChannel"]
