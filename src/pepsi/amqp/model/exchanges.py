"""Exchanges and bindings: frozen values, and what RabbitMQ 3.x refuses on declare and bind.

Pure: exchanges and bindings are frozen values (the listener stores them in
PostgreSQL). The default exchange "" routes to the queue named by the routing
key; it cannot be declared, deleted, or bound to or from (403 ACCESS_REFUSED);
`amq.direct|fanout|topic|headers|match` exist in every vhost and cannot be
deleted. A topic binding's bounds are checked in `topics`, routing is `routing`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from pepsi.amqp.model.values import (
    argument_mismatch,
    describe_value,
    field_type,
    inequivalent,
    resource,
)
from pepsi.amqp.wire.replies import ACCESS_REFUSED, NOT_FOUND, PRECONDITION_FAILED, ChannelError

DIRECT: Final = "direct"
FANOUT: Final = "fanout"
TOPIC: Final = "topic"
HEADERS: Final = "headers"
EXCHANGE_TYPES: Final = (DIRECT, FANOUT, TOPIC, HEADERS)

QUEUE: Final = "queue"
EXCHANGE: Final = "exchange"

Destination = tuple[str, str]  # (QUEUE or EXCHANGE, name)

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
