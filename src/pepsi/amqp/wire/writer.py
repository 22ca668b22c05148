"""The AMQP 0-9-1 frame writer: methods and contents to bytes (pure).

`encode_method`, `encode_content` (bodies split at frame_max - 8), `HEARTBEAT`;
`encode_deliver_fields` packs a basic.deliver with its content at once, the
consuming hot path, from the consumer tag and routing fields a channel keeps encoded
(`shortstr`, `routing_fields`).
"""

from __future__ import annotations

import struct
from typing import Final

from pamqp import base, commands

from pepsi.amqp.wire.methods import encode_method_payload
from pepsi.amqp.wire.protocol import (
    BASIC_CLASS_ID,
    FRAME_BODY,
    FRAME_END,
    FRAME_HEADER,
    FRAME_HEARTBEAT,
    FRAME_METHOD,
    FRAME_MIN_SIZE,
    FRAME_OVERHEAD,
)

# A frame's header (type, channel, payload size) and a content header's fixed fields
# (class, weight, body size). Defined here and in the reader, not imported: CPython 3.11
# compiles a method call on an imported name (`_FRAME_HEAD.unpack_from(...)`) without
# LOAD_METHOD, a bound method made per call on the hot path.
_FRAME_HEAD = struct.Struct(">BHI")
_CONTENT_HEAD = struct.Struct(">HHQ")

_U8 = struct.Struct(">B")
_U32 = struct.Struct(">I")

HEARTBEAT: Final = bytes([FRAME_HEARTBEAT, 0, 0, 0, 0, 0, 0, FRAME_END])


def encode_frame(frame_type: int, channel: int, payload: bytes) -> bytes:
    """One frame: type, channel, size, payload, frame-end."""
    return _FRAME_HEAD.pack(frame_type, channel, len(payload)) + payload + b"\xce"


def encode_method(channel: int, method: base.Frame) -> bytes:
    """A method frame (pamqp's argument validation bypassed, see `build_method`)."""
    return encode_frame(FRAME_METHOD, channel, encode_method_payload(method))


def encode_content(
    channel: int, method: base.Frame, raw_properties: bytes, body: bytes, frame_max: int
) -> bytes:
    """Method, content header (with `raw_properties` unchanged) and body frames.

    The body is split into frames of at most frame_max - 8 octets (frame_max 0: one
    frame); an empty body has no body frame. The header frame is not split (the spec
    does not allow it), so properties larger than frame_max go out as they are.
    """
    return _content(channel, encode_method(channel, method), raw_properties, body, frame_max)


_DELIVERY_INDEX: Final = commands.Basic.Deliver.index
_DELIVER_INDEX: Final = _U32.pack(_DELIVERY_INDEX)
# The fixed parts of a basic.deliver whose body fits one frame, each packed at once:
# the method frame's header with the class and method ids; the delivery tag and the
# redelivered bit; the method's frame-end and the content header frame's header and
# fixed fields; the header's frame-end and the body frame's header.
_DELIVER_HEAD = struct.Struct(">BHII")
_DELIVER_TAG = struct.Struct(">QB")
_DELIVER_CONTENT = struct.Struct(">BBHIHHQ")
_DELIVER_BODY = struct.Struct(">BBHI")
_CONTENT_FIXED: Final = _CONTENT_HEAD.size  # class, weight, body size


def shortstr(text: str) -> bytes:
    """A shortstr field: its length octet and UTF-8 octets (ValueError past 255)."""
    data = text.encode()
    if len(data) > 255:
        raise ValueError(f"shortstr of {len(data)} octets (at most 255)")
    return _U8.pack(len(data)) + data


def routing_fields(exchange: str, routing_key: str) -> bytes:
    """basic.deliver's last two fields (exchange, routing key), encoded."""
    return shortstr(exchange) + shortstr(routing_key)


def encode_deliver(
    channel: int,
    *,
    consumer_tag: str,
    delivery_tag: int,
    redelivered: bool,
    exchange: str,
    routing_key: str,
    raw_properties: bytes,
    body: bytes,
    frame_max: int,
) -> bytes:
    """basic.deliver with its content, as `encode_content` would write it."""
    return encode_deliver_fields(
        channel, shortstr(consumer_tag), delivery_tag, redelivered,
        routing_fields(exchange, routing_key), raw_properties=raw_properties, body=body,
        frame_max=frame_max,
    )  # fmt: skip


def encode_deliver_fields(
    channel: int,
    consumer_tag: bytes,
    delivery_tag: int,
    redelivered: bool,
    routing: bytes,
    *,
    raw_properties: bytes,
    body: bytes,
    frame_max: int,
) -> bytes:
    """`encode_deliver` with the consumer tag (`shortstr`) and the exchange and routing
    key (`routing_fields`) already encoded, as a consumer's channel keeps them: one call
    per message sent, the consuming hot path. A body that fits one frame (nearly every
    one) goes in one join of parts packed at once; others as `_content` splits them."""
    size = len(body)
    if size and (
        not frame_max or (frame_max >= FRAME_MIN_SIZE and size <= frame_max - FRAME_OVERHEAD)
    ):
        return b"".join((
            _DELIVER_HEAD.pack(
                FRAME_METHOD, channel, 13 + len(consumer_tag) + len(routing), _DELIVERY_INDEX
            ),
            consumer_tag, _DELIVER_TAG.pack(delivery_tag, redelivered), routing,
            _DELIVER_CONTENT.pack(
                FRAME_END, FRAME_HEADER, channel, _CONTENT_FIXED + len(raw_properties),
                BASIC_CLASS_ID, 0, size,
            ),
            raw_properties, _DELIVER_BODY.pack(FRAME_END, FRAME_BODY, channel, size), body,
            b"\xce",
        ))  # fmt: skip
    payload = b"".join((
        _DELIVER_INDEX, consumer_tag, _DELIVER_TAG.pack(delivery_tag, redelivered), routing
    ))  # fmt: skip
    method = encode_frame(FRAME_METHOD, channel, payload)
    return _content(channel, method, raw_properties, body, frame_max)


def _content(
    channel: int, method: bytes, raw_properties: bytes, body: bytes, frame_max: int
) -> bytes:
    if frame_max and frame_max < FRAME_MIN_SIZE:
        raise ValueError(f"frame_max {frame_max} is below the minimum {FRAME_MIN_SIZE}")
    parts = [
        method,
        encode_frame(
            FRAME_HEADER, channel, _CONTENT_HEAD.pack(BASIC_CLASS_ID, 0, len(body)) + raw_properties
        ),
    ]
    if len(body) <= frame_max - FRAME_OVERHEAD or (not frame_max and body):
        if body:
            parts += (_FRAME_HEAD.pack(FRAME_BODY, channel, len(body)), body, b"\xce")
        return b"".join(parts)
    step = frame_max - FRAME_OVERHEAD
    view = memoryview(body)
    for start in range(0, len(body), step):
        chunk = view[start : start + step]
        parts.append(_FRAME_HEAD.pack(FRAME_BODY, channel, len(chunk)))
        parts.append(chunk.tobytes())
        parts.append(b"\xce")
    return b"".join(parts)
