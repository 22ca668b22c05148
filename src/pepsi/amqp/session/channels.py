"""A connection's channels: the table, channel.open/close/flow, and the dispatch to handlers.

`channel.open|close|close-ok|flow` are handled here; every other channel-level
method goes through **one dispatch point**, `handler.CHANNEL_METHODS`, to the
channel's `ChannelHandler`, which gets `closed()` exactly once when its channel
goes. channel_max bounds how many are open at once (`channel_open_problem`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

from pamqp import base, commands

from pepsi.amqp.session.closing import close_for
from pepsi.amqp.session.content import ContentIntake
from pepsi.amqp.session.handler import CHANNEL_METHODS, Channel
from pepsi.amqp.wire import methods, replies
from pepsi.amqp.wire.frames import BodyFrame, Content, MethodFrame, RawContentHeader

log = logging.getLogger("pepsi.amqp")

# CHANNEL_METHODS' lookup, bound once: CPython 3.11 calls a method of an imported name
# through a new bound-method object each time (no LOAD_METHOD), and this is per method.
_handler_name: Final = CHANNEL_METHODS.get


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


class ChannelTable(ContentIntake):
    """The open channels (`channels`) and their lifecycle."""

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
        name = _handler_name(type(method))
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


__all__ = [
    "channel_open_problem",
]
