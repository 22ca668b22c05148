"""Routing: the queues a publish goes to, with RabbitMQ 3.x's semantics (issue 16).

Pure: `RoutingTable` indexes one vhost's exchanges and bindings (`exchanges`)
once (a dict per direct exchange, a `topics.TopicMatcher` per topic exchange,
matchers per headers binding) and `RoutingTable.route` answers, per publish, the
set of queue names a message goes to. `route()` is the same for a single call.

Semantics kept from RabbitMQ 3.x:

- The default exchange "" routes to the queue named by the routing key. It
  cannot be declared, deleted, or bound to or from (403 ACCESS_REFUSED);
  `amq.direct|fanout|topic|headers|match` exist in every vhost and cannot
  be deleted.
- Topic keys are split on '.' into words ("" has no words, "a." has two);
  '*' matches exactly one word (an empty one too), '#' zero or more.
- Headers bindings: `x-match` all (the default) or any compare the binding's
  arguments not starting with 'x-'; all-with-x and any-with-x compare every
  argument but `x-match`. A void argument matches a header's presence;
  otherwise type and value must be equal (1 is not true, nor 1.0).
- Sender-selected distribution: string arrays in the `CC` and `BCC`
  headers are more routing keys for direct, topic and default exchanges
  (the listener must remove `BCC` before delivering).
- Exchange-to-exchange bindings are followed transitively, each exchange
  at most once (cycles end); a queue reached twice gets the message once.
  An exchange whose own bindings match nothing hands the message to its
  `alternate-exchange` argument, if it names an exchange.
- Publishing to an internal exchange: 403; to a missing one: 404.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from pepsi.amqp.model.exchanges import (
    DEFAULT_EXCHANGE,
    DIRECT,
    EXCHANGE,
    FANOUT,
    HEADERS,
    QUEUE,
    TOPIC,
    X_MATCH,
    Binding,
    Destination,
    Exchange,
    _exchange_text,
    predeclared,
)
from pepsi.amqp.model.topics import TopicMatcher
from pepsi.amqp.model.values import value_key
from pepsi.amqp.wire.replies import ACCESS_REFUSED, NOT_FOUND, ChannelError

_MISSING: Final = object()


@dataclass(frozen=True)
class _HeadersMatcher:
    any: bool
    # (header name, value key or None for "present")
    tests: tuple[tuple[str, object], ...]
    destination: Destination

    @classmethod
    def of(cls, binding: Binding, destination: Destination) -> _HeadersMatcher:
        mode = binding.arguments.get(X_MATCH)
        with_x = mode in ("all-with-x", "any-with-x")
        tests = tuple(
            (key, None if value is None else value_key(value))
            for key, value in binding.arguments.items()
            if key != X_MATCH and (with_x or not key.startswith("x-"))
        )
        # Anything but a valid "any…" mode means all, as in RabbitMQ.
        return cls(mode in ("any", "any-with-x"), tests, destination)

    def matches(self, headers: Mapping[str, object], keyed: dict[str, object]) -> bool:
        # `keyed` caches each header's value key for the other bindings of the message.
        for key, want in self.tests:
            if key not in headers:
                hit = False
            elif want is None:
                hit = True
            else:
                have = keyed.get(key, _MISSING)
                if have is _MISSING:
                    have = keyed[key] = value_key(headers[key])
                hit = have == want
            if hit is self.any:
                return hit  # any: the first hit decides; all: the first miss
        return not self.any


class _ExchangeIndex:
    __slots__ = ("alternate", "direct", "exchange", "fanout", "headers", "topic")

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.alternate = exchange.alternate_exchange
        self.direct: dict[str, list[Destination]] = {}
        self.fanout: list[Destination] = []
        self.topic = TopicMatcher()
        self.headers: list[_HeadersMatcher] = []

    def add(self, binding: Binding) -> None:
        destination = (binding.destination_kind, binding.destination)
        kind = self.exchange.type
        if kind == DIRECT:
            self.direct.setdefault(binding.routing_key, []).append(destination)
        elif kind == FANOUT:
            self.fanout.append(destination)
        elif kind == TOPIC:
            self.topic.add(binding.routing_key, destination)
        elif kind == HEADERS:
            self.headers.append(_HeadersMatcher.of(binding, destination))

    def match(self, keys: tuple[str, ...], headers: Mapping[str, object]) -> Sequence[Destination]:
        kind = self.exchange.type
        if kind == DIRECT:
            if len(keys) == 1:
                return self.direct.get(keys[0], ())
            return [d for key in keys for d in self.direct.get(key, ())]
        if kind == FANOUT:
            return self.fanout
        if kind == TOPIC:
            return [d for key in keys for d in self.topic.match(key)]
        keyed: dict[str, object] = {}  # header value keys, computed once per message
        return [m.destination for m in self.headers if m.matches(headers, keyed)]


def routing_keys(routing_key: str, headers: Mapping[str, object] | None) -> tuple[str, ...]:
    """The routing key and the CC and BCC keys of sender-selected distribution."""
    if not headers or ("CC" not in headers and "BCC" not in headers):
        return (routing_key,)
    keys = [routing_key]
    for name in ("CC", "BCC"):
        value = headers.get(name)
        if isinstance(value, list | tuple):
            for item in value:
                if isinstance(item, bytes):
                    item = item.decode("utf-8", "replace")  # noqa: PLW2901
                if isinstance(item, str) and item not in keys:
                    keys.append(item)
    return tuple(keys)


class RoutingTable:
    """One vhost's exchanges and bindings, indexed for routing each publish.

    Build it again when exchanges or bindings change; it is not mutated. The
    predeclared exchanges are added if `exchanges` lacks them. With `queues`
    given, routes to names not in it are dropped (the default exchange names
    queues by key without knowing whether they exist; so do bindings read
    while a queue is being deleted).
    """

    def __init__(
        self,
        exchanges: Iterable[Exchange],
        bindings: Iterable[Binding],
        *,
        vhost: str | None = None,
        queues: Collection[str] | None = None,
    ) -> None:
        given = list(exchanges)
        vhosts = {x.vhost for x in given} | ({vhost} if vhost is not None else set())
        if len(vhosts) > 1:
            raise ValueError(f"exchanges of several vhosts: {sorted(vhosts)}")
        self.vhost = vhosts.pop() if vhosts else "/"
        self._queues = frozenset(queues) if queues is not None else None
        self._index: dict[str, _ExchangeIndex] = {
            x.name: _ExchangeIndex(x) for x in predeclared(self.vhost)
        }
        for x in given:
            self._index[x.name] = _ExchangeIndex(x)
        for b in bindings:
            source = self._index.get(b.source_exchange)
            if source is not None and b.source_exchange != DEFAULT_EXCHANGE:
                source.add(b)

    def exchange(self, name: str) -> Exchange | None:
        """The exchange called `name`, if there is one."""
        index = self._index.get(name)
        return index.exchange if index is not None else None

    def check_publishable(self, exchange_name: str) -> None:
        """Raise the ChannelError a publish to `exchange_name` ends in, whatever its key:
        404 for a missing exchange, 403 for an internal one."""
        self._publishable(exchange_name)

    def _publishable(self, exchange_name: str) -> _ExchangeIndex:
        start = self._index.get(exchange_name)
        if start is None:
            raise ChannelError(NOT_FOUND, f"no {_exchange_text(exchange_name, self.vhost)}")
        if start.exchange.internal:
            raise ChannelError(
                ACCESS_REFUSED,
                f"cannot publish to internal {_exchange_text(exchange_name, self.vhost)}",
            )
        return start

    def route(
        self, exchange_name: str, routing_key: str, headers: Mapping[str, object] | None = None
    ) -> set[str]:
        """The queues a message published to `exchange_name` goes to (maybe none).

        Raises ChannelError 404 for a missing exchange, 403 for an internal one.
        """
        start = self._publishable(exchange_name)
        table: Mapping[str, object] = headers or {}
        keys = routing_keys(routing_key, table)
        if exchange_name == DEFAULT_EXCHANGE:
            return self._existing({key for key in keys if key})
        queues: set[str] = set()
        seen = {exchange_name}
        work = [start]
        while work:
            index = work.pop()
            destinations = index.match(keys, table)
            if not destinations and index.alternate is not None:
                destinations = ((EXCHANGE, index.alternate),)
            for kind, name in destinations:
                if kind == QUEUE:
                    queues.add(name)
                elif name not in seen and name != DEFAULT_EXCHANGE:
                    seen.add(name)
                    nxt = self._index.get(name)
                    if nxt is not None:
                        work.append(nxt)
        return self._existing(queues)

    def _existing(self, queues: set[str]) -> set[str]:
        return queues if self._queues is None else queues & self._queues


def route(
    exchanges: Iterable[Exchange],
    bindings: Iterable[Binding],
    exchange_name: str,
    routing_key: str,
    headers: Mapping[str, object] | None = None,
) -> set[str]:
    """The queues a message goes to: `RoutingTable(...).route(...)` for one publish."""
    return RoutingTable(exchanges, bindings).route(exchange_name, routing_key, headers)
