"""Issue 34, finding 1: a user without any permission opened 6 channels and started a
128 MiB publish on each, to an exchange that does not exist; the dispatcher grew from
80 MB to 804 MB. Now a publish is refused when its method arrives (its body discarded
unread), and the bodies being received are bounded per connection and in all."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from pamqp import commands

from pepsi.admin.accounts import amqp_users
from pepsi.amqp.broker.broker import Broker
from pepsi.amqp.session.memory import MIB, refusal
from pepsi.amqp.session.shell import ConnectionOptions
from pepsi.amqp.wire import methods, protocol, writer
from pepsi.config.model import AmqpOptions
from tests.integration.amqp_harness import PASSWORD, Listener, Raw, assert_no_server_bugs
from tests.scenarios.conftest import wait_until

Conn = psycopg.Connection[Any]
CHUNK = 128 * 1024 - protocol.FRAME_OVERHEAD  # a body frame at the default frame_max


@pytest.fixture(autouse=True)
def no_server_bugs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    yield
    assert_no_server_bugs(caplog, tracebacks_only=True)


@pytest.fixture
def users(conn: Conn) -> Conn:
    amqp_users.add_user(conn, "alice", PASSWORD)
    amqp_users.set_permissions(conn, "alice", ".*", ".*", ".*")
    amqp_users.add_user(conn, "mallory", PASSWORD)  # may open vhost / and nothing else
    amqp_users.set_permissions(conn, "mallory", "", "", "")
    return conn


def listener(dsn: str, **limits: int) -> Listener:
    amqp = AmqpOptions(**limits)  # type: ignore[arg-type]
    return Listener(dsn, ConnectionOptions(amqp, close_timeout=1.0), Broker(dsn, 5.0))


def publish_start(client: Raw, channel: int, exchange: str, key: str, size: int) -> None:
    """basic.publish and its content header: the body is the caller's to send."""
    client.method(
        channel,
        methods.build_method(
            commands.Basic.Publish, exchange=exchange, routing_key=key, mandatory=False
        ),
    )
    header = struct.pack(">HHQH", protocol.BASIC_CLASS_ID, 0, size, 0)
    client.send(writer.encode_frame(protocol.FRAME_HEADER, channel, header))


def body(client: Raw, channel: int, size: int) -> None:
    for at in range(0, size, CHUNK):
        client.send(writer.encode_frame(protocol.FRAME_BODY, channel, b"x" * min(CHUNK, size - at)))


def open_channel(client: Raw, channel: int) -> None:
    client.method(channel, methods.build_method(commands.Channel.Open))
    client.expect(commands.Channel.OpenOk)


def held(server: Listener) -> int:
    return server.run(lambda: server.server.memory.held)


def test_a_refused_publish_keeps_none_of_its_body(dsn: str, users: Conn) -> None:
    """The probe: no permission, a missing exchange, 6 channels of 128 MiB. Each
    channel is closed (403) as its method arrives; nothing of the bodies is kept, and
    the connection serves on."""
    server = listener(dsn)
    client = Raw(server.port)
    try:
        client.handshake(user="mallory")
        for channel in range(1, 7):
            open_channel(client, channel)
            publish_start(client, channel, "nowhere", "k", 128 * MIB)
            close = client.expect(commands.Channel.Close)
            assert close.reply_code == 403
            assert "access to exchange 'nowhere' in vhost '/' refused" in close.reply_text
            body(client, channel, 4 * MIB)  # sent anyway: discarded unread
            client.method(channel, methods.build_method(commands.Channel.CloseOk))
        assert held(server) == 0
        open_channel(client, 7)  # the connection serves on
    finally:
        client.close()
        server.close()


def test_a_missing_exchange_is_refused_before_the_body(dsn: str, users: Conn) -> None:
    server = listener(dsn)
    client = Raw(server.port)
    try:
        client.handshake()
        open_channel(client, 1)
        publish_start(client, 1, "nowhere", "k", 64 * MIB)
        close = client.expect(commands.Channel.Close)
        assert (close.reply_code, close.class_id, close.method_id) == (404, 60, 40)
        assert held(server) == 0
    finally:
        client.close()
        server.close()


def test_one_connection_holds_at_most_its_buffer(dsn: str, users: Conn, conn: Conn) -> None:
    """Contents interleaved on many channels: past CONNECTION_PUBLISH_BUFFER the next
    header is refused (506), and what was taken still completes."""
    server = listener(dsn, max_message_size=MIB, connection_publish_buffer=2 * MIB)
    client = Raw(server.port)
    try:
        client.handshake()
        for channel in (1, 2, 3):
            open_channel(client, channel)
        client.method(1, methods.build_method(commands.Queue.Declare, queue="big"))
        client.expect(commands.Queue.DeclareOk)
        publish_start(client, 1, "", "big", MIB)
        publish_start(client, 2, "", "big", MIB)
        body(client, 1, MIB // 2)
        publish_start(client, 3, "", "big", MIB)
        close = client.expect(commands.Channel.Close)
        assert close.reply_code == 506
        assert "CONNECTION_PUBLISH_BUFFER allows 2097152" in close.reply_text
        assert held(server) == 2 * MIB
        body(client, 1, MIB // 2)
        body(client, 2, MIB)
        wait_until(lambda: held(server) == 0, what="both contents handed on")
        wait_until(
            lambda: (
                conn.execute(
                    "SELECT count(*) FROM pepsi.workqueue"
                    " WHERE stage = pepsi.amqp_queue_stage('/', 'big')"
                ).fetchone()
                == (2,)
            ),
            what="both stored",
        )
    finally:
        client.close()
        server.close()


def test_past_the_global_buffer_publishers_are_blocked_then_go_on(dsn: str, users: Conn) -> None:
    """Past PUBLISH_BUFFER a header waits, with connection.blocked sent to the clients
    that asked for it, and its connection is not read; it goes on, unblocked, once the
    others' contents are handed on. A connection that has a content of its own
    unfinished cannot wait (it would never finish): refused (506)."""
    server = listener(
        dsn, max_message_size=MIB, connection_publish_buffer=2 * MIB, publish_buffer=2 * MIB
    )
    first, second = Raw(server.port), Raw(server.port)
    try:
        first.handshake()
        second.handshake(capabilities={"connection.blocked": True})
        for client in (first, second):
            open_channel(client, 1)
            open_channel(client, 2)
        first.method(1, methods.build_method(commands.Queue.Declare, queue="big"))
        first.expect(commands.Queue.DeclareOk)
        publish_start(first, 1, "", "big", MIB)
        publish_start(first, 2, "", "big", MIB)
        wait_until(lambda: held(server) == 2 * MIB, what="the first connection's reservations")
        publish_start(second, 1, "", "big", MIB)  # waits
        blocked = second.expect(commands.Connection.Blocked)
        assert "PUBLISH_BUFFER" in blocked.reason
        body(first, 1, MIB)
        body(first, 2, MIB)
        second.expect(commands.Connection.Unblocked)
        body(second, 1, MIB)
        wait_until(lambda: held(server) == 0, what="every content handed on")
        assert refusal(MIB, MIB, connection_limit=4 * MIB, fits_in_all=False) is not None
        assert refusal(MIB, 0, connection_limit=4 * MIB, fits_in_all=False) is None
    finally:
        first.close()
        second.close()
        server.close()
