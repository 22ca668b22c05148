"""What the AMQP integration tests share: a listener on an ephemeral port, on its own
event loop thread (pika's BlockingConnection is synchronous), and the check that no
connection failed with a server bug."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import pytest

from pepsi.amqp.connection import ConnectionOptions
from pepsi.amqp.server import Server, serve

T = TypeVar("T")
PASSWORD = "s3cret"


class Listener:
    """A Server (with `broker`, if given) on its own event loop thread."""

    def __init__(
        self, dsn: str, options: ConnectionOptions, broker: Any = None, timeout: float = 10.0
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.broker = broker
        self.server: Server = self.call(serve(("127.0.0.1", 0), options, dsn, timeout, broker))
        self.port = self.server.address[1]

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def run(self, fn: Callable[[], T]) -> T:
        """`fn()` on the loop's thread; its result or exception here."""
        future: Future[T] = Future()

        def call() -> None:
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001  # handed back to the test thread
                future.set_exception(exc)

        self.loop.call_soon_threadsafe(call)
        return future.result(timeout=30)

    def connections(self) -> int:
        return self.run(lambda: len(self.server.connections))

    def close(self) -> None:
        self.call(self.server.stop())
        if self.broker is not None and hasattr(self.broker, "close"):
            self.call(self.broker.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


def assert_no_server_bugs(caplog: pytest.LogCaptureFixture, *, tracebacks_only: bool) -> None:
    """Bad input is answered, never a traceback: no connection may fail unexpectedly.

    `tracebacks_only`: ERROR lines without an exception (a database refusing a
    commit, say) are expected answers, not bugs.
    """
    failures = [
        r.getMessage()
        for r in caplog.records
        if r.name == "pepsi.amqp" and r.levelname == "ERROR" and (r.exc_info or not tracebacks_only)
    ]
    assert not failures, failures
