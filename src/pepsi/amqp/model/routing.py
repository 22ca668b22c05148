"""Exchanges, bindings and routing, with RabbitMQ 3.x's semantics (issue 16).

Pure: exchanges and bindings are frozen values (the listener stores them in
PostgreSQL); `RoutingTable` indexes one vhost's exchanges and bindings once
(a dict per direct exchange, a word trie per topic exchange, matchers per
headers binding) and `RoutingTable.route` answers, per publish, the set of
queue names a message goes to. `route()` is the same for a single call.

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
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from pepsi.amqp.model.arguments import (
    argument_mismatch,
    describe_value,
    field_type,
    inequivalent,
    resource,
    value_key,
)
from pepsi.amqp.wire.replies import ACCESS_REFUSED, NOT_FOUND, PRECONDITION_FAILED, ChannelError

DIRECT: Final = "direct"
FANOUT: Final = "fanout"
TOPIC: Final = "topic"
HEADERS: Final = "headers"
EXCHANGE_TYPES: Final = (DIRECT, FANOUT, TOPIC, HEADERS)

QUEUE: Final = "queue"
EXCHANGE: Final = "exchange"

DEFAULT_EXCHANGE: Final = ""
RESERVED_PREFIX: Final = "amq."
ALTERNATE_EXCHANGE: Final = "alternate-exchange"

X_MATCH: Final = "x-match"
MATCH_MODES: Final = ("all", "any", "all-with-x", "any-with-x")

_PREDECLARED: Final = (
    (DEFAULT_EXCHANGE, DIRECT),
    ("amq.direct", DIRECT),
    ("amq.fanout", FANOUT),
    ("amq.topic", TOPIC),
    ("amq.headers", HEADERS),
    ("amq.match", HEADERS),
)


def _frozen(table: Mapping[str, object] | None) -> Mapping[str, object]:
    return MappingProxyType(dict(table or {}))


@dataclass(frozen=True)
class Exchange:
    """An exchange as declared; `arguments` is frozen on construction."""

    vhost: str
    name: str
    type: str = DIRECT
    durable: bool = True
    auto_delete: bool = False
    internal: bool = False
    arguments: Mapping[str, object] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", _frozen(self.arguments))

    @property
    def alternate_exchange(self) -> str | None:
        """The exchange that takes what this one cannot route, if any."""
        value = self.arguments.get(ALTERNATE_EXCHANGE)
        return value if isinstance(value, str) else None


@dataclass(frozen=True)
class Binding:
    """A binding of one vhost: from an exchange to a queue or to another exchange."""

    source_exchange: str
    destination: str
    destination_kind: str = QUEUE  # QUEUE or EXCHANGE
    routing_key: str = ""
    arguments: Mapping[str, object] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.destination_kind not in (QUEUE, EXCHANGE):
            raise ValueError(
                f"destination_kind must be queue or exchange, not {self.destination_kind!r}"
            )
        object.__setattr__(self, "arguments", _frozen(self.arguments))


def predeclared(vhost: str) -> tuple[Exchange, ...]:
    """The exchanges every vhost has: the default one and the five `amq.` ones."""
    return tuple(Exchange(vhost, name, kind) for name, kind in _PREDECLARED)


# -- declare, delete, bind -------------------------------------------------------------


def _exchange_text(name: str, vhost: str) -> str:
    return resource("exchange", name, vhost)


def _default_refused() -> ChannelError:
    return ChannelError(ACCESS_REFUSED, "operation not permitted on the default exchange")


def check_exchange_type(type_name: str) -> str:
    """`type_name` if Pepsi has that exchange type; else 406.

    RabbitMQ 3.13.7 and 4.x answer 406 PRECONDITION_FAILED; before 3.13.7 it
    was the connection error 503 COMMAND_INVALID, which cost the client its
    connection for a typo.
    """
    if type_name not in EXCHANGE_TYPES:
        raise ChannelError(PRECONDITION_FAILED, f"unknown exchange type '{type_name}'")
    return type_name


def check_redeclare(existing: Exchange, requested: Exchange) -> ChannelError | None:
    """None when `requested` matches `existing`, else the 406 to close the channel with.

    Compared as RabbitMQ does: type, durable, auto_delete, internal, then
    the one argument with a meaning (`alternate-exchange`).
    """
    what = _exchange_text(existing.name, existing.vhost)
    for key, current, received in (
        ("type", existing.type, requested.type),
        ("durable", existing.durable, requested.durable),
        ("auto_delete", existing.auto_delete, requested.auto_delete),
        ("internal", existing.internal, requested.internal),
    ):
        if current != received:
            return ChannelError(
                PRECONDITION_FAILED,
                inequivalent(key, what, f"'{_word(received)}'", f"'{_word(current)}'"),
            )
    return argument_mismatch(ALTERNATE_EXCHANGE, what, existing.arguments, requested.arguments)


def _word(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def check_exchange_declare(
    requested: Exchange, existing: Exchange | None, *, passive: bool = False
) -> None:
    """Raise the ChannelError RabbitMQ answers `exchange.declare` with, if any.

    In RabbitMQ's order: the type (not for a passive declare), the default
    exchange (403), a missing exchange on a passive declare (404), the
    reserved prefix on creation only (403), an `alternate-exchange` that is
    not a string (406), a redeclare that does not match (406).
    """
    vhost, name = requested.vhost, requested.name
    if not passive:
        check_exchange_type(requested.type)
    if name == DEFAULT_EXCHANGE:
        raise _default_refused()
    if passive:
        if existing is None:
            raise ChannelError(NOT_FOUND, f"no {_exchange_text(name, vhost)}")
        return
    if existing is None:
        if name.startswith(RESERVED_PREFIX):
            raise ChannelError(
                ACCESS_REFUSED, f"exchange name '{name}' contains reserved prefix 'amq.*'"
            )
        if ALTERNATE_EXCHANGE in requested.arguments and requested.alternate_exchange is None:
            raise ChannelError(
                PRECONDITION_FAILED,
                f"invalid type '{field_type(requested.arguments[ALTERNATE_EXCHANGE])}' "
                f"for arg '{ALTERNATE_EXCHANGE}' in {_exchange_text(name, vhost)}",
            )
        return
    error = check_redeclare(existing, requested)
    if error is not None:
        raise error


def check_exchange_delete(vhost: str, name: str) -> None:
    """Raise 403 for the exchanges that cannot be deleted: "" and every `amq.` one."""
    if name == DEFAULT_EXCHANGE:
        raise _default_refused()
    if name.startswith(RESERVED_PREFIX):
        raise ChannelError(
            ACCESS_REFUSED, f"deletion of system {_exchange_text(name, vhost)} not allowed"
        )


def _erl_binary(text: str) -> str:
    # Erlang's ~p of a binary: <<"any">>.
    return '<<"' + text.replace("\\", "\\\\").replace('"', '\\"') + '">>'


def check_new_binding(binding: Binding, source: Exchange, bound: Iterable[Binding] = ()) -> None:
    """What a new binding must also be (406). A topic binding key has at most
    MAX_TOPIC_WORDS words, and a topic exchange's distinct keys (`bound`: its bindings
    now) at most MAX_TOPIC_EXCHANGE_WORDS in all: each word is matching work for
    every publish to that exchange."""
    if source.type != TOPIC:
        return
    words = len(topic_pattern(binding.routing_key))
    if words > MAX_TOPIC_WORDS:
        raise ChannelError(
            PRECONDITION_FAILED,
            f"topic binding key of {words} words: at most {MAX_TOPIC_WORDS} "
            "(a run of '#' counts as one)",
        )
    patterns = {topic_pattern(b.routing_key) for b in bound if b.source_exchange == source.name}
    patterns.add(topic_pattern(binding.routing_key))
    total = sum(len(p) + 1 for p in patterns)
    if total > MAX_TOPIC_EXCHANGE_WORDS:
        raise ChannelError(
            PRECONDITION_FAILED,
            f"{_exchange_text(source.name, source.vhost)} would hold {total} words of "
            f"distinct topic binding keys: at most {MAX_TOPIC_EXCHANGE_WORDS}",
        )


def check_binding(binding: Binding, source: Exchange | None = None) -> None:
    """Raise the ChannelError RabbitMQ answers a bind or unbind with, if any.

    The default exchange can be neither source nor destination (403). With
    the source exchange given, a headers binding's `x-match` must be one of
    all, any, all-with-x, any-with-x (406). Whether the source and the
    destination exist (404) is the caller's to check.
    """
    if binding.source_exchange == DEFAULT_EXCHANGE or (
        binding.destination_kind == EXCHANGE and binding.destination == DEFAULT_EXCHANGE
    ):
        raise _default_refused()
    if source is None or source.type != HEADERS or X_MATCH not in binding.arguments:
        return
    mode = binding.arguments[X_MATCH]
    if isinstance(mode, str):
        if mode not in MATCH_MODES:
            raise ChannelError(
                PRECONDITION_FAILED,
                f"Invalid x-match field value {_erl_binary(mode)}; "
                "expected all, any, all-with-x, or any-with-x",
            )
        return
    raise ChannelError(
        PRECONDITION_FAILED,
        f"Invalid x-match field type {field_type(mode)} (value {describe_value(mode)}); "
        "expected longstr",
    )


# -- matching --------------------------------------------------------------------------

Destination = tuple[str, str]  # (QUEUE or EXCHANGE, name)
_MISSING: Final = object()


MAX_TOPIC_WORDS = 32  # words of a topic binding key: its matching cost per publish is bounded
# Words (plus one per key) of an exchange's distinct topic binding keys: 2 000 keys of
# 32 words, or 16 000 like "user.N.#"; a 127-word publish then costs 5 ms at worst.
MAX_TOPIC_EXCHANGE_WORDS = 65_536


def topic_words(key: str) -> tuple[str, ...]:
    """A routing or binding key as topic words: "" has none, "a..b" has three."""
    return tuple(key.split(".")) if key else ()


def topic_pattern(key: str) -> tuple[str, ...]:
    """A binding key's words with each run of '#' made one: '#.#' matches what '#' does."""
    words: list[str] = []
    for word in topic_words(key):
        if word == "#" and words and words[-1] == "#":
            continue
        words.append(word)
    return tuple(words)


def _mask(bits: list[int]) -> int:
    """An integer with the given bits set."""
    if not bits:
        return 0
    raw = bytearray(bits[-1] // 8 + 1)
    for bit in bits:
        raw[bit >> 3] |= 1 << (bit & 7)
    return int.from_bytes(raw, "little")


@dataclass(frozen=True)
class _TopicBits:
    """An exchange's binding keys laid end to end as bits, one per word plus a start bit."""

    starts: int  # each pattern's first bit: matched no word yet
    ends: int  # each pattern's last bit: matched all its words
    wild: int  # '*' and '#' words: take any word
    hashes: int  # '#' words: may take no word, or more than one
    literal: Mapping[str, int]  # the bits of each literal word
    destinations: Mapping[int, list[Destination]]  # by end bit


class TopicMatcher:
    """An exchange's topic bindings, matched bit-parallel (Shift-And over all keys at once).

    Bit i of the state is "the key's words so far match pattern word i". Each routing
    key word costs a few big-integer operations over all the patterns' words together,
    so a publish costs O(words x bound words / 64): linear in the words, however many
    '#' or bindings. (A backtracking match took 156 ms for 128 '#' against 127 words,
    and a trie walk 80 ms for 100 bindings of 32 wildcards: both on the loop.)
    """

    def __init__(self) -> None:
        self._patterns: dict[tuple[str, ...], list[Destination]] = {}
        self._bits: _TopicBits | None = None

    def add(self, pattern: str, destination: Destination) -> None:
        self._patterns.setdefault(topic_pattern(pattern), []).append(destination)
        self._bits = None

    def _compile(self) -> _TopicBits:
        # Positions first, then each mask made at once: or-ing bit by bit into a
        # growing integer would cost the square of the words.
        starts: list[int] = []
        ends: list[int] = []
        wild: list[int] = []
        hashes: list[int] = []
        literal: dict[str, list[int]] = {}
        destinations: dict[int, list[Destination]] = {}
        bit = 0
        for words, targets in self._patterns.items():
            starts.append(bit)
            for word in words:
                bit += 1
                if word == "#":
                    hashes.append(bit)
                    wild.append(bit)
                elif word == "*":
                    wild.append(bit)
                else:
                    literal.setdefault(word, []).append(bit)
            ends.append(bit)
            destinations[bit] = targets
            bit += 1  # the next start bit: never in a mask, so nothing shifts into it
        self._bits = _TopicBits(
            _mask(starts),
            _mask(ends),
            _mask(wild),
            _mask(hashes),
            {word: _mask(at) for word, at in literal.items()},
            destinations,
        )
        return self._bits

    def match(self, key: str) -> list[Destination]:
        bits = self._bits or self._compile()
        hashes = bits.hashes
        state = bits.starts
        state |= (state << 1) & hashes  # a '#' may take no word (runs are collapsed)
        for word in topic_words(key):
            shifted = state << 1
            state = (shifted & bits.wild) | (state & hashes)  # a '#' takes one more
            mask = bits.literal.get(word)
            if mask is not None:
                state |= shifted & mask
            if not state:
                return []
            state |= (state << 1) & hashes
        found: list[Destination] = []
        hits = state & bits.ends
        while hits:
            low = hits & -hits
            found.extend(bits.destinations[low.bit_length() - 1])
            hits ^= low
        return found


def topic_matches(pattern: str, key: str) -> bool:
    """Whether the binding key `pattern` matches the routing key `key`."""
    matcher = TopicMatcher()
    matcher.add(pattern, (QUEUE, ""))
    return bool(matcher.match(key))


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
