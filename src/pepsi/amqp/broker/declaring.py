"""A channel's exchange.* and queue.*: declare, bind, unbind, purge and delete.

`DeclaringChannel` is the part of `broker.BrokerChannel` that changes the
catalogue (`catalogue.Catalogue`, one transaction per change); the checks are
`model.routing` and `model.arguments` (pure), the answers and error codes
RabbitMQ 3.x's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from pamqp import base, commands

from pepsi.amqp.auth.permissions import Access
from pepsi.amqp.broker.catalogue import Catalogue, Queue, VhostView
from pepsi.amqp.broker.consume.consuming import stage_queue_text
from pepsi.amqp.broker.consume.state import count_between_claims
from pepsi.amqp.model.arguments import parse_queue_arguments
from pepsi.amqp.model.consumers import Delivery
from pepsi.amqp.model.exchanges import (
    EXCHANGE,
    QUEUE,
    Binding,
    Exchange,
    check_binding,
    check_exchange_declare,
    check_exchange_delete,
)
from pepsi.amqp.model.queues import (
    QueueDeclaration,
    check_queue_properties,
    check_queue_redeclare,
    declare_queue_name,
)
from pepsi.amqp.model.topics import check_new_binding
from pepsi.amqp.model.values import resource
from pepsi.amqp.session.connection import Connection
from pepsi.amqp.session.handler import ChannelHandler
from pepsi.amqp.wire import methods
from pepsi.amqp.wire.replies import ACCESS_REFUSED, NOT_FOUND, PRECONDITION_FAILED, ChannelError

if TYPE_CHECKING:
    from pepsi.amqp.broker.consume.delivery import Deliverer
    from pepsi.amqp.broker.expiry import Expiry


class Broker(Protocol):
    """What a declaring channel needs of the broker (`broker.Broker`, whose channels
    these are: this module does not import it back)."""

    deliverer: Deliverer
    expiry: Expiry
    exclusive: dict[tuple[str, str], Connection]

    def own(self, connection: Connection, vhost: str, queue: str) -> None: ...

    async def delete_queue(self, vhost: str, name: str) -> int: ...


class DeclaringChannel(ChannelHandler):
    """exchange.* and queue.*; mixed into BrokerChannel, which provides the helpers."""

    broker: Broker
    catalogue: Catalogue
    connection: Connection
    vhost: str
    last_queue: str | None

    # provided by BrokerChannel, and the in_order waits by ConsumingChannel (after this
    # class in BrokerChannel's bases): declared for the type checker only, so none hides them
    if TYPE_CHECKING:

        async def in_order(self) -> None: ...

        async def counted_in_order(self, stage: str) -> None: ...

        def _method(self, method: base.Frame) -> contextlib.AbstractContextManager[None]: ...

        def _require(self, access: Access, kind: str, name: str) -> None: ...

        def _queue_name(self, name: str) -> str: ...

        def _existing_queue(self, view: VhostView, name: str) -> Queue: ...

        def _check_exclusive(self, queue: Queue) -> None: ...

        def _reply(self, method: base.Frame) -> None: ...

    def _existing_exchange(self, view: VhostView, name: str) -> Exchange:
        exchange = view.exchanges.get(name)
        if exchange is None:
            raise ChannelError(NOT_FOUND, f"no {resource('exchange', name, self.vhost)}")
        return exchange

    # ---- exchanges --------------------------------------------------------------------

    async def exchange_declare(self, method: commands.Exchange.Declare) -> None:
        with self._method(method):
            name = str(method.exchange)
            requested = Exchange(
                self.vhost,
                name,
                str(method.exchange_type),
                bool(method.durable),
                bool(method.auto_delete),
                bool(method.internal),
                dict(method.arguments or {}),
            )
            view = await self.catalogue.view(self.vhost)
            existing = view.exchanges.get(name)
            if not method.passive and name:
                self._require(Access.CONFIGURE, EXCHANGE, name)
                alternate = requested.arguments.get("alternate-exchange")
                if isinstance(alternate, str | bytes):  # as RabbitMQ: what reaches the
                    # alternate is published to it by whoever may read the declared one
                    alternate = alternate.decode() if isinstance(alternate, bytes) else alternate
                    self._require(Access.READ, EXCHANGE, name)
                    self._require(Access.WRITE, EXCHANGE, alternate)
            check_exchange_declare(requested, existing, passive=bool(method.passive))
            if existing is None and not method.passive:
                await self.catalogue.declare_exchange(requested)
        if not method.nowait:
            self._reply(commands.Exchange.DeclareOk())

    async def exchange_delete(self, method: commands.Exchange.Delete) -> None:
        with self._method(method):
            name = str(method.exchange)
            check_exchange_delete(self.vhost, name)
            self._require(Access.CONFIGURE, EXCHANGE, name)
            view = await self.catalogue.view(self.vhost)
            if name in view.exchanges:
                if method.if_unused and view.bindings_of_source(name):
                    raise ChannelError(
                        PRECONDITION_FAILED, f"{resource('exchange', name, self.vhost)} in use"
                    )
                sources = view.sources_bound_to(EXCHANGE, name)
                await self.catalogue.delete_exchange(self.vhost, name, sources)
        if not method.nowait:
            self._reply(commands.Exchange.DeleteOk())

    async def _exchange_binding(
        self, method: commands.Exchange.Bind | commands.Exchange.Unbind, *, bind: bool
    ) -> None:
        binding = Binding(
            str(method.source),
            str(method.destination),
            EXCHANGE,
            str(method.routing_key),
            dict(method.arguments or {}),
        )
        check_binding(binding)
        self._require(Access.WRITE, EXCHANGE, binding.destination)
        self._require(Access.READ, EXCHANGE, binding.source_exchange)
        view = await self.catalogue.view(self.vhost)
        if not bind and not (
            binding.source_exchange in view.exchanges and binding.destination in view.exchanges
        ):
            return  # RabbitMQ: unbinding what is gone already is done (unbind-ok)
        source = self._existing_exchange(view, binding.source_exchange)
        self._existing_exchange(view, binding.destination)
        check_binding(binding, source)
        if bind:
            check_new_binding(binding, source, view.bindings_of_source(source.name))
            await self.catalogue.bind(self.vhost, binding)
        else:
            await self.catalogue.unbind(self.vhost, binding)

    async def exchange_bind(self, method: commands.Exchange.Bind) -> None:
        with self._method(method):
            await self._exchange_binding(method, bind=True)
        if not method.nowait:
            self._reply(commands.Exchange.BindOk())

    async def exchange_unbind(self, method: commands.Exchange.Unbind) -> None:
        with self._method(method):
            await self._exchange_binding(method, bind=False)
        if not method.nowait:
            self._reply(commands.Exchange.UnbindOk())

    # ---- queues -------------------------------------------------------------------------

    async def queue_declare(self, method: commands.Queue.Declare) -> None:
        with self._method(method):
            queue, stage, count = await self._declare(method)
        self.broker.expiry.touch(self.vhost, queue)  # x-expires: a use
        self.last_queue = queue
        if not method.nowait:
            # the stage the declaration found, not the cached view again: a catalogue
            # change (this declaration's own NOTIFY) may have dropped it meanwhile
            deliverer = self.broker.deliverer
            consumers = deliverer.registry.count(stage)
            count += deliverer.ready_count(stage)  # read ahead or loading: still ready
            self._reply(
                methods.build_method(
                    commands.Queue.DeclareOk,
                    queue=queue,
                    message_count=count,
                    consumer_count=consumers,
                )
            )

    async def _declare(self, method: commands.Queue.Declare) -> tuple[str, str, int]:
        """The queue declared or found: its name, its stage, its pending messages."""
        arguments: Mapping[str, object] = dict(method.arguments or {})
        passive = bool(method.passive)
        name = declare_queue_name(str(method.queue), arguments, passive=passive, vhost=self.vhost)
        view = await self.catalogue.view(self.vhost)
        if passive:
            found = self._existing_queue(view, self._queue_name(name))
            return found.name, found.stage, await self._pending_count(found.stage)
        self._require(Access.CONFIGURE, QUEUE, name)
        parsed = parse_queue_arguments(arguments, queue=name, vhost=self.vhost)
        declaration = QueueDeclaration(
            name,
            self.vhost,
            bool(method.durable),
            bool(method.exclusive),
            bool(method.auto_delete),
            arguments,
        )
        check_queue_properties(declaration, parsed.queue_type)
        if parsed.dead_letter_exchange is not None:
            self._require(Access.WRITE, EXCHANGE, parsed.dead_letter_exchange)
            self._require(Access.READ, QUEUE, name)
        existing = view.queues.get(name)
        if existing is None:
            stage = await self.catalogue.declare_queue(declaration)
            if stage is not None:
                if declaration.exclusive:
                    self.broker.own(self.connection, self.vhost, name)
                return name, stage, 0
            view = await self.catalogue.view(self.vhost)  # declared meanwhile: compare
            existing = self._existing_queue(view, name)
        owner = self.broker.exclusive.get((self.vhost, name))
        error = check_queue_redeclare(
            existing.declaration, declaration, same_connection=owner is self.connection
        )
        if error is not None:
            raise error
        return name, existing.stage, await self._pending_count(existing.stage)

    async def _pending_count(self, stage: str) -> int:
        """The stage's pending rows; without a query when the dispatcher knows them (its
        last claim, and this listener's commits since: Celery's client declares its
        auto-delete reply queue before every task, and its worker publishes results
        there). A row another process published counts from the moment its NOTIFY
        reaches the dispatcher."""
        await self.counted_in_order(stage)  # this channel's publishes to it, its returns
        link = self.broker.deliverer.link
        known = link.known_pending(stage)
        if known is not None:
            return known
        return await count_between_claims(link, lambda: self.catalogue.message_count(stage))

    async def _queue_binding(
        self, method: commands.Queue.Bind | commands.Queue.Unbind, *, bind: bool
    ) -> None:
        queue_name = self._queue_name(str(method.queue))
        routing_key = str(method.routing_key)
        if not method.queue and not routing_key:
            routing_key = queue_name  # RabbitMQ: both empty mean the last queue, by name
        binding = Binding(
            str(method.exchange), queue_name, QUEUE, routing_key, dict(method.arguments or {})
        )
        check_binding(binding)
        self._require(Access.WRITE, QUEUE, queue_name)
        self._require(Access.READ, EXCHANGE, binding.source_exchange)
        view = await self.catalogue.view(self.vhost)
        if not bind and not (
            queue_name in view.queues and binding.source_exchange in view.exchanges
        ):
            return  # RabbitMQ: unbinding what is gone already is done (unbind-ok)
        self._existing_queue(view, queue_name)
        source = self._existing_exchange(view, binding.source_exchange)
        check_binding(binding, source)
        if bind:
            check_new_binding(binding, source, view.bindings_of_source(source.name))
            await self.catalogue.bind(self.vhost, binding)
        else:
            await self.catalogue.unbind(self.vhost, binding)

    async def queue_bind(self, method: commands.Queue.Bind) -> None:
        with self._method(method):
            await self._queue_binding(method, bind=True)
        if not method.nowait:
            self._reply(commands.Queue.BindOk())

    async def queue_unbind(self, method: commands.Queue.Unbind) -> None:
        with self._method(method):
            await self._queue_binding(method, bind=False)
        self._reply(commands.Queue.UnbindOk())

    async def queue_purge(self, method: commands.Queue.Purge) -> None:
        with self._method(method):
            name = self._queue_name(str(method.queue))
            self._require(Access.READ, QUEUE, name)
            queue = self._existing_queue(await self.catalogue.view(self.vhost), name)
            await self.in_order()
            # Between claims: the rows of a claim under way are not read ahead yet, and
            # would outlive the purge (a claim that starts during the DELETE still may).
            link = self.broker.deliverer.link
            await link.between_claims()
            count = self._drop_read_ahead(queue.stage)
            count += await self.catalogue.purge_queue(queue.stage)
            link.changed(queue.stage)
        if not method.nowait:
            self._reply(methods.build_method(commands.Queue.PurgeOk, message_count=count))

    def _drop_read_ahead(self, stage: str) -> int:
        """queue.purge: the read-ahead is ready messages too, and those being loaded: gone
        (acknowledged), how many."""
        deliverer = self.broker.deliverer
        ahead = deliverer.drop_ready(stage)
        deliverer.ack(Delivery(wid, stage, None, 0) for wid in ahead)
        return len(ahead) + deliverer.purge_loading(stage)

    async def queue_delete(self, method: commands.Queue.Delete) -> None:
        with self._method(method):
            name = self._queue_name(str(method.queue))
            self._require(Access.CONFIGURE, QUEUE, name)
            view = await self.catalogue.view(self.vhost)
            queue = view.queues.get(name)
            count = 0
            if queue is not None:  # a missing queue is deleted already (RabbitMQ: ok, 0)
                self._check_exclusive(queue)
                if queue.is_stage:
                    raise ChannelError(ACCESS_REFUSED, stage_queue_text(queue, self.vhost))
                await self.in_order()
                if method.if_unused and self.broker.deliverer.registry.count(queue.stage):
                    raise ChannelError(
                        PRECONDITION_FAILED, f"{resource('queue', name, self.vhost)} in use"
                    )
                if method.if_empty and (
                    self.broker.deliverer.ready_count(queue.stage)  # read ahead: ready too
                    or await self.catalogue.message_count(queue.stage)
                ):
                    raise ChannelError(
                        PRECONDITION_FAILED, f"{resource('queue', name, self.vhost)} not empty"
                    )
                count = await self.broker.delete_queue(self.vhost, name)
        if not method.nowait:
            self._reply(methods.build_method(commands.Queue.DeleteOk, message_count=count))
