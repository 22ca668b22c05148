"""One AMQP 0-9-1 client connection: handshake, heartbeats, channels, closing.

The layers, from the socket up, are one object: `Connection` (here) over one
class per module, each a subclass of the one before (a frame never hops between
objects; a layer knows one above it only by a stub the subclass overrides):

- `shell.Shell` (an `asyncio.Protocol`: no stream copies, and the transport's
  own flow-control callbacks bound both buffers) feeds received bytes to a
  `FrameReader` and wakes one task per connection, `Connection._run`,
  which takes the complete frames in order and awaits their handling (a whole
  basic.publish or basic.ack at once, and without a coroutine when its handler
  can: the hot paths). Input is bounded: reading
  pauses while more than `INPUT_BUFFER_FRAMES` frames' worth of bytes wait, and
  while the transport's write buffer is over `write_high_water` (a client that
  does not read its socket stops being read; if that lasts `write_stall_timeout`
  it is dropped).
- `closing.Closing`: which close answers an error (`close_for`), and sending it.
- `content.ContentIntake`: a publish refused before any of its body is kept,
  its body's bytes reserved in `memory.PublishMemory` until handed on.
- `channels.ChannelTable`, channels: `channel.open|close|close-ok|flow` are
  handled there; every other channel-level method goes through **one dispatch
  point**, `CHANNEL_METHODS`, to the channel's `ChannelHandler`.
- `handshake.Handshake`, connection state: protocol header → start / start-ok
  (SASL via the `Gatekeeper`) → tune / tune-ok (`negotiate_tune`) → open (vhost
  access via the `Gatekeeper`) → open; then channels, until a close in either
  direction. The handshake must end within `handshake_timeout` of the accept.

The seam for the broker (exchanges, queues, publishing, consuming), in `handler`:

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

Pure decisions (tune negotiation, heartbeat deadlines, server properties,
admission: `negotiation`; which close for which error: `closing`; channel
numbers: `channels`) are plain functions; tests/unit/test_amqp_negotiation.py
covers them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Final, Self

from pamqp import commands

from pepsi.amqp.auth.permissions import MECHANISMS
from pepsi.amqp.session.closing import Close, close_for, reply_text
from pepsi.amqp.session.handshake import Handshake
from pepsi.amqp.session.negotiation import server_properties
from pepsi.amqp.session.shell import State
from pepsi.amqp.wire import methods, replies
from pepsi.amqp.wire.frames import (
    BodyFrame,
    Content,
    Frame,
    HeartbeatFrame,
    MethodFrame,
    ProtocolHeaderFrame,
    RawContentHeader,
)

log = logging.getLogger("pepsi.amqp")

# A connection's task handles frames for at most this long before it lets the loop run:
# a client's 1 000 buffered publishes would otherwise hold up the publish batcher's and
# the claim's database replies for 20 ms (measured with bench/amqp.py's publisher: +15 %).
TURN_SECONDS: Final = 0.002


class Connection(Handshake):
    """One client connection (see the module doc): the frame loop over its layers."""

    # ---- the frame loop --------------------------------------------------------------

    async def _run(self: Self) -> None:
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
        text = reply_text(replies.INTERNAL_ERROR, "internal error")
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


__all__ = [
    "Connection",
]
