"""A publish's content while it is received: refused early, its body's memory reserved.

A content method or header is checked as it arrives, before any of its body is
kept (issue 34): the handler's `publish_started` may refuse it, and its header
reserves the body's size in `memory.PublishMemory` (at once, after a wait for
room with the connection unread, or refused with 506) until the content is handed
on or dropped with its channel. The frames themselves are assembled by each
channel's `ContentAssembler`.
"""

from __future__ import annotations

from typing import cast

from pepsi.amqp.session import memory
from pepsi.amqp.session.closing import Closing, close_for
from pepsi.amqp.session.handler import Channel
from pepsi.amqp.wire import replies
from pepsi.amqp.wire.frames import MethodFrame, RawContentHeader


class ContentIntake(Closing):
    """Contents in progress and their PublishMemory reservations (`_held` in all)."""

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
