"""Closing a channel or the connection: which close answers which error, and sending it.

Hard reply codes close the connection, soft ones the channel (`close_for`, pure:
tests/unit/test_amqp_negotiation.py covers it); `Closing._answer` sends the close
and drops what it closes. After our connection.close only close and close-ok are
read; at the server's stop, `shutdown` sends 320 CONNECTION_FORCED.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pamqp import base, commands

from pepsi.amqp.session.handler import Channel
from pepsi.amqp.session.shell import Shell, State
from pepsi.amqp.wire import methods, replies
from pepsi.amqp.wire.frames import Frame, MethodFrame

log = logging.getLogger("pepsi.amqp")


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


def reply_text(code: int, text: str) -> str:
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
    return Close(where, code, reply_text(code, text), error.class_id, error.method_id, drop)


class Closing(Shell):
    """Closes sent and received, over the shell (`channels.ChannelTable` drops channels)."""

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
                reply_text=reply_text(replies.CONNECTION_FORCED, text),
                class_id=0,
                method_id=0,
            ),
        )
        self.state = State.CLOSING
        self._close_transport()

    # ---- provided by channels.ChannelTable -------------------------------------------

    async def _channel_closed(self, channel: Channel) -> None:
        raise NotImplementedError

    async def _close_all_channels(self) -> None:
        raise NotImplementedError


__all__ = [
    "Close",
    "close_for",
]
