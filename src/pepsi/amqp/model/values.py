"""Field-table values as RabbitMQ names, compares and prints them (pure).

The wire type of a value is not kept by pamqp's decoder, so where RabbitMQ's
text names a type (`{unacceptable_type,longstr}`, "of type 'signedint'") it
is inferred from the Python value the way pika encodes it (`field_type`).
`value_key` is RabbitMQ's equivalence (redeclares, headers bindings); the
texts are those of its 406s on queue and exchange declares.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from decimal import Decimal
from typing import Final

from pepsi.amqp.wire.replies import PRECONDITION_FAILED, ChannelError

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


def resource(kind: str, name: str, vhost: str) -> str:
    """RabbitMQ's name for a resource in messages: "queue 'q' in vhost '/'"."""
    return f"{kind} '{name}' in vhost '{vhost}'"


def inequivalent(key: str, what: str, received: str, current: str) -> str:
    """RabbitMQ's text for a redeclare that does not match (406)."""
    return f"inequivalent arg '{key}' for {what}: received {received} but current is {current}"


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
