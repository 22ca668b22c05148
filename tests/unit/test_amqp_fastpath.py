"""The AMQP publish fast paths give what the general paths give, errors included."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pamqp import commands

from pepsi.amqp import framing
from pepsi.amqp.publisher import Item, Unit
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
    except framing.FrameError as error:
        return ("error", type(error), error.reply_code, error.text, error.fatal,
                error.channel, error.class_id, error.method_id)  # fmt: skip
    method = frame.method
    return ("ok", type(method), *((name, getattr(method, name)) for name in method.__slots__))


def slow_method(channel: int, payload: bytes, monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as m:
        m.setattr(framing, "_fast_publish", lambda _: None)
        return framing._decode_method(channel, payload)


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
    fast = framing._fast_publish(payload)
    assert fast is not None
    slow = commands.Basic.Publish()
    slow.unmarshal(payload[4:])
    for name in PUBLISH_FIELDS:
        assert getattr(fast, name) == getattr(slow, name), name
        assert type(getattr(fast, name)) is type(getattr(slow, name)), name
    frame = framing._decode_method(channel, payload)
    assert isinstance(frame.method, commands.Basic.Publish)
    assert frame.channel == channel
    assert frame.has_content


@given(tail=st.binary(max_size=40), channel=st.integers(1, 5))
def test_publish_bad_or_odd_payloads_decode_as_the_general_path(tail: bytes, channel: int) -> None:
    payload = struct.pack(">I", commands.Basic.Publish.index) + tail
    with pytest.MonkeyPatch.context() as m:
        fast = outcome(lambda: framing._decode_method(channel, payload))
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
        fast = outcome(lambda: framing._decode_method(1, payload))
        slow = outcome(lambda: slow_method(1, payload, m))
    assert fast == slow


def property_outcome(check: Callable[[bytes], None], raw: bytes) -> tuple[Any, ...]:
    try:
        check(raw)
    except framing._Malformed as error:
        return ("malformed", str(error))
    return ("ok",)


def slow_check(raw: bytes) -> None:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(framing, "_properties_fast_ok", lambda _: False)
        framing._check_properties(raw)


@given(flags=st.integers(0, 0xFFFF), rest=st.binary(max_size=60))
def test_property_check_matches_the_walker(flags: int, rest: bytes) -> None:
    raw = struct.pack(">H", flags) + rest
    assert property_outcome(framing._check_properties, raw) == property_outcome(slow_check, raw)
    if framing._properties_fast_ok(raw):
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
    assert framing._properties_fast_ok(raw)
    framing._check_properties(raw)
    slow_check(raw)


def test_reader_publish_frames_as_before() -> None:
    """A whole publish through the reader and assembler (the fast paths end to end)."""
    publish = framing.build_method(
        commands.Basic.Publish, exchange="ex", routing_key="rk", mandatory=True
    )
    raw_props = commands.Basic.Properties(content_type="text/plain", delivery_mode=2).marshal()
    data = framing.encode_content(7, publish, raw_props, b"x" * 10_000, 4096)
    reader = framing.FrameReader(4096, expect_protocol_header=False)
    assembler = framing.ContentAssembler(7)
    results = [assembler.feed(frame) for frame in reader.feed(data)]  # type: ignore[arg-type]
    content = results[-1]
    assert isinstance(content, framing.Content)
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
        "header", "body",
    )  # fmt: skip


def test_unit_counts_rows_and_size() -> None:
    def row(stage: str, body: bytes) -> Row:
        return Row(stage, None, False, None, None, None, None, None, None, None, None, None,
                   None, b"hh", body)  # fmt: skip

    items = [Item([row("a", b"12345"), row("b", b"1")]), Item([]), Item([row("c", b"")])]
    unit = Unit(items, lambda _items, _error: None)
    assert unit.rows == 3
    assert unit.size == sum(i.size for i in items) == 5 + 2 + 1 + 2 + 0 + 2
