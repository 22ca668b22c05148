"""A channel's basic.publish: checked, routed, made rows and handed to the batcher.

`PublishingChannel` is the publishing half of `broker.BrokerChannel`. Every
publish goes through here, so this is the hot path: a publish repeated with
another body reuses the last one's rows, and routes, property lists and routing
JSON are cached per channel. An AMQP queue is a stage (`amqp_queue.stage`,
'amqp:VHOST:QUEUE'); a publish writes one row per destination queue with the
content header's property octets as received in `workqueue_body.header` and the
body in `workqueue_body.body`. `publish_now` handles a publish without awaiting
anything when it can; confirms and transactions are `modes.PublishModes`.
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

from pamqp import base, commands

from pepsi.amqp.auth.permissions import Access
from pepsi.amqp.broker.catalogue import Catalogue, VhostView
from pepsi.amqp.broker.publish import modes
from pepsi.amqp.broker.publish.columns import column_peer, column_text, routing_json
from pepsi.amqp.broker.publish.properties import Properties, parse_expiration, read_properties
from pepsi.amqp.broker.publish.units import Item, Unit
from pepsi.amqp.broker.ttl import ttl_expires
from pepsi.amqp.model.exchanges import EXCHANGE
from pepsi.amqp.session.handler import Channel
from pepsi.amqp.wire import methods, replies
from pepsi.amqp.wire.frames import Content
from pepsi.amqp.wire.replies import (
    NOT_IMPLEMENTED,
    PRECONDITION_FAILED,
    AMQPConnectionError,
    AMQPError,
    ChannelError,
)
from pepsi.publishing.message import Row

if TYPE_CHECKING:
    from pepsi.amqp.broker.consume.delivery import Deliverer
    from pepsi.amqp.broker.expiry import Expiry

ROUTING_CACHE: Final = 1024  # (exchange, routing key) JSON texts kept per channel
PROPERTIES_CACHE: Final = 64  # parsed property lists kept per channel ...
PROPERTIES_CACHE_OCTETS: Final = 512  # ... each at most this long
_PUBLISH_CLASS, _PUBLISH_METHOD = (
    commands.Basic.Publish.index >> 16,
    commands.Basic.Publish.index & 0xFFFF,
)
# x-message-ttl = 0: with a consumer ready at publish, the message has this long to reach
# it (the commit, the claim and the send take milliseconds); else it expires at once
ZERO_TTL_DELIVERY_MS = 1000


class Broker(modes.Broker, Protocol):
    """What a publishing channel needs of the broker (`broker.Broker`, whose channels
    these are: this module does not import it back)."""

    expiry: Expiry
    deliverer: Deliverer


class Route(NamedTuple):
    """Where a publish goes: its queues (sorted), and their stages when every one of them
    takes a plain row (no length or byte limit, no message TTL); else None."""

    queues: list[str]
    plain: tuple[str, ...] | None


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


def _as_publish_error(error: AMQPError) -> None:
    """An error of a publish is answered as basic.publish's (its class and method ids)."""
    if not error.class_id:
        error.class_id, error.method_id = _PUBLISH_CLASS, _PUBLISH_METHOD


class PublishingChannel(modes.PublishModes):
    """basic.publish; mixed into BrokerChannel, which provides the helpers."""

    broker: Broker
    catalogue: Catalogue
    vhost: str
    user: str
    published: set[str]  # ConsumingChannel's: stages published to since the channel last waited

    def __init__(self, channel: Channel) -> None:
        super().__init__(channel)
        self.peer = column_peer(channel.connection.peer)
        self._writable: set[str] = set()  # exchanges this user may publish to
        self._routing: dict[tuple[str, str], str] = {}  # routing_json, per key
        self._props_cache: dict[bytes, Properties] = {}  # read_properties, per raw octets
        self._route_view: VhostView | None = None  # the view _route_cache was made from
        self._route_cache: dict[tuple[str, str], Route] = {}  # per (exchange, key)
        # The last publish's rows without their body, and what they were made from (the
        # view, exchange, routing key and property octets): see `_route`.
        self._last_rows: tuple[VhostView, str, str, bytes, tuple[tuple[Any, ...], ...]] | None
        self._last_rows = None

    def permissions_changed(self) -> None:
        """The user's patterns changed (`pepsi amqp permissions set`): check them afresh."""
        self._writable.clear()

    # provided by BrokerChannel
    def _require(self, access: Access, kind: str, name: str) -> None:
        raise NotImplementedError

    # ---- publishing ----------------------------------------------------------------------

    def _return(self, content: Content) -> None:
        method = content.method
        assert isinstance(method, commands.Basic.Publish)
        if not self.open:
            return
        self.channel.send_content(
            methods.build_method(
                commands.Basic.Return,
                reply_code=replies.NO_ROUTE,
                reply_text="NO_ROUTE",
                exchange=method.exchange,
                routing_key=method.routing_key,
            ),
            content.raw_properties,
            content.body,
        )

    async def basic_publish(self, content: Content) -> None:
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
            self._submitted(unit)

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

    def publish_now(self, content: Content) -> bool:
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
            self._submitted(unit)
        return True

    def _submitted(self, unit: Unit) -> None:
        """The stages of a unit now in the batcher (`counted_in_order` waits for them)."""
        for item in unit.items:
            for row in item.rows:
                self.published.add(row.stage)

    def _may_publish(self, method: commands.Basic.Publish) -> None:
        if method.immediate:
            raise AMQPConnectionError(NOT_IMPLEMENTED, "immediate=true")
        exchange = str(method.exchange)
        if exchange not in self._writable:
            self._require(Access.WRITE, EXCHANGE, exchange)
            self._writable.add(exchange)  # the connection's permission does not change

    def _publish_unit(
        self, content: Content, method: commands.Basic.Publish, view: VhostView
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

    def _route(self, content: Content, method: commands.Basic.Publish, view: VhostView) -> Item:
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
        self, content: Content, view: VhostView
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
        content: Content,
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
