"""Fixtures of the integration tests: stage runners on worker connections; the AMQP
consuming tests' dispatcher and clients."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import pika
import pika.exceptions
import psycopg
import pytest

from pepsi.admin.accounts import amqp_users
from pepsi.config import Config
from pepsi.worker.handlers import StageFunc
from pepsi.worker.runner import StageRunner
from pepsi.worker.runtime import connect_worker
from tests.integration.amqp_dispatcher import DispatcherThread, connect
from tests.integration.amqp_harness import PASSWORD
from tests.rows import NOW

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


@pytest.fixture
def make_runner(dsn: str, config: Config) -> Iterator[Callable[..., StageRunner]]:
    """Runners on worker connections (as `pepsi worker` opens them), closed at the end;
    `config` is the test module's."""
    runners: list[StageRunner] = []

    def make(
        func: StageFunc, stage_name: str = "a", *, at: datetime = NOW, worker_dsn: str = dsn
    ) -> StageRunner:
        def open_connection() -> Conn:
            return connect_worker(worker_dsn, stage_name, synchronous_commit=False)

        runner = StageRunner(
            config,
            config.stages[stage_name],
            func,
            open_connection(),
            reconnect=open_connection,
            now=lambda: at,
        )
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.conn.close()
        if runner.loop is not None:
            runner.loop.close()
