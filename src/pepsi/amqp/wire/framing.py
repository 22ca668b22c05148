"""The AMQP 0-9-1 wire codec: bytes in, frames out, and back (pure: no sockets, no asyncio).

Reading: `FrameReader` takes bytes as they arrive, checks the protocol header, then cuts
frames (type, channel, size, payload, frame-end 0xCE), bounded by the negotiated
frame_max. Method payloads are decoded by pamqp (`pamqp.commands`); content headers are
kept as their raw bytes (`RawContentHeader`) because pamqp's table re-encoding is lossy
(it sorts keys, picks its own integer widths, turns doubles into 32-bit floats, drops
milliseconds from timestamps, fails on -128..-1) while a broker must forward properties
byte for byte.
`ContentAssembler` (one per channel) joins method + header + body frames into `Content`.

Writing: `encode_method`, `encode_content` (bodies split at frame_max - 8), `HEARTBEAT`,
`PROTOCOL_HEADER`.

Errors: every problem with the peer's bytes is a `FrameError` carrying the reply code
RabbitMQ uses (501 frame, 502 syntax, 505 unexpected frame, 540 not implemented; 406
for a message over the configured size). `fatal` errors mean the byte stream lost its
frame boundaries: send `connection.close` and drop the socket without waiting for
close-ok, as RabbitMQ does. A `ProtocolHeaderMismatch` is answered with `answer`
(`AMQP 0-0-9-1`) and a close, never with a method.

pamqp is only ever given structures this module has already walked and bounded: its
decoder loops forever on a field array longer than its frame and on a content-header
flag word with the continuation bit set, recurses per nesting level, and copies the
rest of the payload for every table item (quadratic).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Final, TypeVar

from pamqp import base, commands
from pamqp import decode as pamqp_decode
from pamqp import encode as pamqp_encode

# --- constants --------------------------------------------------------------------------

PROTOCOL_HEADER: Final = b"AMQP\x00\x00\x09\x01"
"""What a client sends first, and what the server answers to any header it refuses."""

# AMQP 0-9's header; RabbitMQ treats it as 0-9-1 (the two are wire compatible for the
# methods clients use), so a 0-9 client keeps working. 0-8 and 1.0 are refused.
PROTOCOL_HEADER_0_9: Final = b"AMQP\x01\x01\x00\x09"

FRAME_METHOD: Final = 1
FRAME_HEADER: Final = 2
FRAME_BODY: Final = 3
FRAME_HEARTBEAT: Final = 8
FRAME_END: Final = 0xCE
FRAME_OVERHEAD: Final = 8  # 7 header octets (type, channel, size) + the frame-end octet
FRAME_MIN_SIZE: Final = 4096  # the spec's and RabbitMQ's smallest frame_max
BASIC_CLASS_ID: Final = 60  # the only class with content in 0-9-1

LARGE_BODY: Final = 1024 * 1024  # a body this large is assembled off the heap
DEFAULT_MAX_MESSAGE_SIZE: Final = 128 * 1024 * 1024  # RabbitMQ's max_message_size default
MAX_MESSAGE_SIZE_LIMIT: Final = 512 * 1024 * 1024  # RabbitMQ's ceiling for that setting

# Bounds on field tables that pamqp will decode: it recurses per level (Python's
# recursion limit) and copies the rest of the payload per item (quadratic). Real clients
# send a few dozen items two or three levels deep; RabbitMQ itself has no such limits.
MAX_TABLE_DEPTH: Final = 32
MAX_TABLE_ITEMS: Final = 1024

HEARTBEAT: Final = bytes([FRAME_HEARTBEAT, 0, 0, 0, 0, 0, 0, FRAME_END])

# Reply codes used here (the spec's values).
PRECONDITION_FAILED: Final = 406
FRAME_ERROR: Final = 501
SYNTAX_ERROR: Final = 502
COMMAND_INVALID: Final = 503
UNEXPECTED_FRAME: Final = 505
NOT_IMPLEMENTED: Final = 540
_SOFT_CODES: Final = frozenset({311, 312, 313, 403, 404, 405, 406})

_FRAME_HEAD = struct.Struct(">BHI")
_CONTENT_HEAD = struct.Struct(">HHQ")
_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")

# Content-bearing methods (class 60): a header and body frames follow them.
CONTENT_METHODS: Final[tuple[type[base.Frame], ...]] = (
    commands.Basic.Publish,
    commands.Basic.Return,
    commands.Basic.Deliver,
    commands.Basic.GetOk,
)

# --- errors -----------------------------------------------------------------------------


class FrameError(Exception):
    """The peer sent bytes that break the protocol; carries the reply code to close with.

    `channel`, `class_id` and `method_id` say where it happened (0 when unknown), for the
    `connection.close`/`channel.close` the server sends. `fatal` is True when frame
    boundaries are lost: nothing more can be read from this connection.
    """

    fatal: bool = False

    def __init__(
        self,
        reply_code: int,
        text: str,
        *,
        channel: int = 0,
        class_id: int = 0,
        method_id: int = 0,
    ) -> None:
        super().__init__(reply_code, text)
        self.reply_code = reply_code
        self.text = text
        self.channel = channel
        self.class_id = class_id
        self.method_id = method_id

    @property
    def hard(self) -> bool:
        """True for a connection error (5xx, 3xx hard codes); False for a channel error."""
        return self.reply_code not in _SOFT_CODES

    def __str__(self) -> str:
        return f"{self.reply_code} {self.text}"


class FrameFormatError(FrameError):
    """501 FRAME_ERROR: a frame or a method that cannot be decoded."""

    def __init__(self, text: str, **where: int) -> None:
        super().__init__(FRAME_ERROR, text, **where)


class FatalFrameError(FrameFormatError):
    """501 with lost frame boundaries (bad frame-end octet): close without waiting."""

    fatal = True


class FrameTooLarge(FatalFrameError):
    """501: a frame announced a payload over the negotiated frame_max."""


class ProtocolHeaderMismatch(FatalFrameError):
    """The first 8 octets are not an AMQP 0-9-1 header: send `answer`, then close.

    0-9-1 and 0-9 headers are accepted (as RabbitMQ does); anything else is refused as
    soon as its octets differ, with the 0-9-1 header as the spec asks (RabbitMQ 4 answers
    non-0-9 versions with its AMQP 1.0 header instead, since it also speaks 1.0).
    """

    answer: bytes = PROTOCOL_HEADER

    def __init__(self, received: bytes) -> None:
        super().__init__(f"unsupported protocol header {received!r}")
        self.received = received


class FrameSyntaxError(FrameError):
    """502 SYNTAX_ERROR: content-header properties that cannot be decoded."""

    def __init__(self, text: str, **where: int) -> None:
        super().__init__(SYNTAX_ERROR, text, **where)


class CommandInvalid(FrameError):
    """503 COMMAND_INVALID (for the server's use; the codec itself does not raise it)."""

    def __init__(self, text: str, **where: int) -> None:
        super().__init__(COMMAND_INVALID, text, **where)


class UnexpectedFrame(FrameError):
    """505 UNEXPECTED_FRAME: a frame out of order (header or body without a method...)."""

    def __init__(self, text: str, **where: int) -> None:
        super().__init__(UNEXPECTED_FRAME, text, **where)


class MethodNotImplemented(FrameError):
    """540 NOT_IMPLEMENTED: a class/method id pair that AMQP 0-9-1 does not define."""

    def __init__(self, text: str, **where: int) -> None:
        super().__init__(NOT_IMPLEMENTED, text, **where)


class MessageTooLarge(FrameError):
    """406 PRECONDITION_FAILED (a channel error, as RabbitMQ's max_message_size check)."""

    def __init__(self, text: str, **where: int) -> None:
        super().__init__(PRECONDITION_FAILED, text, **where)


# --- frames -----------------------------------------------------------------------------


# Frames are values, but not frozen dataclasses: a frozen __init__ sets each field with
# object.__setattr__ and costs about four times as much, and three are made per publish.
@dataclass(slots=True)
class ProtocolHeaderFrame:
    """The client's protocol header was accepted; `version` is (0, 9, 1) or (0, 9, 0)."""

    version: tuple[int, int, int]
    channel: int = 0


@dataclass(slots=True)
class MethodFrame:
    """A decoded method (a `pamqp.commands` instance) on a channel."""

    channel: int
    method: base.Frame

    @property
    def has_content(self) -> bool:
        """True for basic.publish/return/deliver/get-ok: a header and body follow."""
        return isinstance(self.method, CONTENT_METHODS)


@dataclass  # no slots: `properties` is a cached_property
class RawContentHeader:
    """A content header kept as received: `raw_properties` is the property flags and the
    property list exactly as on the wire, to be stored and forwarded unchanged."""

    channel: int
    body_size: int
    raw_properties: bytes

    @cached_property
    def properties(self) -> commands.Basic.Properties:
        """The properties decoded by pamqp (on first use; raises FrameSyntaxError)."""
        return decode_properties(self.raw_properties, channel=self.channel)


@dataclass(slots=True)
class BodyFrame:
    """One content body frame's payload."""

    channel: int
    payload: bytes


@dataclass(slots=True)
class HeartbeatFrame:
    """A heartbeat (always on channel 0)."""

    channel: int = 0


Frame = ProtocolHeaderFrame | MethodFrame | RawContentHeader | BodyFrame | HeartbeatFrame


@dataclass(slots=True)
class Content:
    """A complete content-bearing method: method, header (raw) and the whole body."""

    channel: int
    method: base.Frame
    header: RawContentHeader
    body: bytes

    @property
    def raw_properties(self) -> bytes:
        """The property octets to store and forward unchanged."""
        return self.header.raw_properties


# --- structure checks (before pamqp sees anything) --------------------------------------

_FIXED_FIELD_SIZES: Final = {"octet": 1, "short": 2, "long": 4, "longlong": 8, "timestamp": 8}
_FIXED_VALUE_SIZES: Final = {
    # The field-value types RabbitMQ accepts (the 0-9-1 errata's table, as RabbitMQ
    # reads it: 'l' and 'L' are both 64-bit signed).
    ord("t"): 1, ord("b"): 1, ord("B"): 1, ord("s"): 2, ord("u"): 2, ord("I"): 4,
    ord("i"): 4, ord("l"): 8, ord("L"): 8, ord("f"): 4, ord("d"): 8, ord("D"): 5,
    ord("T"): 8, ord("V"): 0,
}  # fmt: skip
_LENGTH_PREFIXED: Final = frozenset({ord("S"), ord("x")})
_TABLE, _ARRAY = ord("F"), ord("A")


class _Malformed(Exception):
    """Internal: the structure walk failed (mapped to the caller's error class)."""


class _Walker:
    """Walks AMQP field structures over a buffer, checking every length against its
    container and counting table items, without building any value."""

    __slots__ = ("buf", "items")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.items = 0

    def need(self, pos: int, size: int, end: int) -> int:
        if pos + size > end:
            raise _Malformed(f"field overruns its container at octet {pos}")
        return pos + size

    def shortstr(self, pos: int, end: int) -> int:
        self.need(pos, 1, end)
        return self.need(pos + 1, self.buf[pos], end)

    def longstr(self, pos: int, end: int) -> int:
        self.need(pos, 4, end)
        return self.need(pos + 4, _U32.unpack_from(self.buf, pos)[0], end)

    def field(self, kind: str, pos: int, end: int) -> int:
        if kind == "shortstr":
            return self.shortstr(pos, end)
        if kind == "longstr":
            return self.longstr(pos, end)
        if kind == "table":
            inner_end = self.longstr(pos, end)
            self.table(pos + 4, inner_end, 1)
            return inner_end
        size = _FIXED_FIELD_SIZES.get(kind)
        if size is None:  # pragma: no cover - pamqp's spec has no other argument types
            raise _Malformed(f"unknown field type {kind}")
        return self.need(pos, size, end)

    def fields(self, layout: tuple[int | str, ...], pos: int, end: int) -> int:
        """Walk a layout (fixed sizes as ints, variable kinds by name); the end position."""
        for item in layout:
            pos = self.need(pos, item, end) if isinstance(item, int) else self.field(item, pos, end)
        return pos

    def table(self, pos: int, end: int, depth: int) -> None:
        while pos < end:
            pos = self.shortstr(pos, end)  # the key
            pos = self.value(pos, end, depth)

    def array(self, pos: int, end: int, depth: int) -> None:
        while pos < end:
            pos = self.value(pos, end, depth)

    def value(self, pos: int, end: int, depth: int) -> int:
        self.items += 1
        if self.items > MAX_TABLE_ITEMS:
            raise _Malformed(f"more than {MAX_TABLE_ITEMS} field-table items in one frame")
        self.need(pos, 1, end)
        tag = self.buf[pos]
        pos += 1
        size = _FIXED_VALUE_SIZES.get(tag)
        if size is not None:
            return self.need(pos, size, end)
        if tag in _LENGTH_PREFIXED:
            return self.longstr(pos, end)
        if tag in (_TABLE, _ARRAY):
            if depth >= MAX_TABLE_DEPTH:
                raise _Malformed(f"field tables nested deeper than {MAX_TABLE_DEPTH}")
            inner_end = self.longstr(pos, end)
            if tag == _TABLE:
                self.table(pos + 4, inner_end, depth + 1)
            else:
                self.array(pos + 4, inner_end, depth + 1)
            return inner_end
        raise _Malformed(f"unknown field-value type {bytes([tag])!r}")


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


_PROPERTY_SLOTS: Final = tuple(
    (
        commands.Basic.Properties.flags[name],
        _FIXED_FIELD_SIZES.get(kind, kind),
    )
    for name in commands.Basic.Properties.__slots__
    for kind in (commands.Basic.Properties.amqp_type(name),)
)
# The two low bits of the flag word are not properties: bit 0 announces a further flag
# word (class 60 has only 14 properties). RabbitMQ ignores both; so do we, which also
# keeps them away from pamqp (which loops forever on the continuation bit).
_PROPERTY_FLAG_MASK: Final = 0xFFFC


def _properties_fast_ok(raw: bytes) -> bool:
    """True when property octets without tables are well formed (the common case, checked
    without the walker); False means "not sure": the walker decides and names the error."""
    end = len(raw)
    if end < 2:
        return False
    flags = (raw[0] << 8) | raw[1]
    pos = 2
    for flag, item in _PROPERTY_SLOTS:
        if not flags & flag:
            continue
        if item == "shortstr":
            if pos >= end:
                return False
            pos += 1 + raw[pos]
        elif isinstance(item, int):
            pos += item
        else:  # a table: leave it to the walker (depth and item bounds)
            return False
        if pos > end:
            return False
    return pos == end


def _check_properties(raw: bytes) -> None:
    if _properties_fast_ok(raw):
        return
    walker = _Walker(raw)
    end = len(raw)
    pos = walker.need(0, 2, end)
    flags = _U16.unpack_from(raw, 0)[0]
    if flags & _PROPERTY_FLAG_MASK:
        layout = tuple(item for flag, item in _PROPERTY_SLOTS if flags & flag)
        pos = walker.fields(layout, pos, end)
    if pos != end:
        raise _Malformed(f"{end - pos} octets after the last property")


def decode_table(raw: bytes) -> dict[str, Any]:
    """A field table's items given without their length (AMQPLAIN's response), bounded
    by the walker before pamqp decodes them; FrameSyntaxError if malformed."""
    try:
        _Walker(raw).table(0, len(raw), 1)
        _, table = pamqp_decode.field_table(_U32.pack(len(raw)) + raw)
    except _Malformed as error:
        raise FrameSyntaxError(f"malformed field table: {error}") from None
    except Exception as error:  # noqa: BLE001  # pamqp's decoders on hostile values
        raise FrameSyntaxError(f"undecodable field table: {error}") from None
    return dict(table)


def decode_properties(raw_properties: bytes, *, channel: int = 0) -> commands.Basic.Properties:
    """Decode raw content-header property octets with pamqp (FrameSyntaxError if bad)."""
    where = {"channel": channel, "class_id": BASIC_CLASS_ID}
    try:
        _check_properties(raw_properties)
        flags = _U16.unpack_from(raw_properties, 0)[0] & _PROPERTY_FLAG_MASK
        properties = commands.Basic.Properties()
        properties.unmarshal(flags, raw_properties[2:])
    except _Malformed as error:
        raise FrameSyntaxError(f"malformed content properties: {error}", **where) from None
    # pamqp raises whatever its decoders hit on hostile values (UnicodeDecodeError in a
    # shortstr, OverflowError on a timestamp...): all of it is the peer's syntax error.
    except Exception as error:  # noqa: BLE001
        raise FrameSyntaxError(f"undecodable content properties: {error}", **where) from None
    return properties


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
PUBLISH_CACHE: Final = 64  # decoded basic.publish methods a reader keeps
_METHOD_HEAD = struct.Struct(">BHII")  # frame type, channel, size, class and method ids
# frame type, channel, size, then the content header's class, weight and body size
_HEADER_HEAD = struct.Struct(">BHIHHQ")
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


# A whole basic.ack frame: type, channel, size, class and method ids, tag, bits, frame end.
_ACK_FRAME: Final = struct.Struct(">BHIIQBB")


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


def _decode_header(channel: int, payload: bytes) -> RawContentHeader:
    if channel == 0:
        raise UnexpectedFrame("content header frame on channel 0")
    if len(payload) < 14:  # class, weight, body size, one flag word
        raise FrameFormatError("content header frame too short", channel=channel)
    class_id, weight, body_size = _CONTENT_HEAD.unpack_from(payload, 0)
    if class_id != BASIC_CLASS_ID or weight != 0:
        raise UnexpectedFrame(
            f"content header for class {class_id} weight {weight}", channel=channel
        )
    raw = payload[12:]
    try:
        _check_properties(raw)
    except _Malformed as error:
        raise FrameSyntaxError(
            f"malformed content properties: {error}", channel=channel, class_id=BASIC_CLASS_ID
        ) from None
    return RawContentHeader(channel, body_size, raw)


# --- reading ----------------------------------------------------------------------------


class FrameReader:
    """Cuts one connection's incoming byte stream into frames.

    `feed(data)` buffers the bytes and returns an iterator over the frames now complete
    (a partial frame waits for more bytes). The iterator raises a `FrameError` where the
    bad frame is, after yielding the frames before it. After a non-fatal error the bad
    frame has been consumed and `frames()` goes on with the next one (the server reads
    on until connection.close-ok); after a fatal one every call raises it again.

    A pending frame never holds more than frame_max + 8 octets: the size is checked as
    soon as the 7-octet frame header is in. Like RabbitMQ, a payload of up to frame_max
    (not frame_max - 8) is accepted, since clients commonly get that off by 8. Before
    connection.tune-ok the limit is FRAME_MIN_SIZE, as in RabbitMQ; set `frame_max` to
    the negotiated value afterwards (0 means no limit: a server should not agree to it).
    """

    def __init__(self, frame_max: int = FRAME_MIN_SIZE, *, expect_protocol_header: bool = True):
        self.frame_max = frame_max
        self._buf = bytearray()
        self._pos = 0
        self._need_header = expect_protocol_header
        self._failed: FrameError | None = None
        self._good_properties = b""
        # decoded basic.publish methods by payload (a publisher repeats one); never
        # changed once made, so one object may serve many publishes
        self._publishes: dict[bytes, commands.Basic.Publish] = {}

    @property
    def frame_max(self) -> int:
        return self._frame_max

    @frame_max.setter
    def frame_max(self, value: int) -> None:
        if value < 0 or value > 0xFFFFFFFF:
            raise ValueError(f"frame_max must be 0..2**32-1, not {value}")
        self._frame_max = value

    @property
    def buffered(self) -> int:
        """Octets received but not yet returned as frames."""
        return len(self._buf) - self._pos

    def feed(self, data: bytes) -> Iterator[Frame]:
        """Add received bytes; iterate the result to get the frames they complete."""
        if self._failed is not None:
            raise self._failed  # nothing more is read once sync is lost
        self._compact()
        self._buf += data
        return self.frames()

    def frames(self) -> Iterator[Frame]:
        """The frames complete in the buffer, decoded one by one as you iterate."""
        while True:
            frame = self.next_frame()
            if frame is None:
                return
            yield frame

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None until more bytes arrive."""
        if self._failed is not None:
            raise self._failed
        try:
            frame = self._read_header() if self._need_header else self._read_frame()
        except FrameError as error:
            if error.fatal:
                self._failed = error
            raise
        if frame is None:
            self._compact()
        return frame

    def _compact(self) -> None:
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0

    def take_publish(self, accept: Callable[[int, int], bool]) -> Content | None:
        """A whole basic.publish at once (the hot path of a publisher), or None.

        Taken only when its method, content header and body frames are all buffered,
        one after another on one channel, each within frame_max and well formed, and
        `accept(channel, body_size)` agrees (the channel expects a method and the body
        is within its limit). Otherwise nothing is consumed, and `next_frame` reads
        the same octets frame by frame, with its errors.
        """
        if self._need_header or self._failed is not None:
            return None
        buf = self._buf
        taken = self._publish_method(buf, self._pos)
        if taken is None:
            return None
        method, channel, pos = taken
        header = self._content_header(buf, pos, channel)
        if header is None:
            return None
        raw, body_size, pos = header
        if not self._properties_ok(raw) or not accept(channel, body_size):
            return None
        parts: list[bytes] = []
        remaining = body_size
        frame_max = self._frame_max
        size = len(buf)
        while remaining:  # the body frames
            length = -1
            if size - pos >= 7:
                kind, on, length = _FRAME_HEAD.unpack_from(buf, pos)
                if kind != FRAME_BODY or on != channel or (frame_max and length > frame_max):
                    length = -1
            end = pos + 7 + length
            if not 0 < length <= remaining or size <= end or buf[end] != FRAME_END:
                return None
            parts.append(bytes(buf[pos + 7 : end]))
            remaining -= length
            pos = end + 1
        self._pos = pos
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        return Content(channel, method, RawContentHeader(channel, body_size, raw), body)

    def _publish_method(
        self, buf: bytearray, start: int
    ) -> tuple[commands.Basic.Publish, int, int] | None:
        """A whole, well-formed basic.publish method frame at `start`: the method (decoded
        once per distinct payload: a publisher repeats one), its channel and where the
        next frame starts; else None. An ack is turned away by its method id."""
        size = len(buf)
        if size - start < 16:  # a frame header and the shortest basic.publish
            return None
        kind, channel, length, index = _METHOD_HEAD.unpack_from(buf, start)
        end = start + 7 + length
        if (
            index != _PUBLISH_INDEX
            or kind != FRAME_METHOD
            or not channel
            or length < 9
            or (self._frame_max and length > self._frame_max)
            or size <= end
            or buf[end] != FRAME_END
        ):
            return None
        payload = bytes(buf[start + 7 : end])
        method = self._publishes.get(payload)
        if method is None:
            method = _fast_publish(payload)
            if method is None:
                return None
            if len(self._publishes) >= PUBLISH_CACHE:
                self._publishes.clear()
            self._publishes[payload] = method
        return method, channel, end + 1

    def _content_header(
        self, buf: bytearray, pos: int, channel: int
    ) -> tuple[bytes, int, int] | None:
        """A whole content header frame of class basic on `channel` at `pos`: its raw
        property octets, the body size and where the next frame starts; else None."""
        size = len(buf)
        if size - pos < 7 + 14:  # a frame header, class, weight, body size, one flag word
            return None
        kind, on, length, class_id, weight, body_size = _HEADER_HEAD.unpack_from(buf, pos)
        end = pos + 7 + length
        if (
            kind != FRAME_HEADER
            or on != channel
            or length < 14
            or (self._frame_max and length > self._frame_max)
            or size <= end
            or buf[end] != FRAME_END
            or class_id != BASIC_CLASS_ID
            or weight != 0
        ):
            return None
        return bytes(buf[pos + 19 : end]), body_size, end + 1

    def take_ack(self, accept: Callable[[int], bool]) -> tuple[int, int, bool] | None:
        """A basic.ack frame at once (a consumer's hot path): (channel, delivery tag,
        multiple), if it is whole and well formed and `accept(channel)` agrees; else
        None, nothing consumed, and `next_frame` reads it with its errors."""
        if self._need_header or self._failed is not None:
            return None
        buf, pos = self._buf, self._pos
        if len(buf) - pos < _ACK_FRAME.size:
            return None
        kind, channel, size, index, tag, bits, end = _ACK_FRAME.unpack_from(buf, pos)
        if (
            kind != FRAME_METHOD
            or size != _ACK.size
            or index != _ACK_INDEX
            or end != FRAME_END
            or not accept(channel)
        ):
            return None
        self._pos = pos + _ACK_FRAME.size
        return channel, tag, bool(bits & 1)

    def _properties_ok(self, raw: bytes) -> bool:
        """Whether content properties are well formed; the last good list is remembered
        (a publisher mostly repeats one). False also when unsure: the frame path decides."""
        if raw == self._good_properties:
            return True
        try:
            _check_properties(raw)
        except _Malformed:
            return False
        if len(raw) <= 256:
            self._good_properties = raw
        return True

    def _read_header(self) -> ProtocolHeaderFrame | None:
        got = bytes(self._buf[self._pos : self._pos + 8])
        for header, version in ((PROTOCOL_HEADER, (0, 9, 1)), (PROTOCOL_HEADER_0_9, (0, 9, 0))):
            if header.startswith(got):
                if len(got) < 8:
                    return None  # wait for the rest of the header
                self._pos += 8
                self._need_header = False
                return ProtocolHeaderFrame(version)
        # Refused as soon as the octets cannot become a header we speak (an HTTP or TLS
        # client is answered at once instead of waiting for a handshake timeout).
        raise ProtocolHeaderMismatch(got)

    def _read_frame(self) -> Frame | None:
        buf, pos = self._buf, self._pos
        if len(buf) - pos < 7:
            return None
        frame_type, channel, size = _FRAME_HEAD.unpack_from(buf, pos)
        if self._frame_max and size > self._frame_max:
            raise FrameTooLarge(
                f"frame of type {frame_type} with a {size}-octet payload exceeds "
                f"frame_max {self._frame_max}",
                channel=channel,
            )
        end = pos + 7 + size
        if len(buf) <= end:
            return None
        if buf[end] != FRAME_END:
            raise FatalFrameError(
                f"frame of type {frame_type} ends with 0x{buf[end]:02x}, not 0xce",
                channel=channel,
            )
        payload = bytes(buf[pos + 7 : end])
        self._pos = end + 1  # consumed: a decoding error below does not lose sync
        if frame_type == FRAME_METHOD:
            return _decode_method(channel, payload)
        if frame_type == FRAME_HEADER:
            return _decode_header(channel, payload)
        if frame_type == FRAME_BODY:
            if channel == 0:
                raise UnexpectedFrame("content body frame on channel 0")
            return BodyFrame(channel, payload)
        if frame_type == FRAME_HEARTBEAT:
            if payload:
                raise FrameFormatError("heartbeat frame with a payload", channel=channel)
            if channel != 0:
                raise UnexpectedFrame(f"heartbeat frame on channel {channel}", channel=channel)
            return HeartbeatFrame()
        raise FrameFormatError(f"unknown frame type {frame_type}", channel=channel)


# --- content assembly -------------------------------------------------------------------


class ContentAssembler:
    """One channel's content state machine: method → (content method: header → body
    frames up to body_size) → `Content`. Errors reset it to expect a method; the server
    then closes the channel or connection and discards the rest of that content."""

    def __init__(self, channel: int, *, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE):
        if not 0 < max_message_size <= MAX_MESSAGE_SIZE_LIMIT:
            raise ValueError(f"max_message_size must be 1..{MAX_MESSAGE_SIZE_LIMIT}")
        self.channel = channel
        self.max_message_size = max_message_size
        self._method: base.Frame | None = None
        self._header: RawContentHeader | None = None
        self._parts: list[bytes] = []
        # A large body is written into anonymous memory of its own, which goes back to
        # the system at once when the content is done or dropped (parts on the heap
        # left the process 270 MB larger after a client dropped two 128 MiB contents).
        self._large: mmap.mmap | None = None
        self._at = 0
        self._remaining = 0

    @property
    def idle(self) -> bool:
        """True when no content is in progress (the next frame must be a method)."""
        return self._method is None

    def reset(self) -> None:
        self._method = None
        self._header = None
        self._parts = []
        if self._large is not None:
            self._large.close()
            self._large = None
        self._remaining = 0

    def feed(
        self, frame: MethodFrame | RawContentHeader | BodyFrame
    ) -> MethodFrame | Content | None:
        """Take the channel's next frame: a method without content comes straight back,
        a completed content comes back as `Content`, anything in between gives None."""
        if frame.channel != self.channel:
            raise ValueError(f"frame for channel {frame.channel} fed to channel {self.channel}")
        try:
            return self._step(frame)
        except FrameError:
            self.reset()
            raise

    def _where(self) -> dict[str, int]:
        method = self._method
        if method is None:
            return {"channel": self.channel}
        return {
            "channel": self.channel,
            "class_id": method.index >> 16,
            "method_id": method.index & 0xFFFF,
        }

    def _step(
        self, frame: MethodFrame | RawContentHeader | BodyFrame
    ) -> MethodFrame | Content | None:
        method = self._method
        if method is None:
            if not isinstance(frame, MethodFrame):
                raise UnexpectedFrame(
                    f"expected a method frame, got {_kind(frame)}", channel=self.channel
                )
            if not frame.has_content:
                return frame
            self._method = frame.method
            return None
        if self._header is None:
            if not isinstance(frame, RawContentHeader):
                raise UnexpectedFrame(
                    f"expected a content header after {method.name}, got {_kind(frame)}",
                    **self._where(),
                )
            if frame.body_size > self.max_message_size:
                raise MessageTooLarge(
                    f"message size {frame.body_size} is larger than configured max size "
                    f"{self.max_message_size}",
                    **self._where(),
                )
            if frame.body_size == 0:
                return self._complete(frame)
            self._header = frame
            self._remaining = frame.body_size
            if frame.body_size >= LARGE_BODY:
                self._large, self._at = mmap.mmap(-1, frame.body_size), 0
            return None
        if not isinstance(frame, BodyFrame):
            raise UnexpectedFrame(
                f"expected a content body after {method.name}, got {_kind(frame)}",
                **self._where(),
            )
        if len(frame.payload) > self._remaining:
            raise FrameFormatError(
                "content body frame exceeds remaining content size", **self._where()
            )
        self._keep(frame.payload)
        if self._remaining:
            return None
        return self._complete(self._header)

    def _keep(self, payload: bytes) -> None:
        if self._large is not None:
            end = self._at + len(payload)
            self._large[self._at : end] = payload
            self._at = end
        else:
            self._parts.append(payload)
        self._remaining -= len(payload)

    def _complete(self, header: RawContentHeader) -> Content:
        assert self._method is not None
        body = self._large[:] if self._large is not None else b"".join(self._parts)
        content = Content(self.channel, self._method, header, body)
        self.reset()
        return content


def _kind(frame: object) -> str:
    if isinstance(frame, MethodFrame):
        return f"method {frame.method.name}"
    if isinstance(frame, RawContentHeader):
        return "a content header"
    return "a content body"


# --- writing ----------------------------------------------------------------------------

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


def encode_frame(frame_type: int, channel: int, payload: bytes) -> bytes:
    """One frame: type, channel, size, payload, frame-end."""
    return _FRAME_HEAD.pack(frame_type, channel, len(payload)) + payload + b"\xce"


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


def encode_method(channel: int, method: base.Frame) -> bytes:
    """A method frame (pamqp's argument validation bypassed, see `build_method`)."""
    return encode_frame(FRAME_METHOD, channel, encode_method_payload(method))


def encode_properties(properties: commands.Basic.Properties) -> bytes:
    """Raw property octets for properties the server builds itself (pamqp's encoder)."""
    return properties.marshal()


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
