"""The AMQP connection layer's pure decisions: tune, heartbeats, closes, the seam."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pamqp import commands

from pepsi.amqp.session.channels import Refusal, channel_open_problem
from pepsi.amqp.session.closing import Close, close_for
from pepsi.amqp.session.handler import (
    CHANNEL_METHODS,
    ChannelHandler,
    method_label,
    not_implemented,
)
from pepsi.amqp.session.negotiation import heartbeat_due, negotiate_tune, server_properties
from pepsi.amqp.wire import methods, protocol, replies, writer
from pepsi.amqp.wire.frames import MethodFrame
from pepsi.amqp.wire.reader import FrameReader
from pepsi.config import merge_overlay, parse_config
from pepsi.config.model import AmqpOptions, RawValue
from pepsi.errors import ConfigError

# -- tune ----------------------------------------------------------------------------------


def test_tune_takes_the_clients_values_within_ours() -> None:
    tuned = negotiate_tune(2047, 131072, 100, 65536, 30)
    assert (tuned.channel_max, tuned.frame_max, tuned.heartbeat) == (100, 65536, 30)


def test_zero_means_our_maximum_never_unbounded() -> None:
    tuned = negotiate_tune(2047, 131072, 0, 0, 0)
    assert (tuned.channel_max, tuned.frame_max, tuned.heartbeat) == (2047, 131072, 0)


@pytest.mark.parametrize(
    ("channel_max", "frame_max", "text"),
    [
        (2048, 131072, "channel_max = 2048 is higher than the maximum allowed value (2047)"),
        (10, 4095, "frame_max=4095 < 4096 min size"),
        (10, 131073, "frame_max=131073 > 131072 max size"),
    ],
)
def test_tune_ok_out_of_bounds_is_530(channel_max: int, frame_max: int, text: str) -> None:
    with pytest.raises(replies.AMQPConnectionError) as caught:
        negotiate_tune(2047, 131072, channel_max, frame_max, 60)
    assert caught.value.code == replies.NOT_ALLOWED
    assert text in caught.value.text
    assert (caught.value.class_id, caught.value.method_id) == (10, 31)  # connection.tune-ok


@given(
    st.integers(1, 65535), st.integers(4096, 2**32 - 1),
    st.integers(0, 65535), st.integers(0, 2**32 - 1), st.integers(0, 65535),
)  # fmt: skip
def test_an_accepted_tune_is_never_over_the_offer(
    offer_ch: int, offer_fr: int, ch: int, fr: int, hb: int
) -> None:
    try:
        tuned = negotiate_tune(offer_ch, offer_fr, ch, fr, hb)
    except replies.AMQPConnectionError as error:
        code = error.code
        assert code == replies.NOT_ALLOWED  # the only refusal there is
        return
    assert 1 <= tuned.channel_max <= offer_ch
    assert protocol.FRAME_MIN_SIZE <= tuned.frame_max <= offer_fr
    assert tuned.heartbeat == hb


# -- heartbeats ----------------------------------------------------------------------------


def test_a_heartbeat_goes_out_after_half_an_interval_of_silence() -> None:
    due = heartbeat_due(now=100.0, interval=10, last_sent=94.0, last_received=99.0)
    assert due.send
    assert not due.dead
    assert due.next_check == 105.0  # the next half interval after this send
    quiet = heartbeat_due(now=100.0, interval=10, last_sent=97.0, last_received=99.0)
    assert not quiet.send
    assert quiet.next_check == 102.0


def test_the_peer_is_dead_after_two_silent_intervals() -> None:
    assert heartbeat_due(now=120.0, interval=10, last_sent=119.0, last_received=100.0).dead
    alive = heartbeat_due(now=119.9, interval=10, last_sent=119.0, last_received=100.0)
    assert not alive.dead
    assert alive.next_check == pytest.approx(120.0)


def test_no_heartbeat_check_without_an_interval() -> None:
    with pytest.raises(ValueError, match="off"):
        heartbeat_due(now=1.0, interval=0, last_sent=0.0, last_received=0.0)


@given(
    st.floats(0, 1e6), st.integers(1, 600), st.floats(0, 1e6), st.floats(0, 1e6)
)  # fmt: skip
def test_the_next_check_is_never_in_the_past_unless_dead(
    now: float, interval: int, sent_ago: float, received_ago: float
) -> None:
    due = heartbeat_due(now, interval, now - sent_ago, now - received_ago)
    if not due.dead:
        assert due.next_check > now or due.next_check == pytest.approx(now)
        assert due.next_check <= now + interval / 2 + 1e-6


# -- closes --------------------------------------------------------------------------------


def test_a_fatal_frame_error_closes_the_connection_and_drops_the_socket() -> None:
    close = close_for(replies.FatalFrameError("bad frame end", channel=3))
    assert close == Close(0, 501, "FRAME_ERROR - bad frame end", drop=True)


def test_a_hard_frame_error_on_a_channel_closes_the_connection() -> None:
    error = replies.UnexpectedFrame("expected a content header", channel=2, class_id=60,
                                    method_id=40)  # fmt: skip
    close = close_for(error)
    assert (close.channel, close.code, close.drop) == (0, 505, False)
    assert (close.class_id, close.method_id) == (60, 40)


def test_a_soft_frame_error_closes_its_channel() -> None:
    error = replies.MessageTooLarge("message size 2 is larger than 1", channel=4, class_id=60,
                                    method_id=40)  # fmt: skip
    close = close_for(error)
    assert (close.channel, close.code, close.text) == (
        4, 406, "PRECONDITION_FAILED - message size 2 is larger than 1",
    )  # fmt: skip


def test_amqp_errors_close_what_their_kind_says() -> None:
    channel = close_for(replies.ChannelError(404, "no queue 'q' in vhost '/'", 50, 10), 7)
    assert (channel.channel, channel.text) == (7, "NOT_FOUND - no queue 'q' in vhost '/'")
    connection = close_for(replies.AMQPConnectionError(530, "vhost /x not found", 10, 40), 7)
    assert (connection.channel, connection.code) == (0, 530)
    on_zero = close_for(replies.ChannelError(406, "x"), 0)
    assert on_zero.channel == 0  # no channel to close: the connection goes


def test_channel_numbers() -> None:
    # as RabbitMQ: channel_max bounds the channels open at once, not their numbers
    assert channel_open_problem(2047, 0, already_open=False) is None
    assert channel_open_problem(2047, 2046, already_open=False) is None
    full = channel_open_problem(2047, 2047, already_open=False)
    assert full == Refusal(
        530, "number of channels opened (2047) has reached the negotiated channel_max (2047)"
    )
    assert channel_open_problem(2047, 3, already_open=True) == Refusal(
        504, "second 'channel.open' seen"
    )


def test_server_properties_announce_rabbitmqs_capabilities() -> None:
    properties = server_properties("1.2.3")
    assert properties["product"] == "Pepsi"
    assert properties["version"] == "1.2.3"
    assert set(properties["capabilities"]) == {
        "publisher_confirms", "exchange_exchange_bindings", "basic.nack",
        "consumer_cancel_notify", "connection.blocked", "authentication_failure_close",
        "per_consumer_qos",
    }  # fmt: skip
    # encodable as connection.start's table
    start = methods.build_method(commands.Connection.Start, version_major=0, version_minor=9,
                                 server_properties=properties, mechanisms="PLAIN AMQPLAIN",
                                 locales="en_US")  # fmt: skip
    frame = next(FrameReader(0, expect_protocol_header=False).feed(
        writer.encode_method(0, start)))  # fmt: skip
    assert isinstance(frame, MethodFrame)
    assert isinstance(frame.method, commands.Connection.Start)
    assert frame.method.server_properties["product"] == "Pepsi"


# -- the seam for the broker ---------------------------------------------------------------


def test_every_client_method_has_a_handler_coroutine() -> None:
    for cls, name in CHANNEL_METHODS.items():
        handler = getattr(ChannelHandler, name)
        assert inspect.iscoroutinefunction(handler), name
        assert cls.index >> 16 in (40, 50, 60, 85, 90)
    # and nothing but channel.* is left out of the client-sent methods of 0-9-1
    assert commands.Basic.Publish in CHANNEL_METHODS
    assert commands.Channel.Open not in CHANNEL_METHODS
    assert commands.Basic.Deliver not in CHANNEL_METHODS  # server-sent: 503


def test_the_base_handler_answers_540_not_implemented_yet() -> None:
    handler = ChannelHandler(channel=None)  # type: ignore[arg-type]  # the base never uses it
    with pytest.raises(replies.ChannelError) as caught:
        asyncio.run(handler.queue_declare(commands.Queue.Declare(queue="q")))
    assert caught.value.code == replies.NOT_IMPLEMENTED
    assert caught.value.reply_text == "NOT_IMPLEMENTED - queue.declare is not implemented yet"
    assert (caught.value.class_id, caught.value.method_id) == (50, 10)
    assert method_label("basic_recover_async") == "basic.recover-async"
    assert "tx.commit" in not_implemented(commands.Tx.Commit()).text


# -- configuration ---------------------------------------------------------------------------


def _amqp(**keys: str) -> AmqpOptions:
    raw = {"pepsi-amqp": {k: RawValue(v, "pepsi.conf") for k, v in keys.items()}}
    return parse_config(raw).amqp  # type: ignore[arg-type]


def test_pepsi_amqp_section_defaults_and_values() -> None:
    assert _amqp() == AmqpOptions()
    assert AmqpOptions().listen is None
    parsed = _amqp(LISTEN="127.0.0.1:5672", HEARTBEAT="30", FRAME_MAX="65536",
                   CHANNEL_MAX="100", HANDSHAKE_TIMEOUT="2s", MAX_MESSAGE_SIZE="1M")  # fmt: skip
    assert parsed == AmqpOptions(("127.0.0.1", 5672), 30, 65536, 100, 2.0, 1024 * 1024)
    assert _amqp(LISTEN="off").listen is None


@pytest.mark.parametrize(
    ("key", "value"),
    [("FRAME_MAX", "4095"), ("CHANNEL_MAX", "0"), ("LISTEN", "5672"), ("HEARTBEAT", "-1"),
     ("MAX_MESSAGE_SIZE", "513M"), ("BOGUS", "1")],
)  # fmt: skip
def test_pepsi_amqp_bad_values_name_the_key(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"\[pepsi-amqp\] {key}"):
        _amqp(**{key: value})


def test_the_overlay_cannot_change_the_listener() -> None:
    with pytest.raises(ConfigError, match="not reloadable"):
        merge_overlay({}, [("pepsi-amqp", "LISTEN", "0.0.0.0:5672")])


def test_a_reply_text_longer_than_a_shortstr_is_cut_as_rabbitmq_cuts_it() -> None:
    long_name = "q" * 300
    close = close_for(replies.ChannelError(replies.RESOURCE_LOCKED, f"queue '{long_name}'"), 1)
    assert len(close.text.encode()) == 255
    assert close.text.startswith("RESOURCE_LOCKED - queue 'qqq")
    assert close.text.endswith("...")
    accented = close_for(replies.ChannelError(replies.NOT_FOUND, "é" * 200), 1)
    assert len(accented.text.encode()) <= 255  # never half a character
    accented.text.encode().decode()
