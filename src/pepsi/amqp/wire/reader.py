"""The AMQP 0-9-1 frame reader: bytes in, frames out (pure: no sockets, no asyncio).

`FrameReader` takes bytes as they arrive, checks the protocol header, then cuts
frames (type, channel, size, payload, frame-end 0xCE), bounded by the negotiated
frame_max. Method payloads are decoded by `methods`; content headers are kept as
their raw bytes (`RawContentHeader`), their structure checked (`properties`).
`take_publish` and `take_ack` read a whole basic.publish or basic.ack at once, the
publisher's and the consumer's hot paths.

Every problem with the peer's bytes is a `FrameError` (`replies`); a fatal one means
the byte stream lost its frame boundaries.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import Final

from pamqp import commands

from pepsi.amqp.wire.frames import (
    BodyFrame,
    Content,
    Frame,
    HeartbeatFrame,
    ProtocolHeaderFrame,
    RawContentHeader,
)
from pepsi.amqp.wire.methods import _ACK, _ACK_INDEX, _PUBLISH_INDEX, _decode_method, _fast_publish
from pepsi.amqp.wire.properties import _check_properties
from pepsi.amqp.wire.protocol import (
    BASIC_CLASS_ID,
    FRAME_BODY,
    FRAME_END,
    FRAME_HEADER,
    FRAME_HEARTBEAT,
    FRAME_METHOD,
    FRAME_MIN_SIZE,
    PROTOCOL_HEADER,
    PROTOCOL_HEADER_0_9,
)
from pepsi.amqp.wire.replies import (
    FatalFrameError,
    FrameError,
    FrameFormatError,
    FrameSyntaxError,
    FrameTooLarge,
    ProtocolHeaderMismatch,
    UnexpectedFrame,
)
from pepsi.amqp.wire.tables import _Malformed

# A frame's header (type, channel, payload size) and a content header's fixed fields
# (class, weight, body size). Defined here and in the writer, not imported: CPython 3.11
# compiles a method call on an imported name (`_FRAME_HEAD.unpack_from(...)`) without
# LOAD_METHOD, a bound method made per call on the hot path.
_FRAME_HEAD = struct.Struct(">BHI")
_CONTENT_HEAD = struct.Struct(">HHQ")

PUBLISH_CACHE: Final = 64  # decoded basic.publish methods a reader keeps
_METHOD_HEAD = struct.Struct(">BHII")  # frame type, channel, size, class and method ids
# frame type, channel, size, then the content header's class, weight and body size
_HEADER_HEAD = struct.Struct(">BHIHHQ")

# A whole basic.ack frame: type, channel, size, class and method ids, tag, bits, frame end.
_ACK_FRAME: Final = struct.Struct(">BHIIQBB")


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
