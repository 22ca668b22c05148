"""A real dispatcher, in this process on its own event loop thread, serving AMQP on an
ephemeral port: the claim that feeds AMQP consumers is the dispatcher's (A-1), so the
consuming tests need one. No stage of its own unless the test gives a configuration."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import psycopg
from pika.adapters.blocking_connection import BlockingChannel

from pepsi.amqp.broker.expiry import Expiry
from pepsi.config.ini import parse_ini
from pepsi.config.parse import parse_config
from pepsi.dispatch.coordinator import Dispatcher
from tests.integration.amqp_harness import PASSWORD
from tests.scenarios.conftest import wait_until

Conn = psycopg.Connection[Any]

BASE = "[pepsi-amqp]\nLISTEN = 127.0.0.1:0\nHEARTBEAT = 0\n[pepsi-dispatch]\nPOLL_INTERVAL = 1s\n"


class DispatcherThread:
    def __init__(
        self, dsn: str, extra: str = "", path: Path | None = None, *, base: str = BASE
    ) -> None:
        config = parse_config(parse_ini(base + extra, "test"), path)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.dispatcher: Dispatcher = self.run(lambda: Dispatcher(config, dsn))
        self.done: Future[int] = asyncio.run_coroutine_threadsafe(
            self.dispatcher.serve(signals=False), self.loop
        )
        deadline = time.monotonic() + 30
        while self.dispatcher.amqp is None:
            if self.done.done():
                self.done.result()  # raises what stopped it
            if time.monotonic() > deadline:
                raise TimeoutError("the dispatcher did not start listening")
            time.sleep(0.01)
        self.port = self.dispatcher.amqp.address[1]
        while not self.dispatcher.listener.listening:  # NOTIFYs reach it from now on
            if time.monotonic() > deadline:
                raise TimeoutError("the dispatcher's listener did not connect")
            time.sleep(0.01)

    def run(self, fn: Any) -> Any:
        """`fn()` on the loop's thread; its result here."""
        future: Future[Any] = Future()

        def call() -> None:
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001  # handed back to the test thread
                future.set_exception(exc)

        self.loop.call_soon_threadsafe(call)
        return future.result(timeout=30)

    @property
    def deliverer(self) -> Any:
        broker = self.dispatcher.amqp_broker
        assert broker is not None
        return broker.deliverer

    def unacked_ids(self) -> set[int]:
        """Rows delivered to a consumer (or basic.get) and not settled: the server's own
        books. A row's status does not say it: 'running' is also a row the broker has
        claimed to read ahead and not sent yet."""
        return set(
            self.run(lambda: [d.wid for b in self.deliverer.books for d in b.unacked.values()])
        )

    def stop(self) -> int:
        if not self.done.done():
            self.loop.call_soon_threadsafe(self.dispatcher.request_stop)
        code = self.done.result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()
        return code


# -- what the consuming tests share: a dispatcher with user alice, pika clients ------------


def connect(server: DispatcherThread, user: str = "alice") -> pika.BlockingConnection:
    """A pika connection to `server` (the test closes it)."""
    return pika.BlockingConnection(
        pika.ConnectionParameters(
            "127.0.0.1", server.port, credentials=pika.PlainCredentials(user, PASSWORD)
        )
    )


def rows(conn: Conn, queue: str) -> dict[str, int]:
    """The queue's rows (vhost /) by status."""
    found = conn.execute(
        "SELECT status::text, count(*) FROM pepsi.workqueue WHERE stage = %s GROUP BY 1",
        (f"amqp:/:{queue}",),
    ).fetchall()
    return {status: int(n) for status, n in found}


def expiry(server: DispatcherThread) -> Expiry:
    broker = server.dispatcher.amqp_broker
    assert broker is not None
    return broker.expiry


def passes(server: DispatcherThread) -> int:
    return int(server.run(lambda: expiry(server).passes))


def await_passes(server: DispatcherThread, n: int = 2) -> None:
    """`n` more expiry passes done: the last one began after this call."""
    start = passes(server)
    wait_until(lambda: passes(server) >= start + n, what=f"{n} expiry passes")


def open_channel(connection: pika.BlockingConnection) -> BlockingChannel:
    """A channel in confirm mode: each publish returns once it is stored."""
    opened = connection.channel()
    opened.confirm_delivery()
    return opened


def text(value: object) -> str:
    """A decoded header value (pika gives bytes for some strings)."""
    return value.decode() if isinstance(value, bytes) else str(value)
