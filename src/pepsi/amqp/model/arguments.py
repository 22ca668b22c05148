"""Queue arguments: the x-arguments of `queue.declare`, as RabbitMQ 3.x validates them (issue 16).

Pure functions over the arguments table of `queue.declare` (a mapping of
Python values, as pamqp decodes a field table): `parse_queue_arguments`
validates the table as RabbitMQ 3.13 does for the queue's type and returns a
frozen `QueueArguments`, or raises a 406 `ChannelError` whose text is RabbitMQ's
("invalid arg 'x-max-length' for queue 'q' in vhost '/': {value_negative,-1}").
The rest of a declare (properties, redeclaration, names) is in `queues`.

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

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from pepsi.amqp.model.values import field_type, resource
from pepsi.amqp.wire.replies import PRECONDITION_FAILED, ChannelError

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


# -- the arguments ---------------------------------------------------------------------


def _erl_string(text: str) -> str:
    # How Erlang's ~p prints a printable string: in double quotes.
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


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
