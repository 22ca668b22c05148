"""The broker behind the listener: exchanges, queues, bindings and publishing (issue 16).

`Broker` is what `Server(broker=...)` asks for a `ChannelHandler` per opened
channel (the seam in connection.py). It owns:

- a `catalogue.Catalogue`: exchanges, queues and bindings in PostgreSQL, a cached
  view and `RoutingTable` per vhost;
- a `publisher.Batcher`: every publish of every channel becomes rows of
  `pepsi.workqueue`, many publishes per commit; confirms are sent when the batch
  commits, never before (A-2);
- the exclusive queues of each open connection, deleted when it ends.

An AMQP queue is a stage (`amqp_queue.stage`, 'amqp:VHOST:QUEUE'); a publish
writes one row per destination queue with the content header's property octets
as received in `workqueue_body.header` and the body in `workqueue_body.body`.

- a `delivery.Deliverer`: the consumers, fed by the dispatcher's claim within their
  credit, and their outcomes written to the rows; the channel side of consuming is
  `consuming.ConsumingChannel`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ipaddress
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from pamqp import base, commands

from pepsi.addresses import MAX_TEXT  # a longer property is not copied into its column
from pepsi.amqp.auth.permissions import Access, allowed, exchange_resource
from pepsi.amqp.broker.catalogue import Catalogue, Queue, VhostView
from pepsi.amqp.broker.consuming import ConsumingChannel, stage_queue_text
from pepsi.amqp.broker.delivery import Deliverer
from pepsi.amqp.broker.expiry import Expiry, ttl_expires
from pepsi.amqp.broker.publisher import Batcher, Item, Unit, group_confirms
from pepsi.amqp.model.arguments import (
    MAX_EXPIRY_MS,
    QueueDeclaration,
    check_queue_properties,
    check_queue_redeclare,
    declare_queue_name,
    parse_queue_arguments,
    resource,
)
from pepsi.amqp.model.consumers import Delivery
from pepsi.amqp.model.routing import (
    EXCHANGE,
    QUEUE,
    Binding,
    Exchange,
    check_binding,
    check_exchange_declare,
    check_exchange_delete,
    check_new_binding,
)
from pepsi.amqp.session.closing import close_for
from pepsi.amqp.session.connection import Connection
from pepsi.amqp.session.handler import Channel, ChannelHandler
from pepsi.amqp.wire import framing, replies
from pepsi.amqp.wire.replies import (
    ACCESS_REFUSED,
    INTERNAL_ERROR,
    NOT_FOUND,
    NOT_IMPLEMENTED,
    PRECONDITION_FAILED,
    RESOURCE_LOCKED,
    AMQPConnectionError,
    AMQPError,
    ChannelError,
)
from pepsi.publishing.message import Row

log = logging.getLogger("pepsi.amqp")

ROUTING_CACHE: Final = 1024  # (exchange, routing key) JSON texts kept per channel
PROPERTIES_CACHE: Final = 64  # parsed property lists kept per channel ...
PROPERTIES_CACHE_OCTETS: Final = 512  # ... each at most this long
_PUBLISH_CLASS, _PUBLISH_METHOD = (
    commands.Basic.Publish.index >> 16,
    commands.Basic.Publish.index & 0xFFFF,
)


# --- pure helpers ----------------------------------------------------------------------


def refused(access: Access, kind: str, name: str, vhost: str, user: str) -> ChannelError:
    """RabbitMQ's 403 for a missing permission."""
    return ChannelError(
        ACCESS_REFUSED,
        f"access to {resource(kind, name, vhost)} refused for user '{user}'",
    )


def parse_expiration(value: object) -> int | None:
    """The `expiration` property in milliseconds (None: absent); 406 as RabbitMQ refuses it."""
    if value is None:
        return None
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    try:
        number = int(text, 10)
    except ValueError:
        raise ChannelError(
            PRECONDITION_FAILED, f"invalid expiration '{text}': no_integer"
        ) from None
    if number < 0:
        raise ChannelError(
            PRECONDITION_FAILED, f"invalid expiration '{text}': {{value_negative,{number}}}"
        )
    if number > MAX_EXPIRY_MS:
        raise ChannelError(
            PRECONDITION_FAILED, f"invalid expiration '{text}': {{value_too_large,{number}}}"
        )
    return number


def column_text(value: object) -> str | None:
    """A property as a text column: a str PostgreSQL can store, not too long; else None.

    The property stays in the raw header either way; the column is for SQL.
    """
    if value is None:  # the common case, three times per publish
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str) or "\x00" in value or len(value) > MAX_TEXT:
        return None
    return value


def column_peer(peer: str | None) -> str | None:
    if peer is None:
        return None
    try:
        return str(ipaddress.ip_address(peer))
    except ValueError:
        return None


class Route(NamedTuple):
    """Where a publish goes: its queues (sorted), and their stages when every one of them
    takes a plain row (no length or byte limit, no message TTL); else None."""

    queues: list[str]
    plain: tuple[str, ...] | None


# x-message-ttl = 0: with a consumer ready at publish, the message has this long to reach
# it (the commit, the claim and the send take milliseconds); else it expires at once
ZERO_TTL_DELIVERY_MS = 1000


def plain_stages(view: VhostView, queues: list[str]) -> tuple[str, ...] | None:
    stages = []
    for name in queues:
        queue = view.queues[name]
        arguments = queue.arguments
        if (
            queue.limit is not None
            or arguments.max_length_bytes is not None
            or arguments.message_ttl is not None
            or arguments.max_priority
        ):
            return None
        stages.append(queue.stage)
    return tuple(stages)


def routing_json(exchange: str, routing_key: str) -> str:
    """What a consumer needs back for basic.deliver, in `workqueue.properties`."""
    return json.dumps({"exchange": exchange, "routing_key": routing_key}).replace("\\u0000", "")


# The content header's property flags (class basic), high bit first, and what each holds:
# a shortstr ("s"), a table ("t", a long length then the items), or a fixed size in octets.
_PROPERTY_LAYOUT: Final = (
    ("content_type", "s"), ("content_encoding", "s"), ("headers", "t"), ("delivery_mode", 1),
    ("priority", 1), ("correlation_id", "s"), ("reply_to", "s"), ("expiration", "s"),
    ("message_id", "s"), ("timestamp", 8), ("type", "s"), ("user_id", "s"), ("app_id", "s"),
    ("cluster_id", "s"),
)  # fmt: skip
_WANTED: Final = frozenset({"content_type", "correlation_id", "expiration", "message_id",
                            "user_id"})  # fmt: skip
_PRIORITY_BIT: Final = 11  # the flag of `priority`, an octet


@dataclass(frozen=True)
class Properties:
    """What the broker reads of a content header, without decoding its headers table.

    Strings stay the octets sent; `headers` is the table's items (None: no table),
    decoded only when routing needs them (`decoded_headers`).
    """

    content_type: bytes | None = None
    correlation_id: bytes | None = None
    expiration: bytes | None = None
    message_id: bytes | None = None
    user_id: bytes | None = None
    headers: bytes | None = None
    priority: int = 0  # 0 as well when absent

    def decoded_headers(self) -> dict[str, Any] | None:
        return None if self.headers is None else framing.decode_table(self.headers)


def read_properties(raw: bytes) -> Properties:
    """The fields the broker uses, read from property octets whose structure the frame
    reader has checked (`framing`); ValueError if they are malformed after all."""
    try:
        flags = int.from_bytes(raw[:2], "big")
        pos = 2
        found: dict[str, bytes] = {}
        for bit, (name, kind) in zip(range(15, 1, -1), _PROPERTY_LAYOUT, strict=True):
            if not flags & (1 << bit):
                continue
            if kind == "s":
                end = pos + 1 + raw[pos]
                if name in _WANTED:
                    found[name] = raw[pos + 1 : end]
            elif kind == "t":
                end = pos + 4 + int.from_bytes(raw[pos : pos + 4], "big")
                found[name] = raw[pos + 4 : end]
            else:
                assert isinstance(kind, int)
                end = pos + kind
                if bit == _PRIORITY_BIT and end <= len(raw):
                    found[name] = raw[pos]  # type: ignore[assignment]  # an int, not octets
            if end > len(raw):
                raise ValueError("property list truncated")
            pos = end
    except IndexError:
        raise ValueError("property list truncated") from None
    return Properties(**found)  # type: ignore[arg-type]  # priority: an int


@dataclass
class _Confirms:
    """One confirm-mode channel's delivery tags."""

    next_tag: int = 1
    settled_through: int = 0


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
        await self.deliverer.close()
        await self.batcher.close()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        await self.catalogue.close()


def _as_publish_error(error: AMQPError) -> None:
    """An error of a publish is answered as basic.publish's (its class and method ids)."""
    if not error.class_id:
        error.class_id, error.method_id = _PUBLISH_CLASS, _PUBLISH_METHOD


class BrokerChannel(ConsumingChannel):
    """One channel's exchanges, queues and publishes (and, inherited, its consuming)."""

    broker: Broker  # the whole broker here; consuming knows it by what it uses

    def __init__(self, broker: Broker, channel: Channel) -> None:
        self.broker = broker
        super().__init__(channel)
        self.catalogue = broker.catalogue
        conn = channel.connection
        self.connection = conn
        self.vhost = conn.vhost or "/"
        self.user = conn.username or ""
        self.peer = column_peer(conn.peer)
        self.last_queue: str | None = None  # queue.* with an empty name mean this one
        self.confirms: _Confirms | None = None
        self.tx: list[Item] | None = None  # tx mode: publishes held until tx.commit
        self.tx_returns: list[framing.Content] = []
        self.open = True
        self._settled: list[tuple[int, bool]] = []
        self._writable: set[str] = set()  # exchanges this user may publish to
        self._routing: dict[tuple[str, str], str] = {}  # routing_json, per key
        self._props_cache: dict[bytes, Properties] = {}  # read_properties, per raw octets
        self._route_view: VhostView | None = None  # the view _route_cache was made from
        self._route_cache: dict[tuple[str, str], Route] = {}  # per (exchange, key)
        # The last publish's rows without their body, and what they were made from (the
        # view, exchange, routing key and property octets): see `_route`.
        self._last_rows: tuple[VhostView, str, str, bytes, tuple[tuple[Any, ...], ...]] | None
        self._last_rows = None
        self._flush_scheduled = False

    async def closed(self) -> None:
        self.open = False
        self.tx = None
        await self.consumers_closed()

    def permissions_changed(self) -> None:
        """The user's patterns changed (`pepsi amqp permissions set`): check them afresh."""
        self._writable.clear()

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

    def _existing_exchange(self, view: VhostView, name: str) -> Exchange:
        exchange = view.exchanges.get(name)
        if exchange is None:
            raise ChannelError(NOT_FOUND, f"no {resource('exchange', name, self.vhost)}")
        return exchange

    def _reply(self, method: base.Frame) -> None:
        if self.open:
            self.channel.send_method(method)

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
            await self.in_order()  # its message_count counts this channel's publishes
            queue, count = await self._declare(method)
        self.broker.expiry.touch(self.vhost, queue)  # x-expires: a use
        self.last_queue = queue
        if not method.nowait:
            view = self.catalogue.cached(self.vhost)
            consumers = 0
            if view is not None and queue in view.queues:
                stage = view.queues[queue].stage
                deliverer = self.broker.deliverer
                consumers = deliverer.registry.count(stage)
                count += deliverer.ready_count(stage)  # read ahead or loading: still ready
            self._reply(
                framing.build_method(
                    commands.Queue.DeclareOk,
                    queue=queue,
                    message_count=count,
                    consumer_count=consumers,
                )
            )

    async def _declare(self, method: commands.Queue.Declare) -> tuple[str, int]:
        arguments: Mapping[str, object] = dict(method.arguments or {})
        passive = bool(method.passive)
        name = declare_queue_name(str(method.queue), arguments, passive=passive, vhost=self.vhost)
        view = await self.catalogue.view(self.vhost)
        if passive:
            found = self._existing_queue(view, self._queue_name(name))
            return found.name, await self.catalogue.message_count(found.stage)
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
                return name, 0
            view = await self.catalogue.view(self.vhost)  # declared meanwhile: compare
            existing = self._existing_queue(view, name)
        owner = self.broker.exclusive.get((self.vhost, name))
        error = check_queue_redeclare(
            existing.declaration, declaration, same_connection=owner is self.connection
        )
        if error is not None:
            raise error
        return name, await self.catalogue.message_count(existing.stage)

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
            deliverer = self.broker.deliverer
            await self.in_order()
            ahead = deliverer.drop_ready(queue.stage)  # read ahead: ready messages too
            deliverer.ack(Delivery(wid, queue.stage, None, 0) for wid in ahead)
            loading = deliverer.purge_loading(queue.stage)  # ... and those being loaded
            count = await self.catalogue.purge_queue(queue.stage) + len(ahead) + loading
        if not method.nowait:
            self._reply(framing.build_method(commands.Queue.PurgeOk, message_count=count))

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
            self._reply(framing.build_method(commands.Queue.DeleteOk, message_count=count))

    # ---- publishing ----------------------------------------------------------------------

    async def confirm_select(self, method: commands.Confirm.Select) -> None:
        if self.tx is not None:
            raise ChannelError(PRECONDITION_FAILED, "cannot switch from tx to confirm mode", 85, 10)
        if self.confirms is None:
            self.confirms = _Confirms()
        if not method.nowait:
            self._reply(commands.Confirm.SelectOk())

    async def tx_select(self, method: commands.Tx.Select) -> None:
        if self.confirms is not None:
            raise ChannelError(PRECONDITION_FAILED, "cannot switch from confirm to tx mode", 90, 10)
        if self.tx is None:
            self.tx = []
        self._reply(commands.Tx.SelectOk())

    def _transactional(self, method: base.Frame) -> list[Item]:
        if self.tx is None:
            raise ChannelError(
                PRECONDITION_FAILED,
                "channel is not transactional",
                method.index >> 16,
                method.index & 0xFFFF,
            )
        return self.tx

    async def tx_commit(self, method: commands.Tx.Commit) -> None:
        items = self._transactional(method)
        self.tx, returns, self.tx_returns = [], self.tx_returns, []
        for content in returns:
            self._return(content)
        if any(item.rows for item in items):
            loop = asyncio.get_running_loop()
            committed: asyncio.Future[BaseException | None] = loop.create_future()

            def done(_: list[Item], error: BaseException | None) -> None:
                if not committed.done():
                    committed.set_result(error)

            await self.broker.batcher.room()
            self.broker.batcher.submit(Unit(items, done))
            error = await committed
            if error is not None:
                raise AMQPConnectionError(
                    INTERNAL_ERROR, "the transaction could not be committed", 90, 20
                )
        self._reply(commands.Tx.CommitOk())

    async def tx_rollback(self, method: commands.Tx.Rollback) -> None:
        self._transactional(method)
        self.tx, self.tx_returns = [], []
        self._reply(commands.Tx.RollbackOk())

    def _return(self, content: framing.Content) -> None:
        method = content.method
        assert isinstance(method, commands.Basic.Publish)
        if not self.open:
            return
        self.channel.send_content(
            framing.build_method(
                commands.Basic.Return,
                reply_code=replies.NO_ROUTE,
                reply_text="NO_ROUTE",
                exchange=method.exchange,
                routing_key=method.routing_key,
            ),
            content.raw_properties,
            content.body,
        )

    async def basic_publish(self, content: framing.Content) -> None:
        method = content.method
        assert isinstance(method, commands.Basic.Publish)
        try:  # not a context manager: this is the path of every publish
            self._may_publish(method)
            view = self.catalogue.cached(self.vhost) or await self.catalogue.view(self.vhost)
            unit = self._publish_unit(content, method, view)
        except AMQPError as error:
            _as_publish_error(error)
            raise
        if unit is not None:
            batcher = self.broker.batcher
            if not batcher.has_room:
                await batcher.room()
            batcher.submit(unit)
            self.published = True

    async def publish_started(self, method: base.Frame) -> None:
        """Before a publish's body is kept: the write permission and the exchange
        (issue 34: a user without either made the dispatcher buffer gigabytes)."""
        assert isinstance(method, commands.Basic.Publish)
        try:
            self._may_publish(method)
            view = self.catalogue.cached(self.vhost) or await self.catalogue.view(self.vhost)
            view.table.check_publishable(str(method.exchange))
        except AMQPError as error:
            _as_publish_error(error)
            raise

    def publish_now(self, content: framing.Content) -> bool:
        """`basic_publish` without awaiting anything, when nothing needs to be awaited
        (the vhost's catalogue is in memory, the batcher has room); False otherwise,
        before anything is done: then the connection awaits `basic_publish`."""
        method = content.method
        assert isinstance(method, commands.Basic.Publish)
        view = self.catalogue.cached(self.vhost)
        batcher = self.broker.batcher
        if view is None or not batcher.has_room:
            return False
        try:
            self._may_publish(method)
            unit = self._publish_unit(content, method, view)
        except AMQPError as error:
            _as_publish_error(error)
            raise
        if unit is not None:
            batcher.submit(unit)
            self.published = True
        return True

    def _may_publish(self, method: commands.Basic.Publish) -> None:
        if method.immediate:
            raise AMQPConnectionError(NOT_IMPLEMENTED, "immediate=true")
        exchange = str(method.exchange)
        if exchange not in self._writable:
            self._require(Access.WRITE, EXCHANGE, exchange)
            self._writable.add(exchange)  # the connection's permission does not change

    def _publish_unit(
        self, content: framing.Content, method: commands.Basic.Publish, view: VhostView
    ) -> Unit | None:
        """Route the publish; the unit to submit, or None (in a transaction, or nothing
        to write and no confirm to send)."""
        item = self._route(content, method, view)
        if self.tx is not None:
            self.tx.append(item)
            return None
        if self.confirms is not None:
            tag = self.confirms.next_tag
            self.confirms.next_tag += 1
            return Unit([item], lambda items, error: self._settle(tag, items, error))
        if item.rows:
            return Unit([item], self._unconfirmed)
        return None

    def _route(
        self, content: framing.Content, method: commands.Basic.Publish, view: VhostView
    ) -> Item:
        exchange, routing_key = str(method.exchange), str(method.routing_key)
        raw = content.raw_properties
        last = self._last_rows
        if (
            last is not None
            and last[0] is view
            and last[1] == exchange
            and last[2] == routing_key
            and last[3] == raw
        ):
            # A publisher mostly repeats one publish with another body: the same view
            # (immutable, replaced on any change), exchange, key and property octets give
            # the same checks, route and columns; only the body differs.
            body = content.body
            return Item([Row._make((*head, body, priority)) for head, priority in last[4]])
        props, headers, expires = self._properties(content, view)
        route = self._queues_for(view, exchange, routing_key, headers)
        if not route.queues:
            if method.mandatory:
                if self.tx is not None:
                    self.tx_returns.append(content)
                else:
                    self._return(content)
            return Item([])
        item = self._item(content, view, route, props, expires)
        if expires is None and route.plain is not None:  # no per-message time in its rows
            self._last_rows = (
                view,
                exchange,
                routing_key,
                raw,
                tuple((r[:-2], r[-1]) for r in item.rows),
            )
        return item

    def _queues_for(
        self, view: VhostView, exchange: str, routing_key: str, headers: dict[str, Any] | None
    ) -> Route:
        """The sorted destination queues; without headers, remembered per (exchange, key)
        for as long as the vhost's view (immutable, replaced on any change) stays the same."""
        if headers is not None:
            return Route(sorted(view.table.route(exchange, routing_key, headers)), None)
        if self._route_view is not view:
            self._route_view, self._route_cache = view, {}
        key = (exchange, routing_key)
        route = self._route_cache.get(key)
        if route is None:
            queues = sorted(view.table.route(exchange, routing_key, None))  # 404/403 raise
            route = Route(queues, plain_stages(view, queues))
            if len(self._route_cache) >= ROUTING_CACHE:
                self._route_cache.clear()
            self._route_cache[key] = route
        return route

    def _properties(
        self, content: framing.Content, view: VhostView
    ) -> tuple[Properties, dict[str, Any] | None, dt.datetime | None]:
        """The properties, the headers if routing needs them, and when the message expires."""
        raw = content.raw_properties
        props = self._props_cache.get(raw)
        if props is None:
            try:
                props = read_properties(raw)
            except ValueError as error:
                raise AMQPConnectionError(
                    replies.SYNTAX_ERROR, f"malformed content properties: {error}"
                ) from None
            # Publishers mostly repeat one property list: parse each once (Properties is
            # frozen); short ones only, so the cache stays small.
            if len(raw) <= PROPERTIES_CACHE_OCTETS:
                if len(self._props_cache) >= PROPERTIES_CACHE:
                    self._props_cache.clear()
                self._props_cache[raw] = props
        if props.user_id is not None and props.user_id != self.user.encode():
            user_id = props.user_id.decode("utf-8", "replace")
            raise ChannelError(
                PRECONDITION_FAILED,
                f"user_id property set to '{user_id}' but authenticated user was '{self.user}'",
            )
        expiration = parse_expiration(props.expiration)
        headers = None
        if props.headers is not None and (
            view.uses_headers or b"\x02CC" in props.headers or b"\x03BCC" in props.headers
        ):
            headers = props.decoded_headers()  # FrameSyntaxError (502) if undecodable
        expires = (
            None
            if expiration is None
            else dt.datetime.now(dt.UTC) + dt.timedelta(milliseconds=expiration)
        )
        return props, headers, expires

    def _item(
        self,
        content: framing.Content,
        view: VhostView,
        route: Route,
        props: Properties,
        expires: dt.datetime | None,
    ) -> Item:
        """The publish as one row per destination queue, with the queues' limits."""
        method = content.method
        assert isinstance(method, commands.Basic.Publish)
        exchange, routing_key = str(method.exchange), str(method.routing_key)
        message_id = column_text(props.message_id)
        content_type = column_text(props.content_type)
        correlation_id = column_text(props.correlation_id)
        routing = self._routing.get((exchange, routing_key))
        if routing is None:
            if len(self._routing) > ROUTING_CACHE:
                self._routing.clear()
            routing = self._routing[(exchange, routing_key)] = routing_json(exchange, routing_key)
        # Every Row field after the stage, in Row's order (positional: 16 keywords per row
        # cost more than the rest of this method); priority 0, unless a queue says.
        tail = (
            message_id,  # message_id
            False,  # dedup
            None,  # sender
            None,  # recipients
            self.user or None,  # origin_user
            self.peer,  # origin_peer
            None,  # header_from
            None,  # subject
            content_type,
            correlation_id,
            routing,  # properties
            expires,
            content.raw_properties,  # header
            content.body,
            0,  # priority
        )
        if route.plain is not None:
            return Item([Row._make((stage, *tail)) for stage in route.plain])
        rows: list[Row] = []
        limits: dict[str, tuple[int, bool]] = {}
        now: dt.datetime | None = None
        rejected = False
        for name in route.queues:
            queue = view.queues[name]
            max_bytes = queue.arguments.max_length_bytes
            if (  # x-max-length-bytes, reject-publish: by the expiry pass's estimate
                max_bytes is not None
                and queue.arguments.effective_overflow != "drop-head"
                and not self.broker.expiry.admit(queue.stage, max_bytes, len(content.body))
            ):
                rejected = True  # not written to this queue; nacked (the others have it)
                continue
            ttl = queue.arguments.message_ttl
            top = queue.arguments.max_priority
            if ttl is None and not top:
                rows.append(Row._make((queue.stage, *tail)))
            else:  # a tuple of its own
                own = tail
                if ttl is not None:  # x-message-ttl: the sooner of the two expiries
                    now = now or dt.datetime.now(dt.UTC)
                    if ttl == 0 and self.broker.deliverer.takes_now(queue.stage):
                        ttl = ZERO_TTL_DELIVERY_MS  # a consumer takes it at once, as RabbitMQ
                    own = (*own[:11], ttl_expires(expires, ttl, now), *own[12:])
                if top:  # x-max-priority: the message's, at most the queue's (RabbitMQ)
                    own = (*own[:-1], min(props.priority, top))
                rows.append(Row._make((queue.stage, *own)))
            if queue.limit is not None:
                limits[queue.stage] = queue.limit
        item = Item(rows, limits)
        if rejected:
            item.refused = item.rejected = True
        return item

    # ---- settling publishes ----------------------------------------------------------------

    def _settle(self, tag: int, items: list[Item], error: BaseException | None) -> None:
        ok = error is None
        if ok:
            for item in items:
                if item.refused:
                    ok = False
                    break
        self._settled.append((tag, ok))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send the confirms of everything settled since the last flush, grouped."""
        self._flush_scheduled = False
        settled, self._settled = self._settled, []
        confirms = self.confirms
        if confirms is None or not self.open or not settled:
            return
        plan, confirms.settled_through = group_confirms(confirms.settled_through, settled)
        frames: list[bytes] = []
        for confirm in plan:
            cls = commands.Basic.Ack if confirm.ok else commands.Basic.Nack
            fields: dict[str, Any] = {"delivery_tag": confirm.tag, "multiple": confirm.multiple}
            if not confirm.ok:
                fields["requeue"] = False
            frames.append(
                framing.encode_method(self.channel.number, framing.build_method(cls, **fields))
            )
        if frames:  # one transport write for the whole flush
            self.channel.connection.send(b"".join(frames))

    def _unconfirmed(self, items: list[Item], error: BaseException | None) -> None:
        """A publish without confirms: a refused one is dropped as in RabbitMQ; one that was
        not committed must not vanish silently, so the connection is closed (541)."""
        if error is None or not self.open:
            return
        close = close_for(
            AMQPConnectionError(INTERNAL_ERROR, "a publish could not be stored", 60, 40)
        )
        # The connection's own way to send a close and drop the channels (connection.py).
        self.broker.spawn(self.connection._answer(close))
