"""Fixtures of the integration tests: the AMQP consuming tests' dispatcher and clients."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pika
import pika.exceptions
import psycopg
import pytest

from pepsi.admin import amqp_users
from tests.integration.amqp_dispatcher import DispatcherThread, connect
from tests.integration.amqp_harness import PASSWORD

Conn = psycopg.Connection[Any]


@pytest.fixture
def users(conn: Conn) -> Conn:
    """User alice, who may do anything in vhost /."""
    amqp_users.add_user(conn, "alice", PASSWORD)
    amqp_users.set_permissions(conn, "alice", ".*", ".*", ".*")
    return conn


@pytest.fixture
def broker(dsn: str, users: Conn) -> Iterator[DispatcherThread]:
    """A dispatcher serving AMQP on the test's database, with user alice."""
    server = DispatcherThread(dsn)
    yield server
    assert server.stop() == 0


@pytest.fixture
def amqp(broker: DispatcherThread) -> Iterator[Callable[[], pika.BlockingConnection]]:
    """Opens pika connections as alice; closes them (and any a test broke) afterwards."""
    opened: list[pika.BlockingConnection] = []

    def open_one() -> pika.BlockingConnection:
        connection = connect(broker)
        opened.append(connection)
        return connection

    yield open_one
    for connection in opened:
        if connection.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):  # one a test broke
                connection.close()
        transport = getattr(connection._impl, "_transport", None)
        sock = getattr(transport, "_sock", None)
        if sock is not None:  # broken under pika (a test shut it down): close it here
            sock.close()
