"""The AMQP connection layer (issue 16), in-process on an ephemeral port, against the
real test database, driven by pika, aio-pika and a raw socket for what clients never
send (AMQPLAIN, garbage, silence)."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, ClassVar, TypeVar

import aio_pika
import pika
import pika.exceptions
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands

from pepsi.admin.accounts import amqp_users
from pepsi.amqp.session.handler import Channel, ChannelHandler
from pepsi.amqp.session.negotiation import connection_refusal
from pepsi.amqp.session.shell import ConnectionOptions
from pepsi.amqp.wire import methods, protocol, writer
from pepsi.amqp.wire.frames import HeartbeatFrame
from pepsi.config.model import AmqpOptions
from tests.integration.amqp_harness import PASSWORD, Listener, Raw, assert_no_server_bugs
from tests.scenarios.conftest import wait_until

T = TypeVar("T")

HANDSHAKE_TIMEOUT = 1.0


@pytest.fixture(autouse=True)
def no_server_bugs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    yield
    assert_no_server_bugs(caplog, tracebacks_only=False)


@pytest.fixture
def users(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    amqp_users.add_user(conn, "alice", PASSWORD)
    amqp_users.set_permissions(conn, "alice", ".*", ".*", ".*")
    amqp_users.add_vhost(conn, "/closed")  # alice has no permissions there
    return conn


@pytest.fixture
def listener(dsn: str, users: psycopg.Connection[Any]) -> Iterator[Listener]:
    options = ConnectionOptions(AmqpOptions(handshake_timeout=HANDSHAKE_TIMEOUT), close_timeout=1.0)
    server = Listener(dsn, options)
    yield server
    server.close()


def params(listener: Listener, **kw: Any) -> pika.ConnectionParameters:
    kw.setdefault("credentials", pika.PlainCredentials("alice", PASSWORD))
    return pika.ConnectionParameters("127.0.0.1", listener.port, **kw)


# -- a raw client (Raw, in amqp_harness) ---------------------------------------------------


@pytest.fixture
def raw(listener: Listener) -> Iterator[Callable[[], Raw]]:
    opened: list[Raw] = []

    def make() -> Raw:
        client = Raw(listener.port)
        opened.append(client)
        return client

    yield make
    for client in opened:
        client.close()


def amqplain(login: str, password: str) -> bytes:
    def longstr(value: str) -> bytes:
        data = value.encode()
        return b"S" + struct.pack(">I", len(data)) + data

    return b"\x05LOGIN" + longstr(login) + b"\x08PASSWORD" + longstr(password)


def assert_usable(listener: Listener) -> None:
    """A new client logs in and opens a channel: the server is still serving."""
    with pika.BlockingConnection(params(listener)) as connection:
        assert connection.channel().is_open


# -- logging in --------------------------------------------------------------------------


def test_pika_logs_in_opens_and_closes_channels(listener: Listener) -> None:
    connection = pika.BlockingConnection(params(listener))
    properties = connection._impl.server_properties  # what start said
    assert properties["product"] == "Pepsi"
    capabilities = properties["capabilities"]
    for name in ("publisher_confirms", "basic.nack", "connection.blocked",
                 "authentication_failure_close", "consumer_cancel_notify"):  # fmt: skip
        assert capabilities[name] is True
    first, second = connection.channel(), connection.channel()
    assert first.is_open
    assert second.is_open
    assert first.channel_number != second.channel_number
    first.close()
    assert first.is_closed
    assert second.is_open
    third = connection.channel()
    assert third.is_open
    connection.close()
    wait_until(lambda: listener.connections() == 0, what="the server to forget the connection")


def test_amqplain_logs_in(raw: Callable[[], Raw]) -> None:
    client = raw()
    client.handshake(mechanism="AMQPLAIN", response=amqplain("alice", PASSWORD))
    client.method(1, commands.Channel.Open())
    client.expect(commands.Channel.OpenOk)
    client.method(0, methods.build_method(commands.Connection.Close, reply_code=200,
                                          reply_text="bye", class_id=0, method_id=0))  # fmt: skip
    client.expect(commands.Connection.CloseOk)
    assert client.closed_within(5)


def test_amqplain_wrong_password_is_refused(raw: Callable[[], Raw]) -> None:
    client = raw()
    client.send(protocol.PROTOCOL_HEADER)
    client.expect(commands.Connection.Start)
    client.method(0, methods.build_method(
        commands.Connection.StartOk, client_properties={}, mechanism="AMQPLAIN",
        response=amqplain("alice", "nope"), locale="en_US"))  # fmt: skip
    # no authentication_failure_close capability: the socket just closes (as RabbitMQ)
    assert client.closed_within(5)


def test_aio_pika_connects_and_opens_a_channel(listener: Listener) -> None:
    async def run() -> None:
        url = f"amqp://alice:{PASSWORD}@127.0.0.1:{listener.port}/"
        connection = await aio_pika.connect(url)
        async with connection:
            # confirms are the broker's part (540 for now)
            channel = await connection.channel(publisher_confirms=False)
            assert not channel.is_closed
            await channel.close()

    asyncio.run(run())


def test_wrong_password_is_access_refused(listener: Listener) -> None:
    bad = params(listener, credentials=pika.PlainCredentials("alice", "wrong"))
    with pytest.raises(pika.exceptions.ProbableAuthenticationError, match=r"403.*ACCESS_REFUSED"):
        pika.BlockingConnection(bad)
    unknown = params(listener, credentials=pika.PlainCredentials("bob", PASSWORD))
    with pytest.raises(pika.exceptions.ProbableAuthenticationError, match="ACCESS_REFUSED"):
        pika.BlockingConnection(unknown)
    assert_usable(listener)


def test_an_unreachable_user_database_is_541_not_a_refusal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = Listener("postgresql://nobody@127.0.0.1:1/none", ConnectionOptions())
    try:
        with pytest.raises(pika.exceptions.ProbableAuthenticationError, match="541"):
            pika.BlockingConnection(
                pika.ConnectionParameters(
                    "127.0.0.1", server.port, credentials=pika.PlainCredentials("a", "b")
                )
            )
    finally:
        server.close()
    assert "cannot read the user database" in caplog.text
    caplog.clear()  # the expected error


def test_vhosts_unknown_or_not_permitted_are_530(listener: Listener) -> None:
    with pytest.raises(
        pika.exceptions.ProbableAccessDeniedError, match=r"530.*vhost /nope not found"
    ):
        pika.BlockingConnection(params(listener, virtual_host="/nope"))
    with pytest.raises(
        pika.exceptions.ProbableAccessDeniedError,
        match=r"530.*access to vhost '/closed' refused for user 'alice'",
    ):
        pika.BlockingConnection(params(listener, virtual_host="/closed"))


def test_guest_is_accepted_from_loopback(listener: Listener, users: Any) -> None:
    amqp_users.add_user(users, "guest", "guest")
    amqp_users.set_permissions(users, "guest", ".*", ".*", ".*")
    guest = params(listener, credentials=pika.PlainCredentials("guest", "guest"))
    with pika.BlockingConnection(guest) as connection:
        assert connection.channel().is_open


# -- channels ----------------------------------------------------------------------------


def test_a_method_not_implemented_yet_closes_only_its_channel(listener: Listener) -> None:
    with pika.BlockingConnection(params(listener)) as connection:
        channel = connection.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as caught:
            channel.exchange_declare("orders")
        assert caught.value.reply_code == 540
        assert "exchange.declare is not implemented yet" in caught.value.reply_text
        assert connection.is_open
        assert connection.channel().is_open


def test_channel_errors_close_the_connection(raw: Callable[[], Raw]) -> None:
    client = raw()
    client.handshake(channel_max=10)
    client.method(5, methods.build_method(commands.Basic.Qos, prefetch_size=0,
                                          prefetch_count=1, global_=False))  # fmt: skip
    close = client.expect(commands.Connection.Close)
    assert close.reply_code == 504
    assert "expected 'channel.open'" in close.reply_text

    # as RabbitMQ: channel_max counts the channels open at once; any number 1-65535 will do
    many = raw()
    many.handshake(channel_max=2)
    for number in (65535, 7):
        many.method(number, commands.Channel.Open())
        many.expect(commands.Channel.OpenOk)
    many.method(8, commands.Channel.Open())
    close = many.expect(commands.Connection.Close)
    assert close.reply_code == 530
    assert close.reply_text == (
        "NOT_ALLOWED - number of channels opened (2) has reached the negotiated channel_max (2)"
    )
    many.method(0, commands.Connection.CloseOk())
    assert many.closed_within(5)


def test_channel_flow_stop_is_not_implemented_as_in_rabbitmq(raw: Callable[[], Raw]) -> None:
    client = raw()
    client.handshake()
    client.method(1, commands.Channel.Open())
    client.expect(commands.Channel.OpenOk)
    client.method(1, methods.build_method(commands.Channel.Flow, active=True))
    assert client.expect(commands.Channel.FlowOk).active is True
    client.method(1, methods.build_method(commands.Channel.Flow, active=False))
    close = client.expect(commands.Connection.Close)
    assert (close.reply_code, close.reply_text) == (540, "NOT_IMPLEMENTED - active=false")


def test_a_too_small_frame_max_is_refused_with_530(raw: Callable[[], Raw]) -> None:
    client = raw()
    client.send(protocol.PROTOCOL_HEADER)
    client.expect(commands.Connection.Start)
    client.method(0, methods.build_method(
        commands.Connection.StartOk, client_properties={}, mechanism="PLAIN",
        response=b"\0alice\0" + PASSWORD.encode(), locale="en_US"))  # fmt: skip
    client.expect(commands.Connection.Tune)
    client.method(0, methods.build_method(commands.Connection.TuneOk, channel_max=0,
                                          frame_max=1024, heartbeat=0))  # fmt: skip
    close = client.expect(commands.Connection.Close)
    assert close.reply_code == 530
    assert "frame_max=1024 < 4096 min size" in close.reply_text


def test_blocked_and_unblocked_reach_a_client_that_asked(listener: Listener) -> None:
    events: list[str] = []
    with pika.BlockingConnection(params(listener)) as connection:
        connection.add_on_connection_blocked_callback(
            lambda _conn, frame: events.append(f"blocked {frame.method.reason}")
        )
        connection.add_on_connection_unblocked_callback(
            lambda _conn, _f: events.append("unblocked")
        )
        listener.run(lambda: listener.server.set_blocked("low on database connections"))
        wait_until(lambda: connection.process_data_events(0.05) or events, what="blocked")
        listener.run(lambda: listener.server.set_blocked(None))
        wait_until(
            lambda: connection.process_data_events(0.05) or len(events) == 2, what="unblocked"
        )
    assert events == ["blocked low on database connections", "unblocked"]


class EchoHandler(ChannelHandler):
    """A broker's handler as the next part will write one: declare-ok, or a bug."""

    closed_channels: ClassVar[list[int]] = []

    async def queue_declare(self, method: commands.Queue.Declare) -> None:
        if method.queue == "bug":
            raise RuntimeError("a bug in a handler")
        self.channel.send_method(
            methods.build_method(
                commands.Queue.DeclareOk, queue=method.queue, message_count=0, consumer_count=0
            )
        )

    async def closed(self) -> None:
        self.closed_channels.append(self.channel.number)


class EchoBroker:
    def channel_handler(self, channel: Channel) -> ChannelHandler:
        return EchoHandler(channel)


def test_the_seam_routes_channel_methods_to_the_brokers_handler(
    dsn: str, users: Any, caplog: pytest.LogCaptureFixture
) -> None:
    EchoHandler.closed_channels = []
    server = Listener(dsn, ConnectionOptions(), EchoBroker())
    try:
        port = server.port
        parameters = pika.ConnectionParameters(
            "127.0.0.1", port, credentials=pika.PlainCredentials("alice", PASSWORD)
        )
        with pika.BlockingConnection(parameters) as connection:
            channel = connection.channel()
            declared = channel.queue_declare("orders")
            assert declared.method.queue == "orders"
            with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="540"):
                channel.exchange_declare("x")  # not overridden: still 540
            other = connection.channel()
            with pytest.raises(pika.exceptions.ConnectionClosedByBroker, match="541"):
                other.queue_declare("bug")  # a handler's bug: this connection only
        assert "a bug in a handler" in caplog.text
        caplog.clear()  # the expected traceback
        # closed() once per channel: the 540 one, and the one the 541 took down
        wait_until(lambda: len(EchoHandler.closed_channels) == 2, what="closed()")
        with pika.BlockingConnection(parameters) as connection:
            assert connection.channel().queue_declare("again").method.queue == "again"
    finally:
        server.close()


# -- heartbeats and timeouts ---------------------------------------------------------------


def test_pika_with_a_one_second_heartbeat_stays_up_while_idle(listener: Listener) -> None:
    with pika.BlockingConnection(params(listener, heartbeat=1)) as connection:
        channel = connection.channel()
        connection.sleep(3.0)
        assert connection.is_open
        assert channel.is_open
        assert connection.channel().is_open


def test_the_server_sends_heartbeats_and_drops_a_silent_client(raw: Callable[[], Raw]) -> None:
    client = raw()
    client.handshake(heartbeat=1)
    started = time.monotonic()
    assert isinstance(client.frame(timeout=2.0), HeartbeatFrame)  # at ~0.5 s
    # we send nothing: the server closes after two missed intervals (2 s)
    assert client.closed_within(6.0)
    assert 1.5 < time.monotonic() - started < 6.0  # 2 s, and room for a loaded machine


def test_a_client_that_says_nothing_is_dropped_after_the_handshake_timeout(
    raw: Callable[[], Raw], listener: Listener
) -> None:
    client = raw()
    started = time.monotonic()
    assert client.closed_within(HANDSHAKE_TIMEOUT + 2)
    assert time.monotonic() - started >= HANDSHAKE_TIMEOUT * 0.9
    silent_after_header = raw()
    silent_after_header.send(protocol.PROTOCOL_HEADER)
    assert silent_after_header.closed_within(HANDSHAKE_TIMEOUT + 2)
    assert_usable(listener)


# -- bad bytes -----------------------------------------------------------------------------


def test_a_wrong_protocol_header_is_answered_with_ours(raw: Callable[[], Raw]) -> None:
    for header in (b"GET / HTTP/1.1\r\n\r\n", b"AMQP\x00\x01\x00\x00"):
        client = raw()
        client.send(header)
        client.sock.settimeout(5)
        assert client.sock.recv(100) == protocol.PROTOCOL_HEADER
        assert client.closed_within(5)


def test_garbage_after_a_good_header_is_a_501(raw: Callable[[], Raw]) -> None:
    client = raw()
    client.send(protocol.PROTOCOL_HEADER)
    client.expect(commands.Connection.Start)
    client.send(b"\x01\x00\x00\x00\x00\x00\x02hi\x00garbage")  # frame-end 0x00: sync lost
    close = client.expect(commands.Connection.Close)
    assert close.reply_code == 501
    assert client.closed_within(5)


def test_an_oversized_frame_is_a_501(raw: Callable[[], Raw]) -> None:
    before_tune = raw()
    before_tune.send(protocol.PROTOCOL_HEADER)
    before_tune.expect(commands.Connection.Start)
    before_tune.send(struct.pack(">BHI", 1, 0, 4097))  # over 4096 before tune-ok
    close = before_tune.expect(commands.Connection.Close)
    assert close.reply_code == 501
    assert before_tune.closed_within(5)

    after = raw()
    after.handshake(frame_max=8192)
    after.send(struct.pack(">BHI", 3, 1, 8193))
    close = after.expect(commands.Connection.Close)
    assert close.reply_code == 501
    assert "exceeds frame_max 8192" in close.reply_text
    assert after.closed_within(5)


def test_a_message_over_max_message_size_closes_its_channel_with_406(dsn: str, users: Any) -> None:
    server = Listener(dsn, ConnectionOptions(AmqpOptions(max_message_size=1000)))
    try:
        client = Raw(server.port)
        client.handshake()
        client.method(1, commands.Channel.Open())
        client.expect(commands.Channel.OpenOk)
        publish = methods.build_method(commands.Basic.Publish, ticket=0, exchange="",
                                       routing_key="q", mandatory=False, immediate=False)  # fmt: skip
        client.send(writer.encode_content(1, publish, b"\x00\x00", b"x" * 1001, 131072))
        close = client.expect(commands.Channel.Close)
        assert close.reply_code == 406
        client.method(1, commands.Channel.CloseOk())
        client.method(2, commands.Channel.Open())
        client.expect(commands.Channel.OpenOk)  # the connection lives on
        client.close()
    finally:
        server.close()


# A request whose answer (flow-ok) a non-reading client leaves in the server's buffers.
FLOOD = writer.encode_method(1, methods.build_method(commands.Channel.Flow, active=True))


def non_reading_client(server: Listener) -> Raw:
    """A client with channel 1 open that will read nothing more.

    The server's end of its socket gets a small send buffer, so the kernel's buffers fill
    after a few thousand answers however slowly a loaded machine lets the server answer.
    (Not a small receive buffer on the client's end: with a window smaller than one
    loopback segment, TCP can drop segments carrying acks and sit in retransmission
    backoff for tens of seconds, reading nothing and sending nothing.)
    """
    client = Raw(server.port)
    try:
        client.handshake()
        client.method(1, commands.Channel.Open())
        client.expect(commands.Channel.OpenOk)

        def shrink_send_buffers() -> None:
            for conn in server.server.connections:
                assert conn._transport is not None
                sock = conn._transport.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)

        server.run(shrink_send_buffers)
    except BaseException:
        client.close()
        raise
    return client


def test_a_client_that_never_reads_is_dropped(
    dsn: str, users: Any, caplog: pytest.LogCaptureFixture
) -> None:
    options = ConnectionOptions(write_high_water=4096, write_stall_timeout=1.0)
    server = Listener(dsn, options)
    try:
        client = non_reading_client(server)
        try:
            client.sock.settimeout(0.2)
            unsent = b""
            deadline = time.monotonic() + 20
            while server.connections() and time.monotonic() < deadline:
                # What a send leaves unsent goes first next time: a frame cut short
                # would be a frame error, and the server would close the connection
                # (waiting for a close-ok) instead of dropping a stalled client.
                unsent = unsent or FLOOD * 4096
                try:
                    unsent = unsent[client.sock.send(unsent) :]
                except TimeoutError:
                    pass  # the server stopped reading us: its stall timer runs
                except OSError:
                    break  # reset: dropped
            wait_until(lambda: server.connections() == 0, what="the stalled client to be dropped")
        finally:
            client.close()  # also when the wait fails: no unclosed socket for a later test
        assert "the client has not read for 1s" in caplog.text
        fresh = Raw(server.port)
        fresh.handshake()
        fresh.close()
    finally:
        server.close()


def test_a_closed_connection_whose_client_reads_nothing_is_dropped(dsn: str, users: Any) -> None:
    """Closing waits for the answers already buffered to go out; a client that reads
    none of them is dropped after close_timeout instead of holding the socket forever."""
    options = ConnectionOptions(write_high_water=64 * 1024 * 1024, close_timeout=1.0)
    server = Listener(dsn, options)
    try:
        client = non_reading_client(server)
        try:
            client.sock.settimeout(60)  # the server reads 6.5 MB: slowly on a loaded machine
            client.send(FLOOD * 500_000)  # 6.5 MB of answers: more than the sockets hold
            client.send(b"\x01\x00\x01\x00\x00\x00\x00\x00")  # no frame end (0xce): fatal
            wait_until(lambda: server.connections() == 0, what="the connection to be dropped")
        finally:
            client.close()
    finally:
        server.close()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.binary(min_size=1, max_size=300))
def test_random_bytes_after_a_handshake_never_hurt_the_server(
    listener: Listener, data: bytes
) -> None:
    client = Raw(listener.port)
    try:
        client.handshake()
        client.send(data)
        client.closed_within(0.05)  # whatever it answers
    finally:
        client.close()
    fresh = Raw(listener.port)
    try:
        fresh.handshake()  # the listener still serves
    finally:
        fresh.close()


def test_the_server_forgets_every_connection(listener: Listener, raw: Callable[[], Raw]) -> None:
    clients = [raw() for _ in range(3)]
    for client in clients:
        client.handshake()
    wait_until(lambda: listener.connections() == 3, what="three connections")
    for client in clients:
        client.close()
    wait_until(lambda: listener.connections() == 0, what="no connections")


def test_stop_closes_open_connections_with_320(dsn: str, users: Any) -> None:
    server = Listener(dsn, ConnectionOptions(replace(AmqpOptions(), handshake_timeout=5.0)))
    client = Raw(server.port)
    client.handshake()
    server.close()
    close = client.expect(commands.Connection.Close)
    assert close.reply_code == 320
    assert client.closed_within(5)
    client.close()


def test_connections_are_capped_in_all_and_per_client_address(
    dsn: str, users: psycopg.Connection[Any]
) -> None:
    """Issue 34, finding 10: 1 100 idle sockets made a normal login take 3 s. One more
    connection than CLIENT_CONNECTION_LIMIT from one address, or than MAX_CONNECTIONS
    in all, is closed at once, before anything is read; the others go on."""
    amqp = AmqpOptions(max_connections=3, client_connection_limit=2)
    server = Listener(dsn, ConnectionOptions(amqp, close_timeout=1.0))
    idle: list[socket.socket] = []
    try:
        for _ in range(2):
            idle.append(socket.create_connection(("127.0.0.1", server.port)))
        third = Raw(server.port)  # a third from 127.0.0.1: over the per-client limit
        assert third.closed_within(5)
        third.close()
        for sock in idle:
            sock.close()
        wait_until(lambda: not server.run(lambda: len(server.server.connections)),
                   what="the closed ones to be gone")  # fmt: skip
        with pika.BlockingConnection(params(server)) as connection:  # room again
            assert connection.channel().is_open
    finally:
        for sock in idle:
            sock.close()
        server.close()
    assert connection_refusal(2, 0, max_connections=3, client_limit=2) is None
    assert "MAX_CONNECTIONS" in (connection_refusal(3, 0, max_connections=3, client_limit=2) or "")
    assert "CLIENT_CONNECTION_LIMIT" in (
        connection_refusal(2, 2, max_connections=3, client_limit=2) or ""
    )
