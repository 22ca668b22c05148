"""The AMQP publish fast paths give what the general paths give, errors included."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable
from typing import Any

import pika.frame
import pika.spec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import commands

from pepsi.amqp.broker.catalogue import Queue, VhostView
from pepsi.amqp.broker.publish.publishing import plain_stages
from pepsi.amqp.broker.publish.units import Item, Unit
from pepsi.amqp.model.queues import QueueDeclaration
from pepsi.amqp.wire import methods, properties, replies, tables, writer
from pepsi.amqp.wire.assembler import ContentAssembler
from pepsi.amqp.wire.frames import BodyFrame, Content, MethodFrame, RawContentHeader
from pepsi.amqp.wire.properties import _check_properties, _properties_fast_ok
from pepsi.amqp.wire.reader import FrameReader
from pepsi.publishing.message import Row

PUBLISH_FIELDS = ("ticket", "exchange", "routing_key", "mandatory", "immediate")
shortstr = st.text(max_size=80).filter(lambda s: len(s.encode()) <= 255)


def publish_payload(ticket: int, exchange: bytes, key: bytes, bits: int) -> bytes:
    return (
        struct.pack(">IH", commands.Basic.Publish.index, ticket)
        + bytes([len(exchange)])
        + exchange
        + bytes([len(key)])
        + key
        + bytes([bits])
    )


def outcome(decode: Callable[[], Any]) -> tuple[Any, ...]:
    """What a decode gives, comparable across paths: the fields, or the error."""
    try:
        frame = decode()
    except replies.FrameError as error:
        return ("error", type(error), error.reply_code, error.text, error.fatal,
                error.channel, error.class_id, error.method_id)  # fmt: skip
    method = frame.method
    return ("ok", type(method), *((name, getattr(method, name)) for name in method.__slots__))


def slow_method(channel: int, payload: bytes, monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as m:
        m.setattr(methods, "_fast_publish", lambda _: None)
        return methods._decode_method(channel, payload)


@given(
    ticket=st.integers(0, 0xFFFF),
    exchange=shortstr,
    key=shortstr,
    bits=st.integers(0, 255),
    channel=st.integers(1, 0xFFFF),
)
def test_fast_publish_matches_pamqp(
    ticket: int, exchange: str, key: str, bits: int, channel: int
) -> None:
    payload = publish_payload(ticket, exchange.encode(), key.encode(), bits)
    fast = methods._fast_publish(payload)
    assert fast is not None
    slow = commands.Basic.Publish()
    slow.unmarshal(payload[4:])
    for name in PUBLISH_FIELDS:
        assert getattr(fast, name) == getattr(slow, name), name
        assert type(getattr(fast, name)) is type(getattr(slow, name)), name
    frame = methods._decode_method(channel, payload)
    assert isinstance(frame.method, commands.Basic.Publish)
    assert frame.channel == channel
    assert frame.has_content


@given(tail=st.binary(max_size=40), channel=st.integers(1, 5))
def test_publish_bad_or_odd_payloads_decode_as_the_general_path(tail: bytes, channel: int) -> None:
    payload = struct.pack(">I", commands.Basic.Publish.index) + tail
    with pytest.MonkeyPatch.context() as m:
        fast = outcome(lambda: methods._decode_method(channel, payload))
        slow = outcome(lambda: slow_method(channel, payload, m))
    assert fast == slow


@given(
    exchange=st.binary(max_size=20),
    key=st.binary(max_size=20),
    bits=st.integers(0, 255),
    cut=st.integers(-3, 3),
)
def test_publish_length_and_utf8_errors_match(
    exchange: bytes, key: bytes, bits: int, cut: int
) -> None:
    """Shortened, lengthened, or not UTF-8: the same result or the same FrameError."""
    payload = publish_payload(0, exchange, key, bits)
    payload = payload[:cut] if cut < 0 else payload + b"\x00" * cut
    with pytest.MonkeyPatch.context() as m:
        fast = outcome(lambda: methods._decode_method(1, payload))
        slow = outcome(lambda: slow_method(1, payload, m))
    assert fast == slow


def property_outcome(check: Callable[[bytes], None], raw: bytes) -> tuple[Any, ...]:
    try:
        check(raw)
    except tables._Malformed as error:
        return ("malformed", str(error))
    return ("ok",)


def slow_check(raw: bytes) -> None:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(properties, "_properties_fast_ok", lambda _: False)
        _check_properties(raw)


@given(flags=st.integers(0, 0xFFFF), rest=st.binary(max_size=60))
def test_property_check_matches_the_walker(flags: int, rest: bytes) -> None:
    raw = struct.pack(">H", flags) + rest
    assert property_outcome(_check_properties, raw) == property_outcome(slow_check, raw)
    if _properties_fast_ok(raw):
        slow_check(raw)  # the fast path only ever says yes to what the walker accepts


@given(
    content_type=st.none() | st.binary(max_size=40),
    delivery_mode=st.none() | st.integers(0, 255),
    priority=st.none() | st.integers(0, 255),
    message_id=st.none() | st.binary(max_size=40),
    timestamp=st.none() | st.integers(0, 2**63),
)
def test_property_check_accepts_valid_lists(
    content_type: bytes | None,
    delivery_mode: int | None,
    priority: int | None,
    message_id: bytes | None,
    timestamp: int | None,
) -> None:
    flags, parts = 0, []
    if content_type is not None:
        flags |= 1 << 15
        parts.append(bytes([len(content_type)]) + content_type)
    if delivery_mode is not None:
        flags |= 1 << 12
        parts.append(bytes([delivery_mode]))
    if priority is not None:
        flags |= 1 << 11
        parts.append(bytes([priority]))
    if message_id is not None:
        flags |= 1 << 7
        parts.append(bytes([len(message_id)]) + message_id)
    if timestamp is not None:
        flags |= 1 << 6
        parts.append(struct.pack(">Q", timestamp))
    raw = struct.pack(">H", flags) + b"".join(parts)
    assert _properties_fast_ok(raw)
    _check_properties(raw)
    slow_check(raw)


def test_reader_publish_frames_as_before() -> None:
    """A whole publish through the reader and assembler (the fast paths end to end)."""
    publish = methods.build_method(
        commands.Basic.Publish, exchange="ex", routing_key="rk", mandatory=True
    )
    raw_props = commands.Basic.Properties(content_type="text/plain", delivery_mode=2).marshal()
    data = writer.encode_content(7, publish, raw_props, b"x" * 10_000, 4096)
    reader = FrameReader(4096, expect_protocol_header=False)
    assembler = ContentAssembler(7)
    results = [assembler.feed(frame) for frame in reader.feed(data)]  # type: ignore[arg-type]
    content = results[-1]
    assert isinstance(content, Content)
    assert all(r is None for r in results[:-1])
    method = content.method
    assert isinstance(method, commands.Basic.Publish)
    assert (method.exchange, method.routing_key, method.mandatory, method.immediate) == (
        "ex", "rk", True, False,
    )  # fmt: skip
    assert content.raw_properties == raw_props
    assert content.body == b"x" * 10_000


def test_row_field_order_is_what_the_broker_builds() -> None:
    """broker.BrokerChannel._item builds rows positionally, in this order."""
    assert Row._fields == (
        "stage", "message_id", "dedup", "sender", "recipients", "origin_user", "origin_peer",
        "header_from", "subject", "content_type", "correlation_id", "properties", "expires",
        "header", "body", "priority",
    )  # fmt: skip


def test_unit_counts_rows_and_size() -> None:
    def row(stage: str, body: bytes) -> Row:
        return Row(stage, None, False, None, None, None, None, None, None, None, None, None,
                   None, b"hh", body)  # fmt: skip

    items = [Item([row("a", b"12345"), row("b", b"1")]), Item([]), Item([row("c", b"")])]
    unit = Unit(items, lambda _items, _error: None)
    assert unit.rows == 3
    assert unit.size == sum(i.size for i in items) == 5 + 2 + 1 + 2 + 0 + 2


# --- a whole publish at once (FrameReader.take_publish) ------------------------------------

MAX_MESSAGE = 3000  # some publishes below are larger: the assembler refuses those


def _publish_wire(channel: int, body: bytes, props: pika.spec.BasicProperties) -> bytes:
    step = 1024 - 8  # frame_max 1024: a body over 1016 octets takes several frames
    return b"".join(
        [
            pika.frame.Method(channel, pika.spec.Basic.Publish(exchange="ex", routing_key="rk")).marshal(),
            pika.frame.Header(channel, len(body), props).marshal(),
            *(pika.frame.Body(channel, body[i : i + step]).marshal()
              for i in range(0, len(body), step)),
        ]
    )  # fmt: skip


_TRAFFIC = st.sampled_from(
    [
        _publish_wire(1, b"x" * 100, pika.spec.BasicProperties(delivery_mode=2)),
        _publish_wire(1, b"y" * 2500, pika.spec.BasicProperties(content_type="a/b")),
        _publish_wire(2, b"", pika.spec.BasicProperties(headers={"k": [1, "v"]})),
        _publish_wire(2, b"z" * 4000, pika.spec.BasicProperties()),  # over MAX_MESSAGE
        pika.frame.Method(1, pika.spec.Basic.Ack(7)).marshal(),
        pika.frame.Method(2, pika.spec.Basic.Ack(2**63 + 5, multiple=True)).marshal(),
        pika.frame.Method(3, pika.spec.Basic.Ack(1)).marshal(),  # a channel not open
        pika.frame.Heartbeat().marshal(),
        pika.frame.Body(1, b"stray").marshal(),
    ]
)


def _content(content: Content) -> tuple[Any, ...]:
    method = content.method
    fields = tuple(getattr(method, name) for name in PUBLISH_FIELDS)
    return ("content", content.channel, fields, content.raw_properties, content.body)


def _read(data: bytes, cuts: list[int], *, whole: bool) -> list[tuple[Any, ...]]:
    """What the reader and the channels' assemblers make of `data` fed in chunks; with
    `whole`, trying `take_publish` before each frame, as the connection does."""
    reader = FrameReader(1024, expect_protocol_header=False)
    assemblers = {n: ContentAssembler(n, max_message_size=MAX_MESSAGE) for n in (1, 2)}

    def accept(channel: int, body_size: int = 0) -> bool:
        assembler = assemblers.get(channel)
        return assembler is not None and assembler.idle and body_size <= MAX_MESSAGE

    out: list[tuple[Any, ...]] = []
    bounds = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    for start, stop in itertools.pairwise(bounds):
        reader.feed(data[start:stop])
        while True:
            try:
                content = reader.take_publish(accept) if whole else None
                if content is not None:
                    out.append(_content(content))
                    continue
                ack = reader.take_ack(accept) if whole else None
                if ack is not None:
                    out.append(("ack", *ack))
                    continue
                frame = reader.next_frame()
                if frame is None:
                    break
                if isinstance(frame, MethodFrame | RawContentHeader | BodyFrame):
                    if frame.channel not in assemblers:  # not open
                        out.append(("closed channel", frame.channel))
                        continue
                    result = assemblers[frame.channel].feed(frame)
                    if isinstance(result, Content):
                        out.append(_content(result))
                    elif result is not None and isinstance(result.method, commands.Basic.Ack):
                        ack_method = result.method
                        out.append(("ack", frame.channel, ack_method.delivery_tag,
                                    ack_method.multiple))  # fmt: skip
                    elif result is not None:
                        out.append(("method", frame.channel, type(result.method)))
                else:
                    out.append(("frame", type(frame)))
            except replies.FrameError as error:
                out.append(("error", type(error), error.text, error.fatal))
                if error.fatal:
                    return out
    return out


@settings(max_examples=300, deadline=None)
@given(
    frames=st.lists(_TRAFFIC, max_size=8),
    flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=20_000), max_size=12),
)
def test_whole_publishes_read_as_frame_by_frame(
    frames: list[bytes], flips: list[tuple[int, int]], cuts: list[int]
) -> None:
    data = bytearray(b"".join(frames))
    for position, value in flips:
        if data:
            data[position % len(data)] = value
    assert _read(bytes(data), cuts, whole=True) == _read(bytes(data), cuts, whole=False)


def test_take_publish_takes_only_whole_publishes() -> None:
    wire = _publish_wire(1, b"b" * 2000, pika.spec.BasicProperties(delivery_mode=2))
    reader = FrameReader(1024, expect_protocol_header=False)
    reader.feed(wire[:-1])
    assert reader.take_publish(lambda channel, size: True) is None  # the last octet is missing
    assert reader.buffered == len(wire) - 1  # nothing consumed
    reader.feed(wire[-1:])
    assert reader.take_publish(lambda channel, size: False) is None  # the channel declines
    content = reader.take_publish(lambda channel, size: (channel, size) == (1, 2000))
    assert content is not None
    assert content.body == b"b" * 2000
    assert reader.buffered == 0


# --- routes that take plain rows --------------------------------------------------------


def _view(arguments: dict[str, dict[str, object]]) -> VhostView:
    queues = {
        name: Queue(QueueDeclaration(name, arguments=args), f"amqp:/:{name}")
        for name, args in arguments.items()
    }
    return VhostView("/", {}, queues, ())


@pytest.mark.parametrize(
    "limited",
    [
        {"x-max-length": 10},
        {"x-max-length": 10, "x-overflow": "drop-head"},
        {"x-max-length-bytes": 1000},
        {"x-max-length-bytes": 1000, "x-overflow": "drop-head"},
        {"x-message-ttl": 1000},
    ],
)
def test_a_route_takes_plain_rows_only_without_limits_or_ttl(limited: dict[str, object]) -> None:
    view = _view({"a": {}, "b": {"x-queue-type": "classic"}, "c": limited})
    assert plain_stages(view, ["a", "b"]) == ("amqp:/:a", "amqp:/:b")
    assert plain_stages(view, ["a", "c"]) is None  # the general path checks each queue
    assert plain_stages(view, []) == ()
