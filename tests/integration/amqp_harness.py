"""What the AMQP integration tests share: a listener on an ephemeral port, on its own
event loop thread (pika's BlockingConnection is synchronous), and the check that no
connection failed with a server bug."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import pytest
from pamqp import base, commands

from pepsi.amqp.session.server import Server, serve
from pepsi.amqp.session.shell import ConnectionOptions
from pepsi.amqp.wire import methods, protocol, writer
from pepsi.amqp.wire.frames import Frame, HeartbeatFrame, MethodFrame
from pepsi.amqp.wire.reader import FrameReader

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


class Raw:
    """A socket speaking frames, for what real clients do not send."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(("127.0.0.1", port))
        self.reader = FrameReader(0, expect_protocol_header=False)
        self.pending: list[Frame] = []

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def method(self, channel: int, method: base.Frame) -> None:
        self.send(writer.encode_method(channel, method))

    def frame(self, timeout: float = 10.0) -> Frame | None:
        """The next frame, or None at EOF."""
        self.sock.settimeout(timeout)
        while not self.pending:
            data = self.sock.recv(65536)
            if not data:
                return None
            self.pending.extend(self.reader.feed(data))
        return self.pending.pop(0)

    def expect(self, cls: type[T], timeout: float = 10.0) -> T:
        """The next method, skipping heartbeats; it must be a `cls`."""
        while True:
            frame = self.frame(timeout)
            if isinstance(frame, HeartbeatFrame):
                continue
            assert isinstance(frame, MethodFrame), frame
            assert isinstance(frame.method, cls), frame.method
            return frame.method

    def closed_within(self, seconds: float) -> bool:
        """True when the server closes the socket within `seconds` (data is skipped)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                if not self.sock.recv(65536):
                    return True
            except TimeoutError:
                return False
            except ConnectionResetError:
                return True
        return False

    def handshake(
        self,
        *,
        mechanism: str = "PLAIN",
        response: bytes | None = None,
        heartbeat: int = 0,
        frame_max: int = 0,
        channel_max: int = 0,
        vhost: str = "/",
        user: str = "alice",
        capabilities: dict[str, Any] | None = None,
    ) -> None:
        self.send(protocol.PROTOCOL_HEADER)
        self.expect(commands.Connection.Start)
        if response is None:
            response = b"\0" + user.encode() + b"\0" + PASSWORD.encode()
        properties: dict[str, Any] = {"product": "raw"}
        if capabilities is not None:
            properties["capabilities"] = capabilities
        self.method(
            0,
            methods.build_method(
                commands.Connection.StartOk,
                client_properties=properties,
                mechanism=mechanism,
                response=response,
                locale="en_US",
            ),
        )
        tune = self.expect(commands.Connection.Tune)
        self.method(
            0,
            methods.build_method(
                commands.Connection.TuneOk,
                channel_max=channel_max or tune.channel_max,
                frame_max=frame_max or tune.frame_max,
                heartbeat=heartbeat,
            ),
        )
        self.method(
            0, methods.build_method(commands.Connection.Open, virtual_host=vhost, insist=False)
        )
        self.expect(commands.Connection.OpenOk)

    def close(self) -> None:
        self.sock.close()
