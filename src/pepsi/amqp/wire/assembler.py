"""A channel's content assembly: method, header and body frames joined into `Content`.

One `ContentAssembler` per channel, fed the frames the reader cuts for it; the body
is bounded by the configured max message size (406, as RabbitMQ), and a large one is
kept off the heap.
"""

from __future__ import annotations

import mmap
from typing import Final

from pamqp import base

from pepsi.amqp.wire.frames import BodyFrame, Content, MethodFrame, RawContentHeader
from pepsi.amqp.wire.replies import (
    FrameError,
    FrameFormatError,
    MessageTooLarge,
    UnexpectedFrame,
)

LARGE_BODY: Final = 1024 * 1024  # a body this large is assembled off the heap
DEFAULT_MAX_MESSAGE_SIZE: Final = 128 * 1024 * 1024  # RabbitMQ's max_message_size default
MAX_MESSAGE_SIZE_LIMIT: Final = 512 * 1024 * 1024  # RabbitMQ's ceiling for that setting


class ContentAssembler:
    """One channel's content state machine: method → (content method: header → body
    frames up to body_size) → `Content`. Errors reset it to expect a method; the server
    then closes the channel or connection and discards the rest of that content."""

    def __init__(self, channel: int, *, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE):
        if not 0 < max_message_size <= MAX_MESSAGE_SIZE_LIMIT:
            raise ValueError(f"max_message_size must be 1..{MAX_MESSAGE_SIZE_LIMIT}")
        self.channel = channel
        self.max_message_size = max_message_size
        self._method: base.Frame | None = None
        self._header: RawContentHeader | None = None
        self._parts: list[bytes] = []
        # A large body is written into anonymous memory of its own, which goes back to
        # the system at once when the content is done or dropped (parts on the heap
        # left the process 270 MB larger after a client dropped two 128 MiB contents).
        self._large: mmap.mmap | None = None
        self._at = 0
        self._remaining = 0

    @property
    def idle(self) -> bool:
        """True when no content is in progress (the next frame must be a method)."""
        return self._method is None

    def reset(self) -> None:
        self._method = None
        self._header = None
        self._parts = []
        if self._large is not None:
            self._large.close()
            self._large = None
        self._remaining = 0

    def feed(
        self, frame: MethodFrame | RawContentHeader | BodyFrame
    ) -> MethodFrame | Content | None:
        """Take the channel's next frame: a method without content comes straight back,
        a completed content comes back as `Content`, anything in between gives None."""
        if frame.channel != self.channel:
            raise ValueError(f"frame for channel {frame.channel} fed to channel {self.channel}")
        try:
            return self._step(frame)
        except FrameError:
            self.reset()
            raise

    def _where(self) -> dict[str, int]:
        method = self._method
        if method is None:
            return {"channel": self.channel}
        return {
            "channel": self.channel,
            "class_id": method.index >> 16,
            "method_id": method.index & 0xFFFF,
        }

    def _step(
        self, frame: MethodFrame | RawContentHeader | BodyFrame
    ) -> MethodFrame | Content | None:
        method = self._method
        if method is None:
            if not isinstance(frame, MethodFrame):
                raise UnexpectedFrame(
                    f"expected a method frame, got {_kind(frame)}", channel=self.channel
                )
            if not frame.has_content:
                return frame
            self._method = frame.method
            return None
        if self._header is None:
            if not isinstance(frame, RawContentHeader):
                raise UnexpectedFrame(
                    f"expected a content header after {method.name}, got {_kind(frame)}",
                    **self._where(),
                )
            if frame.body_size > self.max_message_size:
                raise MessageTooLarge(
                    f"message size {frame.body_size} is larger than configured max size "
                    f"{self.max_message_size}",
                    **self._where(),
                )
            if frame.body_size == 0:
                return self._complete(frame)
            self._header = frame
            self._remaining = frame.body_size
            if frame.body_size >= LARGE_BODY:
                self._large, self._at = mmap.mmap(-1, frame.body_size), 0
            return None
        if not isinstance(frame, BodyFrame):
            raise UnexpectedFrame(
                f"expected a content body after {method.name}, got {_kind(frame)}",
                **self._where(),
            )
        if len(frame.payload) > self._remaining:
            raise FrameFormatError(
                "content body frame exceeds remaining content size", **self._where()
            )
        self._keep(frame.payload)
        if self._remaining:
            return None
        return self._complete(self._header)

    def _keep(self, payload: bytes) -> None:
        if self._large is not None:
            end = self._at + len(payload)
            self._large[self._at : end] = payload
            self._at = end
        else:
            self._parts.append(payload)
        self._remaining -= len(payload)

    def _complete(self, header: RawContentHeader) -> Content:
        assert self._method is not None
        body = self._large[:] if self._large is not None else b"".join(self._parts)
        content = Content(self.channel, self._method, header, body)
        self.reset()
        return content


def _kind(frame: object) -> str:
    if isinstance(frame, MethodFrame):
        return f"method {frame.method.name}"
    if isinstance(frame, RawContentHeader):
        return "a content header"
    return "a content body"
