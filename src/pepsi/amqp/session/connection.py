"""One AMQP 0-9-1 client connection: handshake, heartbeats, channels, closing.

The layers, from the socket up:

- `Connection` (an `asyncio.Protocol`: no stream copies, and the transport's own
  flow-control callbacks bound both buffers) feeds received bytes to a
  `FrameReader` and wakes one task per connection, which takes the
  complete frames in order and awaits their handling (a whole basic.publish or
  basic.ack at once, and without a coroutine when its handler can: the hot
  paths). Input is bounded: reading
  pauses while more than `INPUT_BUFFER_FRAMES` frames' worth of bytes wait, and
  while the transport's write buffer is over `write_high_water` (a client that
  does not read its socket stops being read; if that lasts `write_stall_timeout`
  it is dropped).
- Connection state: protocol header → start / start-ok (SASL via the
  `Gatekeeper`) → tune / tune-ok (`negotiate_tune`) → open (vhost access via the
  `Gatekeeper`) → open; then channels, until a close in either direction. The
  handshake must end within `handshake_timeout` of the accept.
- Channels: `channel.open|close|close-ok|flow` are handled here; every other
  channel-level method goes through **one dispatch point**, `CHANNEL_METHODS`,
  to the channel's `ChannelHandler`.

The seam for the broker (exchanges, queues, publishing, consuming):

    class Broker(Protocol):
        def channel_handler(self, channel: Channel) -> ChannelHandler: ...

`Server(broker=...)` asks the broker for a `ChannelHandler` at each
`channel.open`. `ChannelHandler` has one coroutine per client-sent method
(`exchange_declare(method)`, `queue_bind(method)`, `basic_publish(content)`,
`confirm_select(method)` ...), named in `CHANNEL_METHODS`; the base class
answers each with a channel close 540 NOT_IMPLEMENTED ("… is not implemented
yet"). A broker subclasses it and overrides what it implements. A handler:

- replies with `self.channel.send_method(...)` / `send_content(...)`;
- raises `replies.ChannelError` to close the channel (403, 404, 405, 406) or
  `replies.AMQPConnectionError` to close the connection (5xx, 530);
- is awaited before the connection's next frame is taken (per-connection
  order), so it should not wait on the database for work it can batch
  (publisher confirms are sent later with `send_method`);
- gets `closed()` exactly once when its channel goes away for any reason
  (close from either side, connection close, dropped socket): release
  consumers and requeue unacked deliveries there.

`Channel.connection` gives the login (`username`, `vhost`, `permission`,
`peer`), the client's capabilities (`client_capabilities`), `frame_max`, and
`writable()` to wait for before pushing deliveries to a slow reader.

Pure decisions (tune negotiation, heartbeat deadlines, which close for which
error, server properties, channel numbers) are the plain functions at the
top; tests/unit/test_amqp_negotiation.py covers them.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import platform
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, cast

from pamqp import base, commands

from pepsi import __version__
from pepsi.amqp.auth.permissions import (
    MECHANISMS,
    Credentials,
    Permission,
    SaslError,
    parse_response,
)
from pepsi.amqp.session import memory
from pepsi.amqp.wire import methods, protocol, replies, writer
from pepsi.amqp.wire.assembler import ContentAssembler
from pepsi.amqp.wire.frames import (
    BodyFrame,
    Content,
    Frame,
    HeartbeatFrame,
    MethodFrame,
    ProtocolHeaderFrame,
    RawContentHeader,
)
from pepsi.amqp.wire.reader import FrameReader
from pepsi.config.model import AmqpOptions

log = logging.getLogger("pepsi.amqp")

# --- options --------------------------------------------------------------------------

# A connection's task handles frames for at most this long before it lets the loop run:
# a client's 1 000 buffered publishes would otherwise hold up the publish batcher's and
# the claim's database replies for 20 ms (measured with bench/amqp.py's publisher: +15 %).
TURN_SECONDS: Final = 0.002
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


# --- pure decisions -------------------------------------------------------------------


def connection_refusal(
    open_now: int, from_client: int, *, max_connections: int, client_limit: int
) -> str | None:
    """Why one more connection is refused (counts without it), None if it is not: a cap
    in all and per client address, so that idle sockets cannot exhaust the dispatcher's
    file descriptors or its loop before any login."""
    if open_now >= max_connections:
        return f"{open_now} connections open, the most [pepsi-amqp] MAX_CONNECTIONS allows"
    if from_client >= client_limit:
        return (
            f"{from_client} connections open from this address, the most "
            "[pepsi-amqp] CLIENT_CONNECTION_LIMIT allows"
        )
    return None


CONNECTION_CLASS: Final = 10
_TUNE_OK: Final = commands.Connection.TuneOk.index & 0xFFFF


def server_properties(version: str = __version__) -> dict[str, Any]:
    """connection.start's server-properties, shaped like RabbitMQ's."""
    return {
        "product": "Pepsi",
        "version": version,
        "platform": f"Python {platform.python_version()}",
        "information": "Pepsi, a durable message pipeline on PostgreSQL",
        "capabilities": {
            "publisher_confirms": True,
            "exchange_exchange_bindings": True,
            "basic.nack": True,
            "consumer_cancel_notify": True,
            "connection.blocked": True,
            "authentication_failure_close": True,
            "per_consumer_qos": True,
        },
    }


@dataclass(frozen=True)
class Tuned:
    """What connection.tune-ok settled (0 heartbeat: none)."""

    channel_max: int
    frame_max: int
    heartbeat: int


def negotiate_tune(
    offered_channel_max: int,
    offered_frame_max: int,
    channel_max: int,
    frame_max: int,
    heartbeat: int,
) -> Tuned:
    """The client's tune-ok against our tune; AMQPConnectionError 530 as RabbitMQ refuses.

    A 0 channel_max or frame_max ("no limit") means our offer: the server never runs
    unbounded. The heartbeat is the client's choice (RabbitMQ takes it as sent).
    """
    where = {"class_id": CONNECTION_CLASS, "method_id": _TUNE_OK}
    channel_max = channel_max or offered_channel_max
    frame_max = frame_max or offered_frame_max
    if channel_max > offered_channel_max:
        raise replies.AMQPConnectionError(
            replies.NOT_ALLOWED,
            f"negotiated channel_max = {channel_max} is higher than the maximum allowed "
            f"value ({offered_channel_max})",
            **where,
        )
    if frame_max < protocol.FRAME_MIN_SIZE:
        raise replies.AMQPConnectionError(
            replies.NOT_ALLOWED,
            f"frame_max={frame_max} < {protocol.FRAME_MIN_SIZE} min size",
            **where,
        )
    if frame_max > offered_frame_max:
        raise replies.AMQPConnectionError(
            replies.NOT_ALLOWED, f"frame_max={frame_max} > {offered_frame_max} max size", **where
        )
    return Tuned(channel_max, frame_max, heartbeat)


@dataclass(frozen=True)
class HeartbeatDue:
    """One heartbeat check: send one now? is the peer dead? when to check again."""

    send: bool
    dead: bool
    next_check: float


def heartbeat_due(
    now: float, interval: float, last_sent: float, last_received: float
) -> HeartbeatDue:
    """Send when nothing went out for interval/2; dead when nothing came in for 2 intervals.

    Any frame counts both ways, as in RabbitMQ: a busy connection sends no heartbeats.
    """
    if interval <= 0:
        raise ValueError("heartbeats are off")
    half, limit = interval / 2, 2 * interval
    dead = now - last_received >= limit
    send = not dead and now - last_sent >= half
    sent_at = now if send else last_sent
    return HeartbeatDue(send, dead, min(sent_at + half, last_received + limit))


@dataclass(frozen=True)
class Close:
    """How to answer an error: close `channel` (0: the connection) with code and text.

    `drop`: the socket goes right after the close is sent (frame boundaries are lost),
    without waiting for close-ok.
    """

    channel: int
    code: int
    text: str  # as sent: "NAME - explanation"
    class_id: int = 0
    method_id: int = 0
    drop: bool = False


MAX_REPLY_TEXT = 255  # reply-text is a shortstr


def _reply_text(code: int, text: str) -> str:
    """`NAME - text`, cut to a shortstr as RabbitMQ does (252 octets and '...')."""
    name = replies.REPLY_NAMES.get(code)
    full = f"{name} - {text}" if name else text
    data = full.encode()
    if len(data) <= MAX_REPLY_TEXT:
        return full
    return data[: MAX_REPLY_TEXT - 3].decode("utf-8", "ignore") + "..."


def close_for(error: replies.FrameError | replies.AMQPError, channel: int = 0) -> Close:
    """The close for an error: hard codes close the connection, soft ones the channel.

    `channel` is where an `AMQPError` happened (a FrameError knows its own). A soft
    error on channel 0 has no channel to close, so it closes the connection.
    """
    if isinstance(error, replies.FrameError):
        code, text, where = error.reply_code, error.text, error.channel
        hard, drop = error.hard, error.fatal
    else:
        code, text, where = error.code, error.text, channel
        hard, drop = isinstance(error, replies.AMQPConnectionError), False
    if hard or where == 0:
        where = 0
    return Close(where, code, _reply_text(code, text), error.class_id, error.method_id, drop)


@dataclass(frozen=True)
class Refusal:
    code: int
    text: str


def channel_open_problem(channel_max: int, open_now: int, already_open: bool) -> Refusal | None:
    """Why a channel.open is refused, None if it is not. As RabbitMQ: channel_max bounds
    how many channels are open at once (530 NOT_ALLOWED), not their numbers (any of
    1 to 65535); a second open of one channel is 504 CHANNEL_ERROR."""
    if already_open:
        return Refusal(replies.CHANNEL_ERROR, "second 'channel.open' seen")
    if open_now >= channel_max:
        return Refusal(
            replies.NOT_ALLOWED,
            f"number of channels opened ({open_now}) has reached the negotiated "
            f"channel_max ({channel_max})",
        )
    return None


# --- the seam: channel-level methods ---------------------------------------------------

# Every method a client sends on an open channel, except channel.*, to the name of the
# ChannelHandler coroutine that takes it. basic.publish gets the whole Content.
CHANNEL_METHODS: Final[Mapping[type[base.Frame], str]] = {
    commands.Exchange.Declare: "exchange_declare",
    commands.Exchange.Delete: "exchange_delete",
    commands.Exchange.Bind: "exchange_bind",
    commands.Exchange.Unbind: "exchange_unbind",
    commands.Queue.Declare: "queue_declare",
    commands.Queue.Bind: "queue_bind",
    commands.Queue.Unbind: "queue_unbind",
    commands.Queue.Purge: "queue_purge",
    commands.Queue.Delete: "queue_delete",
    commands.Basic.Qos: "basic_qos",
    commands.Basic.Consume: "basic_consume",
    commands.Basic.Cancel: "basic_cancel",
    commands.Basic.Publish: "basic_publish",
    commands.Basic.Get: "basic_get",
    commands.Basic.Ack: "basic_ack",
    commands.Basic.Nack: "basic_nack",
    commands.Basic.Reject: "basic_reject",
    commands.Basic.Recover: "basic_recover",
    commands.Basic.RecoverAsync: "basic_recover_async",
    commands.Confirm.Select: "confirm_select",
    commands.Tx.Select: "tx_select",
    commands.Tx.Commit: "tx_commit",
    commands.Tx.Rollback: "tx_rollback",
}


def method_label(handler_name: str) -> str:
    """`basic_recover_async` → `basic.recover-async` (the spec's spelling, for messages)."""
    cls, _, rest = handler_name.partition("_")
    return f"{cls}.{rest.replace('_', '-')}"


def not_implemented(method: base.Frame) -> replies.ChannelError:
    name = CHANNEL_METHODS.get(type(method))
    label = method_label(name) if name else method.name
    return replies.ChannelError(
        replies.NOT_IMPLEMENTED,
        f"{label} is not implemented yet",
        method.index >> 16,
        method.index & 0xFFFF,
    )


class ChannelHandler:
    """One open channel's methods beyond channel.*; the base refuses each with 540.

    A broker subclasses this and overrides what it implements (see the module doc).
    """

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    async def closed(self) -> None:
        """The channel is gone (either side closed it, or the connection went)."""

    async def exchange_declare(self, method: commands.Exchange.Declare) -> None:
        raise not_implemented(method)

    async def exchange_delete(self, method: commands.Exchange.Delete) -> None:
        raise not_implemented(method)

    async def exchange_bind(self, method: commands.Exchange.Bind) -> None:
        raise not_implemented(method)

    async def exchange_unbind(self, method: commands.Exchange.Unbind) -> None:
        raise not_implemented(method)

    async def queue_declare(self, method: commands.Queue.Declare) -> None:
        raise not_implemented(method)

    async def queue_bind(self, method: commands.Queue.Bind) -> None:
        raise not_implemented(method)

    async def queue_unbind(self, method: commands.Queue.Unbind) -> None:
        raise not_implemented(method)

    async def queue_purge(self, method: commands.Queue.Purge) -> None:
        raise not_implemented(method)

    async def queue_delete(self, method: commands.Queue.Delete) -> None:
        raise not_implemented(method)

    async def basic_qos(self, method: commands.Basic.Qos) -> None:
        raise not_implemented(method)

    async def basic_consume(self, method: commands.Basic.Consume) -> None:
        raise not_implemented(method)

    async def basic_cancel(self, method: commands.Basic.Cancel) -> None:
        raise not_implemented(method)

    async def basic_publish(self, content: Content) -> None:
        raise not_implemented(content.method)

    async def publish_started(self, method: base.Frame) -> None:
        """A content method has arrived, its header and body not yet: raise the
        ChannelError its publish would end in now (permission, exchange), so that its
        body is discarded unread. The default leaves every check to `basic_publish`."""

    def ack_now(self, tag: int, multiple: bool) -> None:
        """basic.ack without a coroutine (a consumer's hot path): as `basic_ack`."""
        raise not_implemented(methods.ack_method(tag, multiple))

    def publish_now(self, content: Content) -> bool:
        """Handle a publish without awaiting, if possible; False (before doing anything)
        sends it to `basic_publish`. A fast path only: the default always declines."""
        return False

    async def basic_get(self, method: commands.Basic.Get) -> None:
        raise not_implemented(method)

    async def basic_ack(self, method: commands.Basic.Ack) -> None:
        raise not_implemented(method)

    async def basic_nack(self, method: commands.Basic.Nack) -> None:
        raise not_implemented(method)

    async def basic_reject(self, method: commands.Basic.Reject) -> None:
        raise not_implemented(method)

    async def basic_recover(self, method: commands.Basic.Recover) -> None:
        raise not_implemented(method)

    async def basic_recover_async(self, method: commands.Basic.RecoverAsync) -> None:
        raise not_implemented(method)

    async def confirm_select(self, method: commands.Confirm.Select) -> None:
        raise not_implemented(method)

    async def tx_select(self, method: commands.Tx.Select) -> None:
        raise not_implemented(method)

    async def tx_commit(self, method: commands.Tx.Commit) -> None:
        raise not_implemented(method)

    async def tx_rollback(self, method: commands.Tx.Rollback) -> None:
        raise not_implemented(method)


class Broker(Protocol):
    """What the connection layer asks of the broker: a handler per opened channel."""

    def channel_handler(self, channel: Channel) -> ChannelHandler: ...


class NoBroker:
    """Until the broker exists: every channel-level method is 540 NOT_IMPLEMENTED."""

    def channel_handler(self, channel: Channel) -> ChannelHandler:
        return ChannelHandler(channel)


class Gatekeeper(Protocol):
    """Who may log in and open which vhost (server.Catalogue reads PostgreSQL)."""

    async def login(self, credentials: Credentials, peer: str | None) -> str | None:
        """Why the login is refused (for the log), None if accepted."""
        ...

    async def vhost_permission(self, username: str, vhost: str) -> Permission:
        """The user's permission in `vhost`; AMQPConnectionError 530 if it may not open it."""
        ...


# --- channels ---------------------------------------------------------------------------


class Channel:
    """An open channel: its number, content assembly and handler; sends on its number."""

    __slots__ = ("assembler", "closing", "connection", "handler", "number", "reserved")

    def __init__(self, connection: Connection, number: int) -> None:
        self.connection = connection
        self.number = number
        self.assembler = ContentAssembler(
            number, max_message_size=connection.options.amqp.max_message_size
        )
        self.closing = False  # we sent channel.close and wait for close-ok
        self.handler: ChannelHandler | None = None
        self.reserved = 0  # bytes of PublishMemory its content in progress holds

    def send_method(self, method: base.Frame) -> None:
        self.connection.send(writer.encode_method(self.number, method))

    def send_content(self, method: base.Frame, raw_properties: bytes, body: bytes) -> None:
        self.connection.send(
            writer.encode_content(
                self.number, method, raw_properties, body, self.connection.frame_max
            )
        )


# --- the connection ----------------------------------------------------------------------


class State(enum.Enum):
    HEADER = "awaiting the protocol header"
    START_OK = "starting"
    SECURING = "securing"
    TUNE_OK = "tuning"
    OPEN_WAIT = "opening"
    OPEN = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class Connection(asyncio.Protocol):
    """One client connection (see the module doc)."""

    def __init__(
        self,
        options: ConnectionOptions,
        gatekeeper: Gatekeeper,
        broker: Broker,
        *,
        opened: Callable[[Connection], None] = lambda _: None,
        gone: Callable[[Connection], None] = lambda _: None,
        blocked: Callable[[], str | None] = lambda: None,
        admit: Callable[[Connection], str | None] = lambda _: None,
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

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
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

    def shutdown(
        self, text: str = "broker forced connection closure with reason 'shutdown'"
    ) -> None:
        """The server stops: 320 CONNECTION_FORCED, then the socket (no close-ok awaited)."""
        if self.state in (State.CLOSED, State.HEADER):
            self._close_transport()
            return
        self.send_method(
            0,
            methods.build_method(
                commands.Connection.Close,
                reply_code=replies.CONNECTION_FORCED,
                reply_text=_reply_text(replies.CONNECTION_FORCED, text),
                class_id=0,
                method_id=0,
            ),
        )
        self.state = State.CLOSING
        self._close_transport()

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

    # ---- the frame loop --------------------------------------------------------------

    async def _run(self) -> None:
        """Take frames in order; every error ends this connection only."""
        try:
            while not self._lost:
                await self._wake.wait()
                self._wake.clear()
                clock = time.monotonic
                turn_ends = clock() + TURN_SECONDS
                while not self._lost:
                    if self._write_paused:
                        await self._writable.wait()
                        continue
                    # A whole publish, or an ack, is taken at once and, mostly, handled
                    # without a coroutine; anything else goes frame by frame (_next).
                    taken = self._take_fast()
                    try:
                        if taken is None:
                            going = await self._next()
                        elif isinstance(taken, tuple):
                            going = self._ack_now(*taken)
                        else:
                            going = self._publish_now(taken) or await self._publish(taken)
                    except Exception as error:  # noqa: BLE001  # as _next answers it
                        going = await self._fast_failed(taken, error)
                    if not going:
                        break
                    if clock() > turn_ends:
                        # Let the loop run between runs of frames: the database replies
                        # of the publish batcher and of the claim wait for this task
                        # otherwise, and with them the next batch.
                        await asyncio.sleep(0)
                        turn_ends = clock() + TURN_SECONDS
                if self._input_full and not self._lost:
                    self._input_full = False
                    self._apply_reading()
        except Exception:
            log.exception("amqp %s: connection failed", self.name)
            self._abort()
        finally:
            await self._close_all_channels()
            self._gone_cb(self)

    def _take_fast(self) -> Content | tuple[int, int, bool] | None:
        """A whole publish, or an ack as (channel, tag, multiple), when the next frames
        are one on a channel that expects it; None: nothing taken."""
        if self.state is not State.OPEN:
            return None
        reader = self._reader
        return reader.take_publish(self._takes_publish) or reader.take_ack(self._expects_method)

    def _publish_now(self, content: Content) -> bool:
        handler = self.channels[content.channel].handler
        assert handler is not None  # checked by _takes_publish
        return handler.publish_now(content)

    async def _publish(self, content: Content) -> bool:
        """A publish the handler could not take without awaiting."""
        await self._channel_result(self.channels[content.channel], content)
        return True

    def _ack_now(self, number: int, tag: int, multiple: bool) -> bool:
        handler = self.channels[number].handler
        assert handler is not None  # checked by _expects_method
        handler.ack_now(tag, multiple)
        return True

    async def _fast_failed(
        self, taken: Content | tuple[int, int, bool] | None, error: Exception
    ) -> bool:
        """Answer what handling a publish or an ack raised, as `_next` would."""
        if isinstance(error, replies.ChannelError) and taken is not None:
            number = taken[0] if isinstance(taken, tuple) else taken.channel
            await self._answer(close_for(error, number))
            return True
        return await self._frame_failed(error)

    def _expects_method(self, number: int) -> bool:
        """Whether channel `number` is open, with a handler, and between contents."""
        channel = self.channels.get(number)
        return (
            channel is not None
            and not channel.closing
            and channel.handler is not None
            and channel.assembler.idle
        )

    def _takes_publish(self, number: int, body_size: int) -> bool:
        return (
            self._expects_method(number)
            and body_size <= self.channels[number].assembler.max_message_size
        )

    async def _next(self) -> bool:
        """Handle one frame; False when no complete frame is buffered."""
        try:
            frame = self._reader.next_frame()
            if frame is None:
                return False
            if self.state is State.CLOSED:
                return True
            # A frame on an open channel (a publish's three, a consumer's ack) skips the
            # general path's coroutine layers (_handle, _channel_frame: the same checks),
            # and basic.ack goes straight to its handler.
            channel = self.channels.get(frame.channel) if self.state is State.OPEN else None
            if (
                channel is None
                or channel.closing
                or not isinstance(frame, MethodFrame | RawContentHeader | BodyFrame)
            ):
                await self._handle(frame)
            else:
                result = channel.assembler.feed(frame)
                if result is None:
                    if not isinstance(frame, BodyFrame):
                        await self._content_started(channel, frame)
                elif (
                    type(result) is MethodFrame
                    and type(result.method) is commands.Basic.Ack
                    and channel.handler is not None
                ):
                    try:
                        await channel.handler.basic_ack(result.method)
                    except replies.ChannelError as error:
                        await self._answer(close_for(error, channel.number))
                else:
                    await self._channel_result(channel, result)
        except Exception as error:  # noqa: BLE001  # each kind answered in _frame_failed
            return await self._frame_failed(error)
        return True

    async def _frame_failed(self, error: Exception) -> bool:
        """Answer what handling a frame raised; False when no frame should follow."""
        if isinstance(error, replies.ProtocolHeaderMismatch):
            log.info("amqp %s: %s; answering with the 0-9-1 header", self.name, error)
            self.send(error.answer)
            self.state = State.CLOSED
            self._close_transport()
            return False
        if isinstance(error, replies.FrameError):
            await self._answer(close_for(error))
            return not error.fatal
        if isinstance(error, replies.AMQPError):
            await self._answer(close_for(error))
            return True
        # a bug (here or in a handler): this connection only
        log.error("amqp %s: internal error; closing the connection", self.name, exc_info=error)
        text = _reply_text(replies.INTERNAL_ERROR, "internal error")
        await self._answer(Close(0, replies.INTERNAL_ERROR, text, drop=True))
        return False

    async def _handle(self, frame: Frame) -> None:
        if isinstance(frame, ProtocolHeaderFrame):
            self.send_method(
                0,
                methods.build_method(
                    commands.Connection.Start,
                    version_major=0,
                    version_minor=9,
                    server_properties=server_properties(),
                    mechanisms=" ".join(MECHANISMS),
                    locales="en_US",
                ),
            )
            self.state = State.START_OK
            return
        if isinstance(frame, HeartbeatFrame):
            return
        if self.state is State.CLOSING:
            await self._while_closing(frame)
            return
        if frame.channel == 0:
            assert isinstance(frame, MethodFrame)  # the reader refuses the others
            await self._connection_method(frame.method)
            return
        if self.state is not State.OPEN:
            raise replies.AMQPConnectionError(
                replies.CHANNEL_ERROR,
                f"unexpected frame on channel {frame.channel} in connection state "
                f"{self.state.name.lower()}",
            )
        await self._channel_frame(frame)

    async def _while_closing(self, frame: Frame) -> None:
        """After our connection.close only close and close-ok count; the rest is dropped."""
        if not isinstance(frame, MethodFrame) or frame.channel != 0:
            return
        if isinstance(frame.method, commands.Connection.Close):
            self.send_method(0, commands.Connection.CloseOk())
            self._finish()
        elif isinstance(frame.method, commands.Connection.CloseOk):
            self._finish()

    def _finish(self) -> None:
        self.state = State.CLOSED
        self._close_transport()

    # ---- connection methods -----------------------------------------------------------

    async def _connection_method(self, method: base.Frame) -> None:
        state = self.state
        if isinstance(method, commands.Connection.Close):
            log.debug(
                "amqp %s: client closed: %s %s", self.name, method.reply_code, method.reply_text
            )
            await self._close_all_channels()
            self.send_method(0, commands.Connection.CloseOk())
            self._finish()
        elif isinstance(method, commands.Connection.CloseOk):
            pass  # not awaited (we sent no close): nothing to do
        elif isinstance(method, commands.Connection.StartOk) and state is State.START_OK:
            await self._start_ok(method)
        elif isinstance(method, commands.Connection.TuneOk) and state is State.TUNE_OK:
            self._tune_ok(method)
        elif isinstance(method, commands.Connection.Open) and state is State.OPEN_WAIT:
            await self._open(method)
        elif isinstance(method, commands.Connection.UpdateSecret) and state is State.OPEN:
            # A token refresh (OAuth 2). RabbitMQ's internal user database keeps the
            # connection's user as it is and says ok; so does Pepsi's.
            log.info("amqp %s: update-secret (%s): user unchanged", self.name, method.reason)
            self.send_method(0, commands.Connection.UpdateSecretOk())
        else:
            raise replies.AMQPConnectionError(
                replies.CHANNEL_ERROR,
                f"unexpected method {method.name} in connection state {state.name.lower()}",
                method.index >> 16,
                method.index & 0xFFFF,
            )

    async def _start_ok(self, method: commands.Connection.StartOk) -> None:
        properties = method.client_properties or {}
        capabilities = properties.get("capabilities") if isinstance(properties, dict) else None
        self.client_capabilities = dict(capabilities) if isinstance(capabilities, dict) else {}
        mechanism = str(method.mechanism)
        self.mechanism = mechanism
        if mechanism not in MECHANISMS:
            raise replies.AMQPConnectionError(
                replies.COMMAND_INVALID, f"unknown authentication mechanism '{mechanism}'"
            )
        self.state = State.SECURING
        try:
            credentials = parse_response(mechanism, method.response)
        except SaslError as error:
            refusal: str | None = f"unreadable {mechanism} response: {error}"
            username = "?"
        else:
            username = credentials.username
            refusal = await self.gatekeeper.login(credentials, self.peer)
        if self._lost:
            return
        if refusal is not None:
            log.warning("amqp %s: login refused: %s", self.name, refusal)
            await self._refuse_login()
            return
        self.username = username
        self.send_method(
            0,
            methods.build_method(
                commands.Connection.Tune,
                channel_max=self.options.amqp.channel_max,
                frame_max=self.options.amqp.frame_max,
                heartbeat=self.options.amqp.heartbeat,
            ),
        )
        self.state = State.TUNE_OK

    async def _refuse_login(self) -> None:
        # As RabbitMQ: a client that announced authentication_failure_close gets 403
        # before the socket closes; the others only see the socket close (the spec).
        if self.client_capabilities.get("authentication_failure_close"):
            error = replies.AMQPConnectionError(
                replies.ACCESS_REFUSED,
                f"Login was refused using authentication mechanism {self.mechanism}. "
                "For details see the broker logfile.",
            )
            await self._answer(close_for(error))
            return
        self.state = State.CLOSED
        self._close_transport()

    def _tune_ok(self, method: commands.Connection.TuneOk) -> None:
        amqp = self.options.amqp
        tuned = negotiate_tune(
            amqp.channel_max, amqp.frame_max, method.channel_max, method.frame_max, method.heartbeat
        )
        self.channel_max, self.frame_max, self.heartbeat = (
            tuned.channel_max,
            tuned.frame_max,
            tuned.heartbeat,
        )
        self._reader.frame_max = tuned.frame_max
        self.state = State.OPEN_WAIT
        if tuned.heartbeat > 0:
            self._last_received = self._loop.time()
            self._timers["heartbeat"] = self._loop.call_later(
                tuned.heartbeat / 2, self._heartbeat_tick
            )

    async def _open(self, method: commands.Connection.Open) -> None:
        assert self.username is not None
        vhost = str(method.virtual_host)
        self.permission = await self.gatekeeper.vhost_permission(self.username, vhost)
        if self._lost:
            return
        self.vhost = vhost
        self.send_method(0, commands.Connection.OpenOk())
        self.state = State.OPEN
        self._cancel_timer("handshake")
        log.info("amqp %s: user '%s' opened vhost '%s'", self.name, self.username, vhost)
        self._opened_cb(self)
        self.set_blocked(self._blocked_now())

    # ---- channels ----------------------------------------------------------------------

    async def _channel_frame(self, frame: MethodFrame | RawContentHeader | BodyFrame) -> None:
        number = frame.channel
        channel = self.channels.get(number)
        if channel is None:
            if isinstance(frame, MethodFrame) and isinstance(frame.method, commands.Channel.Open):
                self._channel_open(number)
                return
            raise replies.AMQPConnectionError(
                replies.CHANNEL_ERROR, f"expected 'channel.open' on channel {number}"
            )
        if channel.closing:
            # after our channel.close the spec has us discard all but close and close-ok
            if isinstance(frame, MethodFrame):
                if isinstance(frame.method, commands.Channel.Close):
                    channel.send_method(commands.Channel.CloseOk())
                elif isinstance(frame.method, commands.Channel.CloseOk):
                    del self.channels[number]
            return
        result = channel.assembler.feed(frame)
        if result is not None:
            await self._channel_result(channel, result)
        elif not isinstance(frame, BodyFrame):
            await self._content_started(channel, frame)

    async def _content_started(
        self, channel: Channel, frame: MethodFrame | RawContentHeader
    ) -> None:
        """A publish's method or header was just taken: refuse it, if it is to be
        refused, before any of its body is kept (issue 34)."""
        try:
            if type(frame) is RawContentHeader:
                if frame.body_size:
                    await self._reserve(channel, frame.body_size)
            elif channel.handler is not None:
                await channel.handler.publish_started(cast(MethodFrame, frame).method)
        except replies.ChannelError as error:
            await self._answer(close_for(error, channel.number))

    async def _reserve(self, channel: Channel, size: int) -> None:
        """Reserve a content's body in PublishMemory: at once, after a wait for room
        (connection.blocked), or not at all (506 RESOURCE_ERROR)."""
        fits = self.memory.fits(size)
        why = memory.refusal(
            size,
            self._held,
            connection_limit=self.options.amqp.connection_publish_buffer,
            fits_in_all=fits,
        )
        if why is not None:
            raise replies.ChannelError(replies.RESOURCE_ERROR, why)
        if not fits:
            await self.memory.room(size)  # meanwhile this connection is not read
        self.memory.take(size)
        channel.reserved = size
        self._held += size

    def _release(self, channel: Channel) -> None:
        if channel.reserved:
            self.memory.give(channel.reserved)
            self._held -= channel.reserved
            channel.reserved = 0

    async def _channel_result(self, channel: Channel, result: MethodFrame | Content) -> None:
        number = channel.number
        try:
            if isinstance(result, Content):
                try:
                    await self._dispatch(channel, result.method, result)
                finally:
                    self._release(channel)  # handed on, or refused
            else:
                await self._channel_method(channel, result.method)
        except replies.ChannelError as error:
            await self._answer(close_for(error, number))

    def _channel_open(self, number: int) -> None:
        problem = channel_open_problem(
            self.channel_max, len(self.channels), number in self.channels
        )
        if problem is not None:
            raise replies.AMQPConnectionError(problem.code, problem.text, 20, 10)
        channel = Channel(self, number)
        channel.handler = self.broker.channel_handler(channel)
        self.channels[number] = channel
        channel.send_method(commands.Channel.OpenOk())

    async def _channel_method(self, channel: Channel, method: base.Frame) -> None:
        if isinstance(method, commands.Channel.Open):
            problem = channel_open_problem(self.channel_max, len(self.channels), True)
            assert problem is not None
            raise replies.AMQPConnectionError(problem.code, problem.text, 20, 10)
        if isinstance(method, commands.Channel.Close):
            del self.channels[channel.number]
            await self._channel_closed(channel)
            channel.send_method(commands.Channel.CloseOk())
        elif isinstance(method, commands.Channel.CloseOk):
            pass  # we sent no close on an open channel: nothing to settle
        elif isinstance(method, commands.Channel.Flow):
            if not method.active:
                # RabbitMQ 3.x no longer lets a client stop its deliveries this way
                raise replies.AMQPConnectionError(replies.NOT_IMPLEMENTED, "active=false", 20, 20)
            channel.send_method(methods.build_method(commands.Channel.FlowOk, active=True))
        elif isinstance(method, commands.Channel.FlowOk):
            pass  # we never send channel.flow
        else:
            await self._dispatch(channel, method, None)

    async def _dispatch(
        self, channel: Channel, method: base.Frame, content: Content | None
    ) -> None:
        """The one dispatch point for channel-level methods (CHANNEL_METHODS)."""
        name = CHANNEL_METHODS.get(type(method))
        if name is None:  # a method only servers send, or connection.* on a channel
            raise replies.AMQPConnectionError(
                replies.COMMAND_INVALID,
                f"unimplemented method {method.name} on channel {channel.number}",
                method.index >> 16,
                method.index & 0xFFFF,
            )
        handle: Callable[[Any], Awaitable[None]] = getattr(channel.handler, name)
        await handle(content if content is not None else method)

    async def _channel_closed(self, channel: Channel) -> None:
        self._release(channel)  # a content in progress is dropped with its channel ...
        channel.assembler.reset()  # ... and its memory given back now
        handler, channel.handler = channel.handler, None
        if handler is not None:
            try:
                await handler.closed()
            except Exception:
                log.exception(
                    "amqp %s: channel %d: closing its handler failed", self.name, channel.number
                )

    async def _close_all_channels(self) -> None:
        channels, self.channels = list(self.channels.values()), {}
        for channel in channels:
            await self._channel_closed(channel)

    # ---- answering errors ----------------------------------------------------------------

    async def _answer(self, close: Close) -> None:
        """Send the close an error calls for (`close_for`)."""
        if self.state is State.CLOSED:
            return
        if close.channel:
            channel = self.channels.get(close.channel)
            if channel is None or channel.closing:
                return
            log.info("amqp %s: closing channel %d: %s", self.name, close.channel, close.text)
            channel.closing = True
            channel.assembler.reset()
            await self._channel_closed(channel)
            channel.send_method(self._close_method(commands.Channel.Close, close))
            return
        if self.state is State.CLOSING:
            return  # one connection.close is enough
        log.warning("amqp %s: closing connection: %s", self.name, close.text)
        await self._close_all_channels()
        if self.state is not State.HEADER:
            self.send_method(0, self._close_method(commands.Connection.Close, close))
        if close.drop or self.state is State.HEADER:
            self._finish()
            return
        self.state = State.CLOSING
        self._timer("close", self.options.close_timeout, self._abort)

    @staticmethod
    def _close_method(method_class: type[base.Frame], close: Close) -> base.Frame:
        return methods.build_method(
            method_class,
            reply_code=close.code,
            reply_text=close.text,
            class_id=close.class_id,
            method_id=close.method_id,
        )


__all__ = [
    "CHANNEL_METHODS",
    "Broker",
    "Channel",
    "ChannelHandler",
    "Close",
    "Connection",
    "ConnectionOptions",
    "Gatekeeper",
    "HeartbeatDue",
    "NoBroker",
    "Tuned",
    "channel_open_problem",
    "close_for",
    "heartbeat_due",
    "negotiate_tune",
    "server_properties",
]
