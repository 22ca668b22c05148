"""What the broker reads of a publish's content header: `Properties`, and its expiration.

`read_properties` reads the few fields the broker uses from the property octets as
received (they are stored as they are), without decoding the headers table unless
routing needs it; `parse_expiration` checks the `expiration` property as RabbitMQ does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from pepsi.amqp.model.arguments import MAX_EXPIRY_MS
from pepsi.amqp.wire import tables
from pepsi.amqp.wire.replies import PRECONDITION_FAILED, ChannelError

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
        return None if self.headers is None else tables.decode_table(self.headers)


def read_properties(raw: bytes) -> Properties:
    """The fields the broker uses, read from property octets whose structure the frame
    reader has checked (`reader`); ValueError if they are malformed after all."""
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
