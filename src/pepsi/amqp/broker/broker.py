"""The broker behind the listener, and its channels (issue 16).

`Broker` is what `Server(broker=...)` asks for a `ChannelHandler` per opened
channel (the seam in `session/handler.py`). It owns:

- a `catalogue.Catalogue`: exchanges, queues and bindings in PostgreSQL, a cached
  view and `RoutingTable` per vhost;
- a `publish.batcher.Batcher`: every publish of every channel becomes rows of
  `pepsi.workqueue`, many publishes per commit; confirms are sent when the batch
  commits, never before (A-2);
- the exclusive queues of each open connection, deleted when it ends;
- a `delivery.Deliverer`: the consumers, fed by the dispatcher's claim within their
  credit, and their outcomes written to the rows.

`BrokerChannel` is one channel: the helpers its parts share, and its parts:
`declaring.DeclaringChannel` (exchange.* and queue.*),
`publish.publishing.PublishingChannel` (basic.publish, with confirm and tx modes)
and `consuming.ConsumingChannel` (receiving).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any, cast

from pamqp import base

from pepsi.amqp.auth.permissions import Access, allowed, exchange_resource
from pepsi.amqp.broker.catalogue import Catalogue, Queue, VhostView
from pepsi.amqp.broker.consume.consuming import ConsumingChannel
from pepsi.amqp.broker.consume.delivery import Deliverer
from pepsi.amqp.broker.declaring import DeclaringChannel
from pepsi.amqp.broker.expiry import Expiry
from pepsi.amqp.broker.publish.batcher import Batcher
from pepsi.amqp.broker.publish.publishing import PublishingChannel
from pepsi.amqp.model.exchanges import EXCHANGE, QUEUE
from pepsi.amqp.model.queues import QueueDeclaration
from pepsi.amqp.model.values import resource
from pepsi.amqp.session.connection import Connection
from pepsi.amqp.session.handler import Channel, ChannelHandler
from pepsi.amqp.wire.replies import (
    ACCESS_REFUSED,
    NOT_FOUND,
    RESOURCE_LOCKED,
    AMQPError,
    ChannelError,
)

log = logging.getLogger("pepsi.amqp")


def refused(access: Access, kind: str, name: str, vhost: str, user: str) -> ChannelError:
    """RabbitMQ's 403 for a missing permission."""
    return ChannelError(
        ACCESS_REFUSED,
        f"access to {resource(kind, name, vhost)} refused for user '{user}'",
    )


# --- the broker ---------------------------------------------------------------------------


class Broker:
    """Exchanges, queues and publishing over PostgreSQL (see the module doc)."""

    def __init__(
        self,
        dsn: str,
        connect_timeout: float,
        entries: tuple[str, ...] = (),
        entry_limits: Mapping[str, tuple[int, bool]] | None = None,
    ) -> None:
        self.entries = entries  # [pepsi-amqp] STAGES: stages that are queues of vhost /
        self.catalogue = Catalogue(
            dsn, connect_timeout, {name: name for name in entries}, entry_limits
        )
        self.batcher = Batcher(dsn, connect_timeout)
        self.deliverer = Deliverer(dsn, connect_timeout)
        self.deliverer.dead_letter_route = self._dead_letter_route
        # (vhost, queue) -> the connection that owns the exclusive queue
        self.exclusive: dict[tuple[str, str], Connection] = {}
        self._watched: set[int] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.expiry = Expiry(self, dsn, connect_timeout)  # x-expires, expired messages

    def channel_handler(self, channel: Channel) -> ChannelHandler:
        return BrokerChannel(self, channel)

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def own(self, connection: Connection, vhost: str, queue: str) -> None:
        """`connection` declared the exclusive queue: it goes when the connection does."""
        self.exclusive[(vhost, queue)] = connection
        if id(connection) in self._watched or connection.task is None:
            return
        self._watched.add(id(connection))

        def gone(_: object) -> None:
            self._watched.discard(id(connection))
            mine = [key for key, owner in self.exclusive.items() if owner is connection]
            for key in mine:
                del self.exclusive[key]
            if mine:
                self.spawn(self._delete_exclusive(mine))

        connection.task.add_done_callback(gone)

    async def drop_transient(self) -> None:
        """At the broker's start: the queues that do not outlive a restart go, with their
        messages, as RabbitMQ's: non-durable ones, and exclusive ones (their connection
        is gone). A durable queue keeps every message, transient ones included."""
        for vhost, name in await self.catalogue.transient_queues():
            try:
                count = await self.delete_queue(vhost, name)
            except AMQPError:
                log.warning("amqp: could not delete transient queue %r in %r", name, vhost)
                continue
            log.info(
                "amqp: transient queue %r in %r deleted at start (%d messages)", name, vhost, count
            )

    async def declare_entries(self) -> None:
        """The queues of [pepsi-amqp] STAGES, in vhost / (durable, as every queue)."""
        view = await self.catalogue.view("/")
        for name in self.entries:
            if name not in view.queues:
                await self.catalogue.declare_queue(
                    QueueDeclaration(name, "/", True, False, False, {})
                )

    async def _delete_exclusive(self, queues: list[tuple[str, str]]) -> None:
        for vhost, name in queues:
            try:
                await self.delete_queue(vhost, name)
            except AMQPError:
                log.warning("amqp: could not delete exclusive queue %r in %r", name, vhost)

    async def delete_queue(self, vhost: str, name: str) -> int:
        """Delete a queue (its bindings and rows): its consumers are cancelled."""
        view = await self.catalogue.view(vhost)
        queue = view.queues.get(name)
        count = await self.catalogue.delete_queue(vhost, name, view.sources_bound_to(QUEUE, name))
        self.exclusive.pop((vhost, name), None)
        if queue is not None:
            self.deliverer.link.changed(queue.stage)  # a queue declared again starts empty
            self.queue_gone(queue.stage)
        return count

    async def auto_delete_queue(self, vhost: str, name: str) -> None:
        """An auto-delete queue lost its last consumer (unless one came back meanwhile)."""
        view = await self.catalogue.view(vhost)
        queue = view.queues.get(name)
        if queue is None or self.deliverer.registry.count(queue.stage):
            return
        try:
            await self.delete_queue(vhost, name)
        except AMQPError:
            log.warning("amqp: could not delete auto-delete queue %r in %r", name, vhost)

    def queue_gone(self, stage: str) -> None:
        """Server-sent basic.cancel to the consumers of a deleted queue (its rows are gone,
        read-ahead included)."""
        gone = self.deliverer.drop_ready(stage)
        if gone:
            self.deliverer.link.consumed(stage, gone)
        for consumer in list(self.deliverer.registry.of(stage)):
            self.deliverer.registry.remove(consumer)
            owner = consumer.book.owner
            if isinstance(owner, ConsumingChannel):
                owner.server_cancel(consumer)
        self.deliverer.queues.pop(stage, None)

    async def _dead_letter_route(
        self, stage: str, exchange: str, routing_keys: list[str], headers: dict[str, Any] | None
    ) -> tuple[list[str], dict[str, int]]:
        """The stages a dead letter from `stage` reaches through `exchange` (none if the
        exchange is missing, as RabbitMQ drops it then), and the x-message-ttl of those
        that have one: it applies to the dead letter from its arrival there."""
        queue = self.deliverer.queues.get(stage)
        if queue is None:
            return [], {}
        view = await self.catalogue.view(queue.declaration.vhost)
        if exchange not in view.exchanges:
            return [], {}
        names: set[str] = set()
        for key in routing_keys:
            with contextlib.suppress(AMQPError):
                names |= set(view.table.route(exchange, key, headers))
        queues = [view.queues[n] for n in names if n in view.queues]
        ttls = {q.stage: q.arguments.message_ttl for q in queues}
        return sorted(q.stage for q in queues), {s: t for s, t in ttls.items() if t is not None}

    async def close(self) -> None:
        """After the server stopped: commit what is queued, then close the connections."""
        await self.expiry.close()  # before the deliverer: it writes what expiry handed over
        await self.batcher.stop_direct()  # rows being written for consumers: handed over
        await self.deliverer.close()
        await self.batcher.close()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        await self.catalogue.close()


class BrokerChannel(DeclaringChannel, PublishingChannel, ConsumingChannel):
    """One channel's exchanges, queues and publishes (and, inherited, its consuming)."""

    broker: Broker  # the whole broker here; each part knows it by what it uses

    def __init__(self, broker: Broker, channel: Channel) -> None:
        self.broker = broker
        super().__init__(channel)
        self.catalogue = broker.catalogue
        # every channel lives on a session Connection; the seam names it by its members
        conn = cast(Connection, channel.connection)
        self.connection = conn
        self.vhost = conn.vhost or "/"
        self.user = conn.username or ""
        self.last_queue: str | None = None  # queue.* with an empty name mean this one
        self.open = True

    async def closed(self) -> None:
        self.open = False
        self.tx = None
        await self.consumers_closed()

    # ---- helpers ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _method(self, method: base.Frame) -> Iterator[None]:
        """Errors raised while handling `method` name it (class and method ids)."""
        try:
            yield
        except AMQPError as error:
            if not error.class_id:
                error.class_id, error.method_id = method.index >> 16, method.index & 0xFFFF
            raise

    def _require(self, access: Access, kind: str, name: str) -> None:
        checked = exchange_resource(name) if kind == EXCHANGE else name
        if not allowed(self.connection.permission, access, checked):
            raise refused(access, kind, checked, self.vhost, self.user)

    def _queue_name(self, name: str) -> str:
        if name:
            return name
        if self.last_queue is None:
            raise ChannelError(NOT_FOUND, "no previously declared queue")
        return self.last_queue

    def _existing_queue(self, view: VhostView, name: str) -> Queue:
        queue = view.queues.get(name)
        if queue is None:
            raise ChannelError(NOT_FOUND, f"no {resource('queue', name, self.vhost)}")
        self._check_exclusive(queue)
        return queue

    def _check_exclusive(self, queue: Queue) -> None:
        if not queue.declaration.exclusive:
            return
        owner = self.broker.exclusive.get((self.vhost, queue.name))
        if owner is not self.connection:
            what = resource("queue", queue.name, self.vhost)
            raise ChannelError(
                RESOURCE_LOCKED,
                f"cannot obtain exclusive access to locked {what}."
                " It could be originally declared on another connection or the exclusive "
                "property value does not match that of the original declaration.",
            )

    def _reply(self, method: base.Frame) -> None:
        if self.open:
            self.channel.send_method(method)
