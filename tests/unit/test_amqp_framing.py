"""The AMQP 0-9-1 wire codec (pepsi.amqp.wire: reader, writer...): real pika traffic, partial feeds,
body splitting, raw properties byte for byte, each error's reply code, and random bytes."""

from __future__ import annotations

import decimal
import itertools
import struct
import time

import pika.frame
import pika.spec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands

from pepsi.amqp.wire.assembler import DEFAULT_MAX_MESSAGE_SIZE, LARGE_BODY, ContentAssembler
from pepsi.amqp.wire.frames import (
    BodyFrame,
    Content,
    HeartbeatFrame,
    MethodFrame,
    ProtocolHeaderFrame,
    RawContentHeader,
)
from pepsi.amqp.wire.methods import build_method
from pepsi.amqp.wire.properties import decode_properties, encode_properties
from pepsi.amqp.wire.protocol import FRAME_MIN_SIZE, PROTOCOL_HEADER
from pepsi.amqp.wire.reader import FrameReader
from pepsi.amqp.wire.replies import (
    FatalFrameError,
    FrameError,
    FrameFormatError,
    FrameSyntaxError,
    FrameTooLarge,
    MessageTooLarge,
    MethodNotImplemented,
    ProtocolHeaderMismatch,
    UnexpectedFrame,
)
from pepsi.amqp.wire.tables import MAX_TABLE_DEPTH, MAX_TABLE_ITEMS
from pepsi.amqp.wire.writer import (
    HEARTBEAT,
    encode_content,
    encode_deliver,
    encode_deliver_fields,
    encode_frame,
    encode_method,
    routing_fields,
)
from pepsi.amqp.wire.writer import shortstr as amqp_shortstr

# --- helpers ----------------------------------------------------------------------------


def frame(frame_type: int, channel: int, payload: bytes, end: int = 0xCE) -> bytes:
    return struct.pack(">BHI", frame_type, channel, len(payload)) + payload + bytes([end])


def method_payload(class_id: int, method_id: int, args: bytes = b"") -> bytes:
    return struct.pack(">HH", class_id, method_id) + args


def shortstr(text: bytes) -> bytes:
    return bytes([len(text)]) + text


def longstr(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def header_payload(body_size: int, raw_properties: bytes, class_id: int = 60) -> bytes:
    return struct.pack(">HHQ", class_id, 0, body_size) + raw_properties


def read_all(data: bytes, **kwargs: int) -> list[object]:
    reader = FrameReader(**kwargs)  # type: ignore[arg-type]
    return list(reader.feed(data))


def pika_publish(
    channel: int, body: bytes, props: pika.spec.BasicProperties, frame_max: int
) -> bytes:
    """What pika puts on the wire for basic_publish (method, header, body split by frame_max)."""
    out = [
        pika.frame.Method(
            channel, pika.spec.Basic.Publish(exchange="ex", routing_key="rk")
        ).marshal(),
        pika.frame.Header(channel, len(body), props).marshal(),
    ]
    step = frame_max - 8
    out += [
        pika.frame.Body(channel, body[i : i + step]).marshal() for i in range(0, len(body), step)
    ]
    return b"".join(out)


def feed_all(
    assembler: ContentAssembler, frames: list[MethodFrame | RawContentHeader | BodyFrame]
) -> None:
    for item in frames:
        assembler.feed(item)


def assemble(frames: list[object], channel: int = 1) -> list[object]:
    assembler = ContentAssembler(channel)
    out = []
    for item in frames:
        if isinstance(item, (MethodFrame, RawContentHeader, BodyFrame)) and item.channel == channel:
            result = assembler.feed(item)
            if result is not None:
                out.append(result)
    return out


# A client's opening: protocol header, then pika-encoded handshake methods.
START_OK = pika.frame.Method(
    0,
    pika.spec.Connection.StartOk(
        client_properties={"product": "pika", "capabilities": {"basic.nack": True}, "n": 7},
        mechanism="PLAIN",
        response="\0guest\0guest",
        locale="en_US",
    ),
).marshal()
TUNE_OK = pika.frame.Method(0, pika.spec.Connection.TuneOk(2047, 131072, 60)).marshal()
OPEN = pika.frame.Method(0, pika.spec.Connection.Open("/")).marshal()
CHANNEL_OPEN = pika.frame.Method(1, pika.spec.Channel.Open()).marshal()
QUEUE_DECLARE = pika.frame.Method(
    1,
    pika.spec.Queue.Declare(
        queue="q-1", durable=True, arguments={"x-queue-type": "quorum", "x-max-length": 10}
    ),
).marshal()
OPENING = PROTOCOL_HEADER + START_OK + TUNE_OK + OPEN + CHANNEL_OPEN + QUEUE_DECLARE


# --- reading real client traffic --------------------------------------------------------


def test_pika_handshake_decodes() -> None:
    frames = read_all(OPENING)
    assert frames[0] == ProtocolHeaderFrame((0, 9, 1))
    methods = [f for f in frames[1:] if isinstance(f, MethodFrame)]
    assert len(methods) == 5
    start_ok, tune_ok, open_, channel_open, declare = (m.method for m in methods)
    assert isinstance(start_ok, commands.Connection.StartOk)
    assert start_ok.mechanism == "PLAIN"
    assert start_ok.client_properties["capabilities"] == {"basic.nack": True}
    assert isinstance(tune_ok, commands.Connection.TuneOk)
    assert (tune_ok.channel_max, tune_ok.frame_max, tune_ok.heartbeat) == (2047, 131072, 60)
    assert isinstance(open_, commands.Connection.Open)
    assert open_.virtual_host == "/"
    assert isinstance(channel_open, commands.Channel.Open)
    assert isinstance(declare, commands.Queue.Declare)
    assert declare.queue == "q-1"
    assert declare.durable
    assert not declare.exclusive
    assert declare.arguments == {"x-queue-type": "quorum", "x-max-length": 10}
    assert [m.channel for m in methods] == [0, 0, 0, 1, 1]


def test_byte_by_byte_gives_the_same_frames() -> None:
    props = pika.spec.BasicProperties(content_type="text/plain", delivery_mode=2, headers={"a": 1})
    data = OPENING + pika_publish(1, b"x" * 10_000, props, 4096) + HEARTBEAT
    whole = [(type(f), f.channel) for f in read_all(data)]
    reader = FrameReader()
    one_by_one = []
    for i in range(len(data)):
        one_by_one += [(type(f), f.channel) for f in reader.feed(data[i : i + 1])]
        assert reader.buffered <= 4096 + 8
    assert one_by_one == whole
    assert whole[-1] == (HeartbeatFrame, 0)
    assert reader.buffered == 0


def test_pika_publish_assembles_into_content() -> None:
    body = bytes(range(256)) * 100  # 25 600 octets: 7 frames at frame_max 4096
    props = pika.spec.BasicProperties(
        content_type="application/json",
        delivery_mode=2,
        priority=3,
        correlation_id="c-1",
        reply_to="amq.rabbitmq.reply-to",
        expiration="60000",
        message_id="m-1",
        timestamp=1_700_000_000,
        type="t",
        user_id="guest",
        app_id="app",
        headers={"x-retry": 2, "trace": "abc"},
    )
    wire = pika_publish(5, body, props, FRAME_MIN_SIZE)
    frames = read_all(wire, expect_protocol_header=False)
    assert sum(isinstance(f, BodyFrame) for f in frames) == 7
    (content,) = assemble(frames, channel=5)
    assert isinstance(content, Content)
    assert isinstance(content.method, commands.Basic.Publish)
    assert (content.method.exchange, content.method.routing_key) == ("ex", "rk")
    assert content.body == body
    assert content.header.body_size == len(body)
    # The raw properties are exactly pika's bytes (its header frame minus 12 + 7 octets).
    pika_header = pika.frame.Header(5, len(body), props).marshal()
    assert content.raw_properties == pika_header[7 + 12 : -1]
    decoded = content.header.properties
    assert decoded.content_type == "application/json"
    assert decoded.delivery_mode == 2
    assert decoded.priority == 3
    assert decoded.headers == {"x-retry": 2, "trace": "abc"}
    assert decoded.message_type == "t"


def test_0_9_protocol_header_is_accepted_as_rabbitmq_does() -> None:
    frames = read_all(b"AMQP\x01\x01\x00\x09" + START_OK)
    assert frames[0] == ProtocolHeaderFrame((0, 9, 0))
    assert isinstance(frames[1], MethodFrame)


@pytest.mark.parametrize(
    "data",
    [
        b"AMQP\x00\x00\x09\x02",  # another revision
        b"AMQP\x01\x01\x08\x00",  # 0-8 (RabbitMQ 4 refuses it too)
        b"AMQP\x03\x01\x00\x00",  # AMQP 1.0 SASL
        b"GET / HTTP/1.1\r\n",  # refused at the first octet, without waiting for 8
        b"\x16\x03\x01",  # a TLS client hello
        b"amqp",
    ],
)
def test_protocol_header_mismatch_is_answered_with_0_9_1(data: bytes) -> None:
    reader = FrameReader()
    with pytest.raises(ProtocolHeaderMismatch) as caught:
        list(reader.feed(data))
    assert caught.value.answer == b"AMQP\x00\x00\x09\x01"
    assert caught.value.fatal
    assert caught.value.received == data[:8]
    with pytest.raises(ProtocolHeaderMismatch):  # stays failed
        list(reader.feed(PROTOCOL_HEADER))


def test_partial_protocol_header_waits() -> None:
    reader = FrameReader()
    assert list(reader.feed(b"AMQP\x00")) == []
    assert list(reader.feed(b"\x00\x09\x01")) == [ProtocolHeaderFrame((0, 9, 1))]


# --- frame sizes ------------------------------------------------------------------------


def test_frame_max_bounds_the_payload_with_rabbitmqs_allowance() -> None:
    ok = frame(3, 1, b"b" * 4096)  # payload == frame_max: RabbitMQ tolerates the off-by-8
    assert read_all(ok, expect_protocol_header=False) == [BodyFrame(1, b"b" * 4096)]
    reader = FrameReader(expect_protocol_header=False)
    with pytest.raises(FrameTooLarge) as caught:
        # Refused on the 7-octet frame header alone: nothing of the payload is buffered.
        list(reader.feed(struct.pack(">BHI", 3, 1, 4097)))
    assert caught.value.reply_code == 501
    assert caught.value.fatal
    assert caught.value.channel == 1


def test_negotiated_frame_max_and_no_limit() -> None:
    big = frame(3, 1, b"b" * 100_000)
    reader = FrameReader(expect_protocol_header=False)
    reader.frame_max = 131_072
    assert len(list(reader.feed(big))) == 1
    assert len(read_all(big, frame_max=0, expect_protocol_header=False)) == 1
    with pytest.raises(ValueError):
        reader.frame_max = -1


def test_bad_frame_end_is_fatal() -> None:
    reader = FrameReader(expect_protocol_header=False)
    with pytest.raises(FatalFrameError) as caught:
        list(reader.feed(frame(1, 0, method_payload(10, 51), end=0)))
    assert caught.value.reply_code == 501
    with pytest.raises(FatalFrameError):
        list(reader.feed(HEARTBEAT))


# --- errors and their reply codes ---------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "error", "code"),
    [
        (frame(9, 0, b""), FrameFormatError, 501),  # unknown frame type
        (frame(8, 0, b"x"), FrameFormatError, 501),  # heartbeat with a payload
        (frame(8, 3, b""), UnexpectedFrame, 505),  # heartbeat on a channel
        (frame(1, 0, b"\x00\x0a"), FrameFormatError, 501),  # method shorter than its ids
        (frame(1, 0, method_payload(10, 99)), MethodNotImplemented, 540),
        (frame(1, 0, method_payload(99, 10)), MethodNotImplemented, 540),
        (frame(1, 0, method_payload(10, 31, b"\x00\x01")), FrameFormatError, 501),  # truncated
        (frame(1, 0, method_payload(10, 51, b"extra")), FrameFormatError, 501),  # trailing
        (
            frame(1, 1, method_payload(20, 40, b"\x00\x01\xffbad" + b"\x00" * 4)),
            FrameFormatError,
            501,
        ),
        (frame(2, 0, header_payload(0, b"\x00\x00")), UnexpectedFrame, 505),  # header on ch 0
        (frame(3, 0, b"body"), UnexpectedFrame, 505),  # body on channel 0
        (frame(2, 1, header_payload(0, b"\x00\x00", class_id=50)), UnexpectedFrame, 505),
        (frame(2, 1, b"\x00\x3c\x00\x00"), FrameFormatError, 501),  # header too short
        (frame(2, 1, header_payload(0, b"\x80\x00\x05ab")), FrameSyntaxError, 502),  # cut
        (frame(2, 1, header_payload(0, b"\x00\x00junk")), FrameSyntaxError, 502),  # trailing
        (frame(2, 1, header_payload(0, b"\x20\x00" + longstr(b"\x01kZ"))), FrameSyntaxError, 502),
    ],
)
def test_each_error_has_rabbitmqs_reply_code(
    data: bytes, error: type[FrameError], code: int
) -> None:
    reader = FrameReader(expect_protocol_header=False)
    with pytest.raises(error) as caught:
        list(reader.feed(data))
    assert caught.value.reply_code == code
    assert caught.value.hard
    assert not caught.value.fatal
    # Frame boundaries are intact: the reader goes on (the server waits for close-ok).
    close_ok = frame(1, 0, method_payload(10, 51))
    (after,) = list(reader.feed(close_ok))
    assert isinstance(after, MethodFrame)
    assert isinstance(after.method, commands.Connection.CloseOk)


def test_frames_before_an_error_are_delivered_first() -> None:
    reader = FrameReader(expect_protocol_header=False)
    got: list[object] = []
    data = HEARTBEAT + CHANNEL_OPEN + frame(1, 1, method_payload(60, 999))
    with pytest.raises(MethodNotImplemented) as caught:
        got.extend(reader.feed(data))
    assert [type(f) for f in got] == [HeartbeatFrame, MethodFrame]
    assert (caught.value.channel, caught.value.class_id, caught.value.method_id) == (1, 60, 999)


def test_continuation_flag_bit_is_ignored_like_rabbitmq() -> None:
    # pamqp alone loops forever on this (it never advances past the first flag word).
    raw = b"\x10\x01\x02"  # delivery_mode present, continuation bit set
    (header,) = read_all(frame(2, 1, header_payload(0, raw)), expect_protocol_header=False)
    assert isinstance(header, RawContentHeader)
    assert header.raw_properties == raw
    assert header.properties.delivery_mode == 2


def test_field_array_overrunning_its_frame_is_a_frame_error() -> None:
    # queue.declare whose arguments hold an array announcing 100 octets it does not have:
    # pamqp alone loops forever here.
    table = shortstr(b"a") + b"A" + struct.pack(">I", 100)
    args = b"\x00\x00" + shortstr(b"q") + b"\x00" + longstr(table)
    with pytest.raises(FrameFormatError, match="overruns"):
        read_all(frame(1, 1, method_payload(50, 10, args)), expect_protocol_header=False)


def test_table_nesting_and_item_limits() -> None:
    def declare(arguments: bytes) -> bytes:
        return frame(
            1,
            1,
            method_payload(50, 10, b"\x00\x00" + shortstr(b"q") + b"\x00" + longstr(arguments)),
        )

    nested = b""
    for _ in range(MAX_TABLE_DEPTH):
        nested = shortstr(b"k") + b"F" + longstr(nested)
    with pytest.raises(FrameFormatError, match="nested"):
        read_all(declare(nested), frame_max=0, expect_protocol_header=False)
    many = b"".join(shortstr(b"k%d" % i) + b"V" for i in range(MAX_TABLE_ITEMS + 1))
    with pytest.raises(FrameFormatError, match="items"):
        read_all(declare(many), frame_max=0, expect_protocol_header=False)
    ok = b"".join(shortstr(b"k%d" % i) + b"V" for i in range(MAX_TABLE_ITEMS))
    (declared,) = read_all(declare(ok), frame_max=0, expect_protocol_header=False)
    assert isinstance(declared, MethodFrame)
    assert len(declared.method.arguments) == MAX_TABLE_ITEMS


def test_worst_table_within_limits_decodes_quickly() -> None:
    # MAX_TABLE_ITEMS items in front of a payload filling a 128 KiB frame: pamqp copies
    # the rest of the payload per item, so this is its worst case within the limits.
    items = b"".join(shortstr(b"") + b"V" for _ in range(MAX_TABLE_ITEMS - 1))
    padding = shortstr(b"p") + b"S" + longstr(b"z" * 125_000)
    args = b"\x00\x00" + shortstr(b"q") + b"\x00" + longstr(items + padding)
    data = frame(1, 1, method_payload(50, 10, args))
    started = time.perf_counter()
    read_all(data, frame_max=131_072, expect_protocol_header=False)
    assert time.perf_counter() - started < 1.0  # measured ~10-20 ms


# --- raw properties byte for byte -------------------------------------------------------


def test_raw_properties_survive_where_pamqp_would_rewrite_them() -> None:
    # Keys out of order, integer widths pamqp would not pick ('b' 5 is fine, 'l' 5 and 's'
    # 300 are not), a double, a decimal with trailing zeros, an array, a byte array,
    # a void and a millisecond timestamp.
    headers = b"".join(
        [
            shortstr(b"zeta") + b"l" + struct.pack(">q", 5),
            shortstr(b"alpha") + b"s" + struct.pack(">h", 300),
            shortstr(b"beta") + b"b" + struct.pack(">b", -3),
            shortstr(b"dbl") + b"d" + struct.pack(">d", 0.1),
            shortstr(b"dec") + b"D" + struct.pack(">Bi", 3, 1500),
            shortstr(b"arr") + b"A" + longstr(b"I" + struct.pack(">i", 1) + b"S" + longstr(b"two")),
            shortstr(b"bin") + b"x" + longstr(b"\xff\x00"),
            shortstr(b"nil") + b"V",
            shortstr(b"ts") + b"T" + struct.pack(">Q", 1_700_000_000_123),
        ]
    )
    raw = b"\xa0\x00" + shortstr(b"text/plain") + longstr(headers)  # content_type, headers
    wire = frame(
        1, 1, method_payload(60, 40, b"\x00\x00" + shortstr(b"") + shortstr(b"q") + b"\x00")
    )
    wire += frame(2, 1, header_payload(3, raw)) + frame(3, 1, b"abc")
    (content,) = assemble(read_all(wire, expect_protocol_header=False))
    assert isinstance(content, Content)
    assert content.raw_properties == raw
    decoded = content.header.properties
    assert decoded.headers is not None
    assert decoded.headers["zeta"] == 5
    assert decoded.headers["dec"] == decimal.Decimal("1.500")
    assert decoded.headers["arr"] == [1, "two"]
    try:
        reencoded: bytes | None = encode_properties(decoded)
    except struct.error:  # pamqp 3.3.0 packs -128..-1 as 'b' with an unsigned packer
        reencoded = None
    assert reencoded != raw  # pamqp's re-encoding is lossy (or fails)...
    without_negative = commands.Basic.Properties(
        headers={k: v for k, v in decoded.headers.items() if k != "beta"}
    )
    assert shortstr(b"zeta") + b"l" not in encode_properties(without_negative)  # 'l' 5 → 'b' 5
    # ...so forwarding uses the raw octets, unchanged.
    out = encode_content(1, build_method(commands.Basic.Deliver, consumer_tag="c", delivery_tag=1,
                                         exchange="", routing_key="q"), content.raw_properties, content.body, 4096)  # fmt: skip
    (forwarded,) = assemble(read_all(out, expect_protocol_header=False))
    assert isinstance(forwarded, Content)
    assert forwarded.raw_properties == raw
    assert forwarded.body == b"abc"


def test_undecodable_property_values_are_syntax_errors_on_use() -> None:
    raw = b"\x80\x00" + shortstr(b"\xff\xfe")  # content_type that is not UTF-8
    (header,) = read_all(frame(2, 1, header_payload(0, raw)), expect_protocol_header=False)
    assert isinstance(header, RawContentHeader)
    with pytest.raises(FrameSyntaxError) as caught:
        _ = header.properties
    assert caught.value.reply_code == 502
    with pytest.raises(FrameSyntaxError):
        decode_properties(b"\x80")


# --- content assembly -------------------------------------------------------------------

PUBLISH = MethodFrame(1, commands.Basic.Publish(exchange="", routing_key="q"))
PROPS = b"\x10\x00\x02"  # delivery_mode 2


def test_assembler_passes_plain_methods_through_and_handles_empty_bodies() -> None:
    assembler = ContentAssembler(1)
    ack = MethodFrame(1, commands.Basic.Ack(delivery_tag=1))
    assert assembler.feed(ack) is ack
    assert assembler.feed(PUBLISH) is None
    assert not assembler.idle
    content = assembler.feed(RawContentHeader(1, 0, PROPS))
    assert isinstance(content, Content)
    assert content.body == b""
    assert assembler.idle


def test_a_large_body_is_assembled_off_the_heap_and_whole() -> None:
    """A body of LARGE_BODY or more goes into anonymous memory of its own (given back
    when the content is done or dropped); it comes out the same as a small one's."""
    body = bytes(range(256)) * (LARGE_BODY // 256 + 3)
    assembler = ContentAssembler(1)
    assert assembler.feed(PUBLISH) is None
    assert assembler.feed(RawContentHeader(1, len(body), PROPS)) is None
    for at in range(0, len(body), 131_064):
        result = assembler.feed(BodyFrame(1, body[at : at + 131_064]))
    assert isinstance(result, Content)
    assert result.body == body
    assert assembler.idle
    assembler.feed(PUBLISH)
    assembler.feed(RawContentHeader(1, len(body), PROPS))
    assembler.feed(BodyFrame(1, body[:10]))
    assembler.reset()  # dropped half-way: nothing is kept
    assert assembler.idle


@pytest.mark.parametrize(
    ("frames", "error", "code"),
    [
        ([RawContentHeader(1, 1, PROPS)], UnexpectedFrame, 505),
        ([BodyFrame(1, b"x")], UnexpectedFrame, 505),
        ([PUBLISH, BodyFrame(1, b"x")], UnexpectedFrame, 505),
        ([PUBLISH, PUBLISH], UnexpectedFrame, 505),
        ([PUBLISH, RawContentHeader(1, 2, PROPS), PUBLISH], UnexpectedFrame, 505),
        (
            [PUBLISH, RawContentHeader(1, 2, PROPS), RawContentHeader(1, 2, PROPS)],
            UnexpectedFrame,
            505,
        ),
        ([PUBLISH, RawContentHeader(1, 2, PROPS), BodyFrame(1, b"xyz")], FrameFormatError, 501),
        ([PUBLISH, RawContentHeader(1, DEFAULT_MAX_MESSAGE_SIZE + 1, PROPS)], MessageTooLarge, 406),
    ],
)
def test_assembler_errors(
    frames: list[MethodFrame | RawContentHeader | BodyFrame], error: type[FrameError], code: int
) -> None:
    assembler = ContentAssembler(1)
    with pytest.raises(error) as caught:
        feed_all(assembler, frames)
    assert caught.value.reply_code == code
    assert caught.value.channel == 1
    assert assembler.idle  # reset: the next method starts clean
    if isinstance(frames[0], MethodFrame) and len(frames) > 1:
        assert (caught.value.class_id, caught.value.method_id) == (60, 40)


def test_message_too_large_is_a_channel_error_with_a_configurable_limit() -> None:
    assembler = ContentAssembler(1, max_message_size=10)
    assembler.feed(PUBLISH)
    with pytest.raises(MessageTooLarge) as caught:
        assembler.feed(RawContentHeader(1, 11, PROPS))
    assert not caught.value.hard
    assembler.feed(PUBLISH)
    assembler.feed(RawContentHeader(1, 10, PROPS))
    assert isinstance(assembler.feed(BodyFrame(1, b"0123456789")), Content)
    with pytest.raises(ValueError):
        ContentAssembler(1, max_message_size=0)
    with pytest.raises(ValueError):
        ContentAssembler(1).feed(MethodFrame(2, commands.Basic.Ack()))


# --- writing ----------------------------------------------------------------------------


@pytest.mark.parametrize("frame_max", [4096, 131_072])
@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_bodies_split_exactly_at_frame_max_minus_8(frame_max: int, extra: int) -> None:
    step = frame_max - 8
    body = b"\x5a" * (3 * step + extra)
    deliver = build_method(
        commands.Basic.Deliver, consumer_tag="ctag", delivery_tag=7, exchange="", routing_key="q"
    )
    wire = encode_content(2, deliver, PROPS, body, frame_max)
    frames = read_all(wire, frame_max=frame_max, expect_protocol_header=False)
    sizes = [len(f.payload) for f in frames if isinstance(f, BodyFrame)]
    expected = {-1: [step, step, step - 1], 0: [step, step, step], 1: [step, step, step, 1]}
    assert sizes == expected[extra]
    (content,) = assemble(frames, channel=2)
    assert isinstance(content, Content)
    assert content.body == body


def test_body_split_sizes_are_exact() -> None:
    deliver = build_method(
        commands.Basic.Deliver, consumer_tag="c", delivery_tag=1, exchange="", routing_key="q"
    )
    for length, expected in [
        (0, []),
        (1, [1]),
        (4088, [4088]),
        (4089, [4088, 1]),
        (8176, [4088, 4088]),
    ]:
        frames = read_all(
            encode_content(1, deliver, PROPS, b"b" * length, 4096), expect_protocol_header=False
        )
        assert [len(f.payload) for f in frames if isinstance(f, BodyFrame)] == expected
    unlimited = read_all(
        encode_content(1, deliver, PROPS, b"b" * 300_000, 0),
        frame_max=0,
        expect_protocol_header=False,
    )
    assert [len(f.payload) for f in unlimited if isinstance(f, BodyFrame)] == [300_000]
    with pytest.raises(ValueError):
        encode_content(1, deliver, PROPS, b"", 1000)


def test_server_frames_decode_in_pika() -> None:
    """What the server writes, pika's own decoder reads (and names pamqp would refuse)."""
    deliver = build_method(
        commands.Basic.Deliver,
        consumer_tag="ctag-ü",
        delivery_tag=2**63 + 5,  # unsigned 64-bit, which pamqp would pack signed
        redelivered=True,
        exchange="ex+ä" + "e" * 200,  # RabbitMQ allows this; pamqp's checks do not
        routing_key="rk",
    )
    wire = encode_content(3, deliver, PROPS, b"hello", 4096)
    offset = 0
    decoded = []
    while offset < len(wire):
        used, got = pika.frame.decode_frame(wire[offset:])
        assert got is not None
        decoded.append(got)
        offset += used
    method, header, body = decoded
    assert isinstance(method.method, pika.spec.Basic.Deliver)
    assert method.channel_number == 3
    assert method.method.delivery_tag == 2**63 + 5
    assert method.method.redelivered is True
    assert method.method.exchange == "ex+ä" + "e" * 200
    assert method.method.consumer_tag == "ctag-ü"
    assert header.body_size == 5
    assert header.properties.delivery_mode == 2
    assert body.fragment == b"hello"


@pytest.mark.parametrize(
    "method",
    [
        commands.Connection.Start(
            server_properties={"product": "Pepsi", "capabilities": {"publisher_confirms": True}},
            mechanisms="PLAIN AMQPLAIN",
            locales="en_US",
        ),
        commands.Connection.Tune(channel_max=2047, frame_max=131072, heartbeat=60),
        commands.Connection.Close(
            reply_code=501, reply_text="FRAME_ERROR - bad", class_id=0, method_id=0
        ),
        commands.Queue.DeclareOk(queue="q", message_count=3, consumer_count=1),
        commands.Basic.ConsumeOk(consumer_tag="amq.ctag-1"),
        commands.Basic.Nack(delivery_tag=9, multiple=True, requeue=False),
        commands.Exchange.Declare(exchange="e", exchange_type="topic", durable=True, internal=True),
        commands.Basic.Publish(exchange="e", routing_key="r", mandatory=True),
    ],
)
def test_encode_method_round_trips_through_pika_and_back(method: object) -> None:
    wire = encode_method(4, method)  # type: ignore[arg-type]
    used, pika_frame = pika.frame.decode_frame(wire)
    assert used == len(wire)
    assert method.index == pika_frame.method.INDEX  # type: ignore[attr-defined]
    (ours,) = read_all(wire, frame_max=0, expect_protocol_header=False)
    assert isinstance(ours, MethodFrame)
    for name in type(method).__slots__:
        assert getattr(ours.method, name) == getattr(method, name)
    # The same octets as pika's encoder for that method.
    assert pika_frame.marshal() == wire


def test_heartbeat_and_protocol_header_constants() -> None:
    assert read_all(HEARTBEAT, expect_protocol_header=False) == [HeartbeatFrame()]
    assert pika.frame.Heartbeat().marshal() == HEARTBEAT
    assert pika.frame.ProtocolHeader().marshal() == PROTOCOL_HEADER
    assert encode_frame(8, 0, b"") == HEARTBEAT


def test_build_method_rejects_unknown_fields() -> None:
    with pytest.raises(TypeError):
        build_method(commands.Basic.Ack, tag=1)


# --- random bytes -----------------------------------------------------------------------

FRAME_MAX_FUZZ = FRAME_MIN_SIZE


def _drive(reader: FrameReader, data: bytes, cuts: list[int]) -> None:
    """Feed `data` in chunks; only frames or FrameErrors may come out, and a pending frame
    never holds more than frame_max + 8 octets."""
    bounds = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    assemblers: dict[int, ContentAssembler] = {}
    try:
        for start, stop in itertools.pairwise(bounds):
            for item in reader.feed(data[start:stop]):
                assert isinstance(
                    item,
                    (ProtocolHeaderFrame, MethodFrame, RawContentHeader, BodyFrame, HeartbeatFrame),
                )
                if isinstance(item, RawContentHeader):
                    _ = item.properties  # may raise FrameSyntaxError, nothing else
                if isinstance(item, (MethodFrame, RawContentHeader, BodyFrame)):
                    assembler = assemblers.setdefault(item.channel, ContentAssembler(item.channel))
                    assembler.feed(item)
            assert reader.buffered <= max(reader.frame_max + 8, 8)
    except FrameError:
        pass


_VALID_FRAMES = st.sampled_from(
    [
        START_OK,
        TUNE_OK,
        CHANNEL_OPEN,
        QUEUE_DECLARE,
        HEARTBEAT,
        pika_publish(
            1, b"x" * 5000, pika.spec.BasicProperties(headers={"k": [1, "v", {"n": None}]}), 4096
        ),
    ]
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.binary(max_size=3000),
    cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=20),
    with_header=st.booleans(),
)
def test_random_bytes_give_frames_or_frame_errors(
    data: bytes, cuts: list[int], with_header: bool
) -> None:
    reader = FrameReader(FRAME_MAX_FUZZ)
    _drive(reader, (PROTOCOL_HEADER if with_header else b"") + data, cuts)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    frames=st.lists(_VALID_FRAMES, max_size=6),
    flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=20_000), max_size=20),
)
def test_mutated_real_traffic_gives_frames_or_frame_errors(
    frames: list[bytes], flips: list[tuple[int, int]], cuts: list[int]
) -> None:
    data = bytearray(PROTOCOL_HEADER + b"".join(frames))
    for position, value in flips:
        data[position % len(data)] = value
    _drive(FrameReader(FRAME_MAX_FUZZ), bytes(data), cuts)


def _field_value(depth: int) -> st.SearchStrategy[bytes]:
    """Random field values in RabbitMQ's encoding (including types pamqp never writes)."""
    simple = st.one_of(
        st.builds(lambda v: b"t" + bytes([v]), st.integers(0, 255)),
        st.builds(lambda v: b"b" + struct.pack(">b", v), st.integers(-128, 127)),
        st.builds(lambda v: b"s" + struct.pack(">h", v), st.integers(-(2**15), 2**15 - 1)),
        st.builds(lambda v: b"l" + struct.pack(">q", v), st.integers(-(2**63), 2**63 - 1)),
        st.builds(lambda v: b"d" + struct.pack(">d", v), st.floats(allow_nan=False)),
        st.builds(
            lambda e, v: b"D" + struct.pack(">Bi", e, v),
            st.integers(0, 10),
            st.integers(-(2**31), 2**31 - 1),
        ),
        st.builds(lambda v: b"S" + longstr(v.encode()), st.text(max_size=20)),
        st.builds(lambda v: b"x" + longstr(v), st.binary(max_size=20)),
        st.just(b"V"),
    )
    if depth == 0:
        return simple
    inner = _field_value(depth - 1)
    return st.one_of(
        simple,
        st.builds(lambda items: b"A" + longstr(b"".join(items)), st.lists(inner, max_size=4)),
        st.builds(
            lambda items: b"F" + longstr(b"".join(shortstr(k.encode()) + v for k, v in items)),
            st.lists(st.tuples(st.text(max_size=8), inner), max_size=4),
        ),
    )


@settings(max_examples=200, deadline=None)
@given(
    entries=st.lists(st.tuples(st.text(min_size=1, max_size=10), _field_value(2)), max_size=8),
    body=st.binary(max_size=9000),
)
def test_random_headers_tables_are_forwarded_byte_for_byte(
    entries: list[tuple[str, bytes]], body: bytes
) -> None:
    table = b"".join(shortstr(k.encode()) + v for k, v in entries)
    raw = b"\x20\x00" + longstr(table)
    wire = frame(
        1, 1, method_payload(60, 40, b"\x00\x00" + shortstr(b"") + shortstr(b"q") + b"\x00")
    )
    header = frame(2, 1, header_payload(len(body), raw))
    step = FRAME_MIN_SIZE - 8
    bodies = b"".join(frame(3, 1, body[i : i + step]) for i in range(0, len(body), step))
    (content,) = assemble(read_all(wire + header + bodies, expect_protocol_header=False))
    assert isinstance(content, Content)
    assert content.raw_properties == raw
    assert content.body == body
    assert isinstance(content.header.properties.headers, dict)
    out = encode_content(1, content.method, content.raw_properties, content.body, FRAME_MIN_SIZE)
    assert out == wire + header + bodies


@pytest.mark.parametrize("size", [0, 1, 1024, 4088, 4089, 20000])
@pytest.mark.parametrize("frame_max", [0, 4096, 131072])
@pytest.mark.parametrize("redelivered", [False, True])
def test_a_delivery_packed_directly_is_what_pamqp_would_encode(
    size: int, frame_max: int, redelivered: bool
) -> None:
    """encode_deliver packs basic.deliver itself (the consuming hot path): the same octets
    as pamqp's method with encode_content, one body frame or split by frame_max."""
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    expected = encode_content(
        5,
        build_method(
            commands.Basic.Deliver, consumer_tag="ctag-é", delivery_tag=2**40 + 3,
            redelivered=redelivered, exchange="amq.topic", routing_key="a.b",
        ),
        PROPS, body, frame_max,
    )  # fmt: skip
    assert encode_deliver(
        5, consumer_tag="ctag-é", delivery_tag=2**40 + 3, redelivered=redelivered,
        exchange="amq.topic", routing_key="a.b", raw_properties=PROPS, body=body,
        frame_max=frame_max,
    ) == expected  # fmt: skip
    assert encode_deliver_fields(
        5, amqp_shortstr("ctag-é"), 2**40 + 3, redelivered, routing_fields("amq.topic", "a.b"),
        raw_properties=PROPS, body=body, frame_max=frame_max,
    ) == expected  # fmt: skip


def test_a_delivery_checks_frame_max_as_any_content_does() -> None:
    with pytest.raises(ValueError, match="below the minimum"):
        encode_deliver_fields(1, amqp_shortstr("c"), 1, False, routing_fields("", "q"),
                              raw_properties=PROPS, body=b"x", frame_max=100)  # fmt: skip
