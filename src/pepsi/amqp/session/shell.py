"""A connection's shell over asyncio: its state, the protocol callbacks, sending, timers.

`Shell` is the `asyncio.Protocol` (no stream copies, and the transport's own
flow-control callbacks bound both buffers): the callbacks only buffer received
bytes in a `FrameReader`, set flags and wake the connection's task.
Input is bounded: reading pauses while more than `INPUT_BUFFER_FRAMES` frames'
worth of bytes wait, and while the transport's write buffer is over
`write_high_water` (a client that does not read its socket stops being read; if
that lasts `write_stall_timeout` it is dropped). Heartbeats, the handshake's
deadline and connection.blocked are here too. The layers above it (`closing`,
`content`, `channels`, `handshake`, and `connection`'s frame loop) are one class
with it: no hop per frame.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Self, cast

from pamqp import base, commands

from pepsi.amqp.auth.permissions import Permission
from pepsi.amqp.session import memory
from pepsi.amqp.session.handler import Broker, Channel
from pepsi.amqp.session.negotiation import Gatekeeper, heartbeat_due
from pepsi.amqp.wire import methods, protocol, replies, writer
from pepsi.amqp.wire.reader import FrameReader
from pepsi.config.model import AmqpOptions

log = logging.getLogger("pepsi.amqp")

# --- options --------------------------------------------------------------------------

INPUT_BUFFER_FRAMES: Final = 4  # received, unhandled bytes: at most this many frames' worth
CLOSE_OK_TIMEOUT: Final = 5.0  # after our connection.close: drop the socket then at the latest
WRITE_HIGH_WATER: Final = 1024 * 1024  # transport buffer over this: the client is not reading
WRITE_STALL_TIMEOUT: Final = 60.0  # ... and is dropped if that lasts this long


@dataclass(frozen=True)
class ConnectionOptions:
    """The listener's settings: `[pepsi-amqp]` plus limits not in the file (tests shorten them)."""

    amqp: AmqpOptions = field(default_factory=AmqpOptions)
    close_timeout: float = CLOSE_OK_TIMEOUT
    write_high_water: int = WRITE_HIGH_WATER
    write_stall_timeout: float = WRITE_STALL_TIMEOUT


class State(enum.Enum):
    HEADER = "awaiting the protocol header"
    START_OK = "starting"
    SECURING = "securing"
    TUNE_OK = "tuning"
    OPEN_WAIT = "opening"
    OPEN = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class Shell(asyncio.Protocol):
    """A connection's state and its asyncio side; `connection.Connection` completes it."""

    def __init__(
        self,
        options: ConnectionOptions,
        gatekeeper: Gatekeeper,
        broker: Broker,
        *,
        opened: Callable[[Self], None] = lambda _: None,
        gone: Callable[[Self], None] = lambda _: None,
        blocked: Callable[[], str | None] = lambda: None,
        admit: Callable[[Self], str | None] = lambda _: None,
        publish_memory: memory.PublishMemory | None = None,
    ) -> None:
        self.options = options
        self.memory = publish_memory or memory.PublishMemory(options.amqp.publish_buffer)
        self._held = 0  # bytes this connection's contents in progress reserve
        self._admit = admit  # why this connection may not stay (a cap); None: it may
        self.gatekeeper = gatekeeper
        self.broker = broker
        self._opened_cb = opened
        self._gone_cb = gone
        self._blocked_now = blocked
        self.state = State.HEADER
        self.peer: str | None = None
        self.name = "?"
        self.username: str | None = None
        self.vhost: str | None = None
        self.permission: Permission | None = None
        self.client_capabilities: dict[str, Any] = {}
        self.mechanism = ""
        self.channel_max = options.amqp.channel_max
        self.frame_max = protocol.FRAME_MIN_SIZE
        self.heartbeat = 0
        self.channels: dict[int, Channel] = {}
        self.blocked_reason: str | None = None  # as last sent to the client
        self._reader = FrameReader()
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._lost = False
        self._input_full = False
        self._write_paused = False
        self._reading_paused = False
        self._last_sent = self._last_received = self._loop.time()
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.task: asyncio.Task[None] | None = None
        self.resumed: Callable[[], None] = lambda: None  # the client reads again

    # ---- asyncio.Protocol callbacks (thin: buffer, flags, wake the task) ----------------

    def connection_made(self: Self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        transport = cast(asyncio.Transport, transport)
        self._transport = transport
        transport.set_write_buffer_limits(high=self.options.write_high_water)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self.peer = str(peer[0])
            self.name = f"{peer[0]}:{peer[1]}" if len(peer) > 1 else str(peer[0])
        refusal = self._admit(self)
        if refusal is not None:  # over a cap: closed before anything is read or buffered
            log.warning("amqp %s: connection refused: %s", self.name, refusal)
            self.state = State.CLOSED
            transport.abort()
            self._gone_cb(self)
            return
        self._timer("handshake", self.options.amqp.handshake_timeout, self._handshake_expired)
        self.task = self._loop.create_task(self._run(), name=f"amqp {self.name}")

    def data_received(self, data: bytes) -> None:
        self._last_received = self._loop.time()
        if self.state is State.CLOSED:
            return
        try:
            self._reader.feed(data)
        except replies.FrameError:
            return  # already failed: the task has answered it and is closing
        if self._reader.buffered > INPUT_BUFFER_FRAMES * (self._reader.frame_max + 8):
            self._input_full = True
            self._apply_reading()
        self._wake.set()

    def eof_received(self) -> bool | None:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self.state = State.CLOSED
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._writable.set()
        self._wake.set()

    def pause_writing(self) -> None:
        # The client is not reading: stop reading its requests, drop it if it lasts.
        self._write_paused = True
        self._writable.clear()
        self._apply_reading()
        self._timer("stall", self.options.write_stall_timeout, self._write_stalled)

    def resume_writing(self) -> None:
        self._write_paused = False
        self._writable.set()
        self._cancel_timer("stall")
        self._apply_reading()
        self.resumed()

    def writable_now(self) -> bool:
        """Whether more may be sent now: the client reads what it is sent (deliveries stop
        while it does not: its socket's back-pressure is its flow control)."""
        return not self._write_paused and not self._lost

    # ---- sending -------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """Write raw frames (nothing once the socket is going)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        transport.write(data)
        self._last_sent = self._loop.time()

    def send_method(self, channel: int, method: base.Frame) -> None:
        self.send(writer.encode_method(channel, method))

    async def writable(self) -> None:
        """Return when the client reads again (the write buffer is under its mark)."""
        await self._writable.wait()

    def set_blocked(self, reason: str | None) -> None:
        """connection.blocked (a reason) or unblocked (None), to a client that asked for them."""
        if self.state is not State.OPEN or not self.client_capabilities.get("connection.blocked"):
            return
        if (reason is None) == (self.blocked_reason is None):
            return  # the client already knows
        self.blocked_reason = reason
        if reason is None:
            self.send_method(0, commands.Connection.Unblocked())
        else:
            self.send_method(0, methods.build_method(commands.Connection.Blocked, reason=reason))

    # ---- timers and flow control ------------------------------------------------------

    def _timer(self, name: str, delay: float, callback: Callable[[], None]) -> None:
        self._cancel_timer(name)
        self._timers[name] = self._loop.call_later(delay, callback)

    def _cancel_timer(self, name: str) -> None:
        timer = self._timers.pop(name, None)
        if timer is not None:
            timer.cancel()

    def _apply_reading(self) -> None:
        transport = self._transport
        want_paused = self._input_full or self._write_paused
        if transport is None or want_paused == self._reading_paused or transport.is_closing():
            return
        self._reading_paused = want_paused
        if want_paused:
            transport.pause_reading()
        else:
            # time spent not reading is ours, not a missed heartbeat of the client's
            self._last_received = self._loop.time()
            transport.resume_reading()

    def _handshake_expired(self) -> None:
        if self.state in (State.OPEN, State.CLOSED):
            return
        log.warning(
            "amqp %s: closing, handshake not done within %gs (%s)",
            self.name, self.options.amqp.handshake_timeout, self.state.value,
        )  # fmt: skip
        self._abort()

    def _write_stalled(self) -> None:
        log.warning(
            "amqp %s: closing, the client has not read for %gs",
            self.name, self.options.write_stall_timeout,
        )  # fmt: skip
        self._abort()

    def _heartbeat_tick(self) -> None:
        if self.state is State.CLOSED or self.heartbeat <= 0:
            return
        now = self._loop.time()
        if self._reading_paused:
            self._last_received = now
        due = heartbeat_due(now, self.heartbeat, self._last_sent, self._last_received)
        if due.dead:
            log.warning(
                "amqp %s: closing, missed heartbeats from client, timeout: %ds",
                self.name, self.heartbeat,
            )  # fmt: skip
            self._abort()
            return
        if due.send:
            self.send(writer.HEARTBEAT)
        self._timers["heartbeat"] = self._loop.call_at(due.next_check, self._heartbeat_tick)

    def _close_transport(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()  # after what is buffered ...
            # ... which a client that reads nothing never lets happen: drop it then
            self._timer("flush", self.options.close_timeout, self._abort)

    def _abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def abort(self) -> None:
        """Drop the socket now, whatever is still buffered."""
        self._abort()

    # ---- provided by connection.Connection -------------------------------------------

    async def _run(self) -> None:
        """The frame loop (`connection.Connection`)."""
        raise NotImplementedError


__all__ = [
    "ConnectionOptions",
]
