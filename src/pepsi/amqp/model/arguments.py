"""Queue declaration rules, as RabbitMQ 3.x applies them (issue 16).

Pure functions over the arguments table of `queue.declare` (a mapping of
Python values, as pamqp decodes a field table):

- `parse_queue_arguments` validates the table as RabbitMQ 3.13 does for the
  queue's type and returns a frozen `QueueArguments`, or raises a 406
  `ChannelError` whose text is RabbitMQ's
  ("invalid arg 'x-max-length' for queue 'q' in vhost '/': {value_negative,-1}").
- `check_queue_properties`: a quorum queue must be durable, not exclusive,
  not auto-delete.
- `check_queue_redeclare`: a second declare must match the first.
- `declare_queue_name` / `generate_queue_name` / `check_queue_name`: the
  name rules (255 bytes, the reserved `amq.` prefix, server-named queues).

The wire type of a value is not kept by pamqp's decoder, so where RabbitMQ's
text names a type (`{unacceptable_type,longstr}`, "of type 'signedint'") it
is inferred from the Python value the way pika encodes it (`field_type`).

Decisions where Pepsi differs from RabbitMQ (for docs/amqp.md):

- `x-queue-type = stream` is refused with 406 (not 540: a channel error lets
  the client go on with the connection): Pepsi has no streams.
- `x-max-length = 0` is refused with `{value_zero,0}`: a stage's MAX_LENGTH
  is at least 1, and mapping 0 to "no limit" would invert its meaning.
- `x-overflow = reject-publish-dlx` is accepted, as RabbitMQ's validation
  does. A quorum queue then behaves as `drop-head` (RabbitMQ 3.13 logs a
  warning and uses its default); a classic queue behaves as
  `reject-publish` (the publish is refused; the refused message is not
  dead-lettered). `QueueArguments.effective_overflow` says which.
- `x-delivery-limit` is validated (a non-negative integer; RabbitMQ 3.13
  checks it only when it uses it).
- Arguments RabbitMQ accepts but that change nothing in Pepsi
  (`x-max-priority`, `x-queue-mode`, `x-queue-version`, locators, group
  sizes, in-memory limits) are validated and listed in
  `QueueArguments.ignored`; unknown arguments are ignored as RabbitMQ does.
"""

from __future__ import annotations

import base64
import datetime as dt
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from types import MappingProxyType
from typing import Final

from pepsi.amqp.wire.replies import (
    ACCESS_REFUSED,
    PRECONDITION_FAILED,
    RESOURCE_LOCKED,
    ChannelError,
)

CLASSIC: Final = "classic"
QUORUM: Final = "quorum"
STREAM: Final = "stream"
QUEUE_TYPES: Final = (CLASSIC, QUORUM)  # the types Pepsi accepts
DEFAULT_QUEUE_TYPE: Final = CLASSIC  # RabbitMQ 3.x's default when none is given

DROP_HEAD: Final = "drop-head"
REJECT_PUBLISH: Final = "reject-publish"
REJECT_PUBLISH_DLX: Final = "reject-publish-dlx"
OVERFLOW_MODES: Final = (DROP_HEAD, REJECT_PUBLISH, REJECT_PUBLISH_DLX)
DEFAULT_OVERFLOW: Final = DROP_HEAD  # RabbitMQ's default (Pepsi's own is reject-publish)

DEAD_LETTER_STRATEGIES: Final = ("at-most-once", "at-least-once")
QUEUE_MODES: Final = ("default", "lazy")
LEADER_LOCATORS: Final = ("client-local", "balanced", "random", "least-leaders")

MAX_NAME_BYTES: Final = 255  # a shortstr
RESERVED_PREFIX: Final = "amq."
GENERATED_PREFIX: Final = "amq.gen-"
MAX_EXPIRY_MS: Final = 315_360_000_000  # ten years: RabbitMQ's bound on TTLs and expiries
MAX_PRIORITY: Final = 255

# The module names RabbitMQ prints in "of queue type ..." errors.
_TYPE_MODULES: Final = {
    CLASSIC: "rabbit_classic_queue",
    QUORUM: "rabbit_quorum_queue",
    STREAM: "rabbit_stream_queue",
}

# Which arguments each queue type takes (RabbitMQ 3.13's capabilities, plus
# the order it compares them in on redeclare).
CLASSIC_ARGUMENTS: Final = (
    "x-expires", "x-message-ttl", "x-dead-letter-exchange", "x-dead-letter-routing-key",
    "x-max-length", "x-max-length-bytes", "x-max-priority", "x-overflow", "x-queue-mode",
    "x-queue-version", "x-single-active-consumer", "x-queue-type", "x-queue-master-locator",
)  # fmt: skip
QUORUM_ARGUMENTS: Final = (
    "x-dead-letter-exchange", "x-dead-letter-routing-key", "x-dead-letter-strategy",
    "x-expires", "x-max-length", "x-max-length-bytes", "x-max-in-memory-length",
    "x-max-in-memory-bytes", "x-overflow", "x-single-active-consumer", "x-queue-type",
    "x-quorum-initial-group-size", "x-delivery-limit", "x-message-ttl",
    "x-queue-leader-locator",
)  # fmt: skip
STREAM_ARGUMENTS: Final = (
    "x-max-length-bytes", "x-queue-type", "x-max-age", "x-stream-max-segment-size-bytes",
    "x-initial-cluster-size", "x-queue-leader-locator",
)  # fmt: skip
_ARGUMENTS_BY_TYPE: Final = {CLASSIC: CLASSIC_ARGUMENTS, QUORUM: QUORUM_ARGUMENTS}
# An argument some type knows but this queue's type does not is an error;
# one no type knows is ignored.
_KNOWN_ARGUMENTS: Final = frozenset(CLASSIC_ARGUMENTS + QUORUM_ARGUMENTS + STREAM_ARGUMENTS)

# Accepted, validated, and without effect in Pepsi.
_NO_EFFECT: Final = frozenset(
    {"x-queue-mode", "x-queue-version", "x-queue-master-locator",
     "x-queue-leader-locator", "x-quorum-initial-group-size", "x-max-in-memory-length",
     "x-max-in-memory-bytes"}
)  # fmt: skip

_INT32: Final = 2**31


# -- values and how RabbitMQ prints them -----------------------------------------------


_FIELD_TYPES: Final[tuple[tuple[type | tuple[type, ...], str], ...]] = (
    (bool, "bool"),  # before int: a bool is an int to Python
    (float, "double"),
    (Decimal, "decimal"),
    (str, "longstr"),
    ((bytes, bytearray, memoryview), "binary"),
    (dt.datetime, "timestamp"),
    (Mapping, "table"),
    ((list, tuple), "array"),
)


def field_type(value: object) -> str:
    """The AMQP field type RabbitMQ would name for `value` (as pika encodes it)."""
    if value is None:
        return "void"
    if isinstance(value, int) and not isinstance(value, bool):
        return "signedint" if -_INT32 <= value < _INT32 else "long"
    for types, name in _FIELD_TYPES:
        if isinstance(value, types):
            return name
    return type(value).__name__


def _type_class(kind: str) -> str:
    # RabbitMQ compares integers of any width as one class.
    return "int" if kind in {"byte", "short", "signedint", "long"} else kind


def value_key(value: object) -> object:
    """A key equal for two values exactly when RabbitMQ holds them equivalent.

    Python's own equality says True == 1 == 1.0 and "a" != b"a"; RabbitMQ
    compares (type class, value), so a bool never equals an integer and an
    integer never equals a float.
    """
    kind = _type_class(field_type(value))
    if isinstance(value, str):
        return ("longstr", value.encode())
    if isinstance(value, bytes | bytearray | memoryview):
        return ("binary", bytes(value))
    if isinstance(value, Mapping):
        return (kind, tuple(sorted((str(k), value_key(v)) for k, v in value.items())))
    if isinstance(value, list | tuple):
        return (kind, tuple(value_key(v) for v in value))
    return (kind, value)


def _plain(value: object) -> str:
    # RabbitMQ's ~ts / ~tp rendering of a value, near enough for messages.
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "undefined"
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def describe_value(value: object, *, present: bool = True) -> str:
    """A table value as RabbitMQ's equivalence errors print it.

    "the value '10' of type 'signedint'", or "none" for a missing argument.
    """
    if not present:
        return "none"
    return f"the value '{_plain(value)}' of type '{field_type(value)}'"


def _erl_string(text: str) -> str:
    # How Erlang's ~p prints a printable string: in double quotes.
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def resource(kind: str, name: str, vhost: str) -> str:
    """RabbitMQ's name for a resource in messages: "queue 'q' in vhost '/'"."""
    return f"{kind} '{name}' in vhost '{vhost}'"


def inequivalent(key: str, what: str, received: str, current: str) -> str:
    """RabbitMQ's text for a redeclare that does not match (406)."""
    return f"inequivalent arg '{key}' for {what}: received {received} but current is {current}"


# -- the arguments ---------------------------------------------------------------------


@dataclass(frozen=True)
class QueueArguments:
    """A queue's validated `x-` arguments; None where the argument is absent.

    Times are milliseconds, as on the wire. `raw` keeps the table as given
    (for storage and redeclare checks); `ignored` names the recognised
    arguments that have no effect in Pepsi.
    """

    queue_type: str = DEFAULT_QUEUE_TYPE
    max_length: int | None = None
    max_length_bytes: int | None = None
    overflow: str = DEFAULT_OVERFLOW
    message_ttl: int | None = None
    expires: int | None = None
    dead_letter_exchange: str | None = None
    dead_letter_routing_key: str | None = None
    dead_letter_strategy: str | None = None
    delivery_limit: int | None = None
    max_priority: int | None = None  # x-max-priority: messages' priority counts, up to it
    single_active_consumer: bool = False
    ignored: tuple[str, ...] = ()
    raw: Mapping[str, object] = field(
        default_factory=lambda: MappingProxyType({}), hash=False, compare=False
    )

    @property
    def effective_overflow(self) -> str:
        """The overflow behaviour Pepsi applies: drop-head or reject-publish."""
        if self.overflow == REJECT_PUBLISH_DLX:
            return DROP_HEAD if self.queue_type == QUORUM else REJECT_PUBLISH
        return self.overflow


class _Invalid(Exception):
    """An argument's value is refused; `detail` is RabbitMQ's Erlang term, printed."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(detail)


def _integer(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _Invalid(_erl_string(f"expected integer, got {field_type(value)}"))


def _non_negative(value: object) -> int:
    number = _integer(value)
    if number < 0:
        raise _Invalid(f"{{value_negative,{number}}}")
    return number


def _positive(value: object) -> int:
    number = _non_negative(value)
    if number == 0:
        raise _Invalid("{value_zero,0}")
    return number


def _expiry(value: object, *, zero_allowed: bool) -> int:
    number = _integer(value)
    if number == 0 and not zero_allowed:
        raise _Invalid("{value_zero,0}")
    if number < 0:
        raise _Invalid(f"{{value_negative,{number}}}")
    if number > MAX_EXPIRY_MS:
        raise _Invalid(f"{{value_too_large,{number}}}")
    return number


def _string(value: object) -> str:
    if isinstance(value, str):
        return value
    raise _Invalid(f"{{unacceptable_type,{field_type(value)}}}")


def _choice(value: object, choices: tuple[str, ...], invalid: str) -> str:
    text = _string(value)
    if text not in choices:
        raise _Invalid(invalid)
    return text


def _boolean(value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise _Invalid(f"{{unacceptable_type,{field_type(value)}}}")


def _queue_version(value: object) -> int:
    number = _non_negative(value)
    if number not in (1, 2):
        raise _Invalid(_erl_string(f"unsupported queue version '{number}'"))
    return number


def _queue_mode(value: object) -> str:
    text = _string(value)
    if text not in QUEUE_MODES:
        raise _Invalid(_erl_string(f"unsupported queue mode '{text}'"))
    return text


def _max_priority(value: object) -> int:
    number = _non_negative(value)
    if number > MAX_PRIORITY:
        raise _Invalid(f"{{max_value_exceeded,{number}}}")
    return number


def _requested_type(arguments: Mapping[str, object]) -> object:
    # A missing type, or the string "undefined", means the default.
    value = arguments.get("x-queue-type")
    return DEFAULT_QUEUE_TYPE if value is None or value == "undefined" else value


def _queue_type(value: object) -> str:
    text = _string(value)
    if text == STREAM:
        raise _Invalid(
            _erl_string("unsupported queue type 'stream': Pepsi has classic and quorum queues")
        )
    if text not in QUEUE_TYPES:
        raise _Invalid(_erl_string(f"unsupported queue type '{text}'"))
    return text


_Check = Callable[[object], object]

# RabbitMQ's order of checks, so that the first error reported is its first.
_CHECKS: Final[tuple[tuple[str, _Check], ...]] = (
    ("x-expires", lambda v: _expiry(v, zero_allowed=False)),
    ("x-message-ttl", lambda v: _expiry(v, zero_allowed=True)),
    ("x-dead-letter-exchange", _string),
    ("x-dead-letter-routing-key", _string),  # and a DLX must be set: below
    ("x-dead-letter-strategy",
     lambda v: _choice(v, DEAD_LETTER_STRATEGIES, "invalid_dlx_strategy")),
    ("x-max-length", _positive),  # Pepsi: at least 1 (RabbitMQ allows 0)
    ("x-max-length-bytes", _non_negative),
    ("x-max-in-memory-length", _non_negative),
    ("x-max-in-memory-bytes", _non_negative),
    ("x-max-priority", _max_priority),
    ("x-overflow", lambda v: _choice(v, OVERFLOW_MODES, "invalid_overflow")),
    ("x-queue-mode", _queue_mode),
    ("x-queue-version", _queue_version),
    ("x-single-active-consumer", _boolean),
    ("x-quorum-initial-group-size", _positive),
    ("x-delivery-limit", _non_negative),
    ("x-queue-leader-locator",
     lambda v: _choice(v, LEADER_LOCATORS, "invalid_queue_locator_arg")),
)  # fmt: skip


def parse_queue_arguments(
    arguments: Mapping[str, object] | None, *, queue: str, vhost: str = "/"
) -> QueueArguments:
    """Validate `queue.declare` arguments; raise ChannelError(406) as RabbitMQ would."""
    table: Mapping[str, object] = arguments or {}
    what = resource("queue", queue, vhost)

    def refuse(key: str, detail: str) -> ChannelError:
        return ChannelError(PRECONDITION_FAILED, f"invalid arg '{key}' for {what}: {detail}")

    # RabbitMQ's channel checks the DLX's type before the queue's own validation.
    dlx = table.get("x-dead-letter-exchange", "")
    if not isinstance(dlx, str):
        raise ChannelError(
            PRECONDITION_FAILED,
            f"invalid type '{field_type(dlx)}' for arg 'x-dead-letter-exchange' in {what}",
        )
    try:
        queue_type = _queue_type(_requested_type(table))
    except _Invalid as invalid:
        raise refuse("x-queue-type", invalid.detail) from None
    allowed = _ARGUMENTS_BY_TYPE[queue_type]
    values: dict[str, object] = {}
    for key, check in _CHECKS:
        if key in table and key in allowed:
            try:
                values[key] = check(table[key])
            except _Invalid as invalid:
                raise refuse(key, invalid.detail) from None
            if key == "x-dead-letter-routing-key" and "x-dead-letter-exchange" not in table:
                raise refuse(key, "routing_key_but_no_dlx_defined")
    for key in table:
        if key in _KNOWN_ARGUMENTS and key not in allowed:
            raise ChannelError(
                PRECONDITION_FAILED,
                f"invalid arg '{key}' for {what} of queue type {_TYPE_MODULES[queue_type]}",
            )

    def get(key: str) -> object:
        return values.get(key)

    return QueueArguments(
        queue_type=queue_type,
        max_length=_opt_int(get("x-max-length")),
        max_length_bytes=_opt_int(get("x-max-length-bytes")),
        overflow=str(values.get("x-overflow", DEFAULT_OVERFLOW)),
        message_ttl=_opt_int(get("x-message-ttl")),
        expires=_opt_int(get("x-expires")),
        dead_letter_exchange=_opt_str(get("x-dead-letter-exchange")),
        dead_letter_routing_key=_opt_str(get("x-dead-letter-routing-key")),
        dead_letter_strategy=_opt_str(get("x-dead-letter-strategy")),
        delivery_limit=_opt_int(get("x-delivery-limit")),
        max_priority=_opt_int(get("x-max-priority")),
        single_active_consumer=bool(values.get("x-single-active-consumer", False)),
        ignored=tuple(key for key in table if key in values and key in _NO_EFFECT),
        raw=MappingProxyType(dict(table)),
    )


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) else None


def _opt_str(value: object) -> str | None:
    return value if isinstance(value, str) else None


# -- properties and redeclaration ------------------------------------------------------


@dataclass(frozen=True)
class QueueDeclaration:
    """What a `queue.declare` asked for (or what the existing queue was declared with)."""

    name: str
    vhost: str = "/"
    durable: bool = True
    exclusive: bool = False
    auto_delete: bool = False
    arguments: Mapping[str, object] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", MappingProxyType(dict(self.arguments)))


def check_queue_properties(declaration: QueueDeclaration, queue_type: str) -> None:
    """A quorum queue must be durable, shared and kept: raise 406 as RabbitMQ does."""
    if queue_type != QUORUM:
        return
    what = resource("queue", declaration.name, declaration.vhost)
    # RabbitMQ's order: auto-delete, exclusive, then durability.
    for wrong, prop in (
        (declaration.auto_delete, "auto-delete"),
        (declaration.exclusive, "exclusive-owner"),
        (not declaration.durable or declaration.exclusive, "non-durable"),
    ):
        if wrong:
            raise ChannelError(PRECONDITION_FAILED, f"invalid property '{prop}' for {what}")


def _with_default_type(arguments: Mapping[str, object]) -> dict[str, object]:
    # RabbitMQ 3.13 writes the default type into a declare that names none.
    table = dict(arguments)
    table["x-queue-type"] = _requested_type(arguments)
    return table


def check_queue_redeclare(
    existing: QueueDeclaration, requested: QueueDeclaration, *, same_connection: bool = True
) -> ChannelError | None:
    """None when `requested` may redeclare `existing`, else the error to close the channel with.

    Exclusivity first (405 RESOURCE_LOCKED, as RabbitMQ: an exclusive queue
    belongs to the connection that declared it), then durable, auto_delete
    and the arguments of the existing queue's type (406). A durable flag on
    an exclusive declare counts as false, as in RabbitMQ. Arguments no queue
    type knows are not compared.
    """
    what = resource("queue", existing.name, existing.vhost)
    owner_matches = existing.exclusive == requested.exclusive and (
        not existing.exclusive or same_connection
    )
    if not owner_matches:
        return ChannelError(
            RESOURCE_LOCKED,
            f"cannot obtain exclusive access to locked {what}. It could be originally "
            "declared on another connection or the exclusive property value does not "
            "match that of the original declaration.",
        )
    durable = requested.durable and not requested.exclusive
    current_durable = existing.durable and not existing.exclusive
    for key, current, received in (
        ("durable", current_durable, durable),
        ("auto_delete", existing.auto_delete, requested.auto_delete),
    ):
        if current != received:
            return ChannelError(
                PRECONDITION_FAILED,
                inequivalent(key, what, f"'{_plain(received)}'", f"'{_plain(current)}'"),
            )
    old = _with_default_type(existing.arguments)
    new = _with_default_type(requested.arguments)
    old_type = old["x-queue-type"]
    for key in _ARGUMENTS_BY_TYPE.get(old_type if isinstance(old_type, str) else "", ()):
        if (error := argument_mismatch(key, what, old, new)) is not None:
            return error
    return None


def argument_mismatch(
    key: str, what: str, old: Mapping[str, object], new: Mapping[str, object]
) -> ChannelError | None:
    """406 if a redeclare's argument `key` differs from the declared one (present or not)."""
    if (key in old) == (key in new) and (
        key not in old or value_key(old[key]) == value_key(new[key])
    ):
        return None
    return ChannelError(
        PRECONDITION_FAILED,
        inequivalent(
            key,
            what,
            describe_value(new.get(key), present=key in new),
            describe_value(old.get(key), present=key in old),
        ),
    )


# -- names -----------------------------------------------------------------------------


def generate_queue_name(randbytes: Callable[[int], bytes] = secrets.token_bytes) -> str:
    """A server-named queue: 'amq.gen-' and 22 URL-safe characters (128 random bits)."""
    return GENERATED_PREFIX + base64.urlsafe_b64encode(randbytes(16)).rstrip(b"=").decode()


def check_queue_name(name: str, vhost: str = "/") -> None:
    """Raise 406 if `name` cannot be a queue name: more than 255 bytes of UTF-8."""
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        raise ChannelError(
            PRECONDITION_FAILED,
            f"queue name '{name[:64]}...' in vhost '{vhost}' is too long: "
            f"{size} bytes, at most {MAX_NAME_BYTES}",
        )


def declare_queue_name(
    name: str,
    arguments: Mapping[str, object] | None = None,
    *,
    passive: bool = False,
    vhost: str = "/",
    randbytes: Callable[[int], bytes] = secrets.token_bytes,
) -> str:
    """The name a `queue.declare` acts on, or the ChannelError RabbitMQ would raise.

    CR and LF are removed, as RabbitMQ does. An empty name makes a
    server-named queue ('amq.gen-…'), which RabbitMQ refuses for quorum
    queues (406). A non-passive declare of a name starting with 'amq.' is
    refused with 403, even when the queue exists (a server-named queue is
    redeclared passively, or not at all).
    """
    name = name.replace("\r", "").replace("\n", "")
    check_queue_name(name, vhost)
    if not name:
        if passive:
            return name  # the caller answers 404 or uses the last declared queue
        queue_type = _requested_type(arguments or {})
        if queue_type in (QUORUM, STREAM):
            raise ChannelError(
                PRECONDITION_FAILED,
                f"Cannot declare a server-named queue for type {_TYPE_MODULES[str(queue_type)]}",
            )
        return generate_queue_name(randbytes)
    if not passive and name.startswith(RESERVED_PREFIX):
        raise ChannelError(ACCESS_REFUSED, f"queue name '{name}' contains reserved prefix 'amq.*'")
    return name
