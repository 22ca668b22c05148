"""AMQP 0-9-1 methods: a method frame's payload decoded, and built and encoded (pure).

Decoding: the class and method ids name a `pamqp.commands` class, whose arguments are
walked and bounded (`tables`) before pamqp unmarshals them; basic.publish and
basic.ack, one per message, are read straight off their fixed layouts instead.
Encoding: `build_method` sets a method's fields without pamqp's name checks,
`encode_method_payload` writes its arguments (the writer frames them).
"""

from __future__ import annotations

import struct
from typing import Any, Final, TypeVar

from pamqp import base, commands
from pamqp import encode as pamqp_encode

from pepsi.amqp.wire.frames import MethodFrame
from pepsi.amqp.wire.replies import FrameFormatError, MethodNotImplemented
from pepsi.amqp.wire.tables import _FIXED_FIELD_SIZES, _Malformed, _Walker

_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")

# --- decoding ---------------------------------------------------------------------------


def _method_layout(cls: type[base.Frame]) -> tuple[int | str, ...]:
    """A method's arguments as the walker reads them (computed once per class)."""
    layout: list[int | str] = []
    bits = 0  # bits already taken from the current octet; 0 = no octet open
    for name in cls.__slots__:
        kind = cls.amqp_type(name)
        if kind == "bit":
            if bits in (0, 8):  # consecutive bits share octets, eight to an octet
                layout.append(1)
                bits = 0
            bits += 1
            continue
        bits = 0
        layout.append(_FIXED_FIELD_SIZES.get(kind, kind))
    return tuple(layout)


_METHODS: Final[dict[int, tuple[type[base.Frame], tuple[int | str, ...]]]] = {
    index: (cls, _method_layout(cls)) for index, cls in commands.INDEX_MAPPING.items()
}


def _check_method_fields(layout: tuple[int | str, ...], buf: bytes, pos: int) -> None:
    """Walk a method's arguments in `buf[pos:]`: every one present, nothing left over
    (RabbitMQ decodes with an exact pattern, so trailing octets are a frame error)."""
    end = len(buf)
    pos = _Walker(buf).fields(layout, pos, end)
    if pos != end:
        raise _Malformed(f"{end - pos} octets after the last argument")


_PUBLISH_INDEX: Final = commands.Basic.Publish.index


def _fast_publish(payload: bytes) -> commands.Basic.Publish | None:
    """basic.publish decoded straight off its fixed layout (ticket, two shortstrs, one bit
    octet), as pamqp's unmarshal would set it; None when anything is off, so that the
    general path raises its usual error."""
    end = len(payload)
    if end < 9:
        return None
    exchange_end = 7 + payload[6]
    if exchange_end >= end:
        return None
    key_end = exchange_end + 1 + payload[exchange_end]
    if key_end + 1 != end:
        return None
    try:
        exchange = payload[7:exchange_end].decode()
        routing_key = payload[exchange_end + 1 : key_end].decode()
    except UnicodeDecodeError:
        return None
    bits = payload[key_end]
    method = commands.Basic.Publish.__new__(commands.Basic.Publish)  # no defaults, no validate
    method.ticket = (payload[4] << 8) | payload[5]
    method.exchange = exchange
    method.routing_key = routing_key
    method.mandatory = bool(bits & 1)
    method.immediate = bool(bits & 2)
    return method


_ACK_INDEX: Final = commands.Basic.Ack.index
_ACK = struct.Struct(">IQB")  # class and method ids, delivery-tag, the multiple bit


def _fast_ack(payload: bytes) -> commands.Basic.Ack:
    """basic.ack (one per message a consumer settles) off its fixed 13-octet layout."""
    _, tag, bits = _ACK.unpack(payload)
    return ack_method(tag, bool(bits & 1))


def ack_method(tag: int, multiple: bool) -> commands.Basic.Ack:
    method = commands.Basic.Ack.__new__(commands.Basic.Ack)  # no defaults, no validate
    method.delivery_tag = tag
    method.multiple = multiple
    return method


def _decode_method(channel: int, payload: bytes) -> MethodFrame:
    if len(payload) >= 9:
        index = _U32.unpack_from(payload, 0)[0]
        if index == _PUBLISH_INDEX:
            publish = _fast_publish(payload)
            if publish is not None:
                return MethodFrame(channel, publish)
        elif index == _ACK_INDEX and len(payload) == _ACK.size:
            return MethodFrame(channel, _fast_ack(payload))
    if len(payload) < 4:
        raise FrameFormatError(
            "method frame shorter than its class and method ids", channel=channel
        )
    index = _U32.unpack_from(payload, 0)[0]
    where = {"channel": channel, "class_id": index >> 16, "method_id": index & 0xFFFF}
    known = _METHODS.get(index)
    if known is None:
        raise MethodNotImplemented(
            f"unknown method (class {index >> 16}, method {index & 0xFFFF})", **where
        )
    cls, layout = known
    try:
        _check_method_fields(layout, payload, 4)
        method = cls()
        method.unmarshal(payload[4:])
    except _Malformed as error:
        raise FrameFormatError(f"cannot decode {cls.name}: {error}", **where) from None
    # As in decode_properties: any exception from pamqp on checked structure is a value
    # it cannot take (invalid UTF-8, out-of-range timestamp...), i.e. the peer's error.
    except Exception as error:  # noqa: BLE001
        raise FrameFormatError(f"cannot decode {cls.name}: {error}", **where) from None
    return MethodFrame(channel, method)


# --- building and encoding --------------------------------------------------------------

M = TypeVar("M", bound=base.Frame)


def build_method(cls: type[M], **fields: Any) -> M:
    """Build a pamqp method without its name checks.

    pamqp's constructors reject exchange/queue names outside [a-zA-Z0-9-_.:@#,/ ] and
    exchange names over 127 characters; RabbitMQ accepts any UTF-8 name up to 255
    octets, so a server echoing a client's name (basic.deliver, queue.declare-ok) must
    not go through them.
    """
    method = cls()
    for name, value in fields.items():
        if name not in cls.__slots__:
            raise TypeError(f"{cls.name} has no field {name!r}")
        setattr(method, name, value)
    return method


_INT_PACKERS: Final = {
    "octet": _U8,
    "short": _U16,
    "long": _U32,
    "longlong": _U64,  # unsigned, as the spec says (pamqp packs it signed)
    "timestamp": _U64,
}


def _encode_field(kind: str, value: Any) -> bytes:
    if kind in ("shortstr", "longstr"):
        data = value.encode() if isinstance(value, str) else bytes(value)
        if kind == "longstr":
            return _U32.pack(len(data)) + data
        if len(data) > 255:
            raise ValueError(f"shortstr of {len(data)} octets (at most 255)")
        return _U8.pack(len(data)) + data
    packer = _INT_PACKERS.get(kind)
    if packer is not None and isinstance(value, int):
        return packer.pack(value)
    # Tables (server-built: server_properties, arguments) and datetime timestamps: pamqp.
    encoded: bytes = pamqp_encode.by_type(value, kind)
    return encoded


def encode_method_payload(method: base.Frame) -> bytes:
    """A method frame's payload: class and method ids, then the arguments."""
    parts = [_U32.pack(method.index)]
    octet, bits = 0, -1  # bits: how many bits the open octet holds; -1 = none open
    for name in type(method).__slots__:
        kind = method.amqp_type(name)
        value = getattr(method, name)
        if kind == "bit":
            if bits == 8:
                parts.append(_U8.pack(octet))
                octet, bits = 0, -1
            bits = max(bits, 0)
            octet |= bool(value) << bits
            bits += 1
            continue
        if bits >= 0:
            parts.append(_U8.pack(octet))
            octet, bits = 0, -1
        parts.append(_encode_field(kind, value))
    if bits >= 0:
        parts.append(_U8.pack(octet))
    return b"".join(parts)
