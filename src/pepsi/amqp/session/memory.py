"""The bytes of publishes being received, bounded per connection and in all (issue 34).

A content header reserves its body's size before any body frame is kept, and the
reservation lasts until the content is handed to the publish batcher (which bounds
its own queue) or dropped with its channel or connection. Two keys bound it:

- `CONNECTION_PUBLISH_BUFFER`: one connection's reservations. A header past it is
  refused at once (506 on its channel, its body discarded unread): a client
  interleaving large contents on many channels gets no more memory than one sending
  them one after the other.
- `PUBLISH_BUFFER`: everyone's, RabbitMQ's memory high watermark for publishes. A
  header past it waits, with `connection.blocked` sent to every client and its
  connection not read, until others' contents are handed on; a connection with other
  contents of its own still unfinished cannot wait (they would never finish behind
  it), so that header is refused like the per-connection one.

The decisions are pure (`refusal`); `PublishMemory` is the counter and its waiters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

MIB = 1024 * 1024


def refusal(
    size: int, connection_held: int, *, connection_limit: int, fits_in_all: bool
) -> str | None:
    """Why a content of `size` bytes is refused now (None: take it, or wait if it does
    not fit in all), given what its connection already holds."""
    if connection_held + size > connection_limit:
        return (
            f"a content of {size} bytes on top of {connection_held} bytes of unfinished "
            f"publishes on this connection: CONNECTION_PUBLISH_BUFFER allows {connection_limit}"
        )
    if not fits_in_all and connection_held:
        return (
            f"a content of {size} bytes while publishes fill PUBLISH_BUFFER, with "
            f"{connection_held} bytes of this connection's own still unfinished"
        )
    return None


class PublishMemory:
    """The bytes reserved by contents being received, in all connections."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._waiting = 0
        self._freed = asyncio.Event()
        # connection.blocked for every client while a header waits for room; None: unblocked
        self.on_blocked: Callable[[str | None], None] = lambda _: None

    def fits(self, size: int) -> bool:
        # One content larger than the whole bound may come alone (MAX_MESSAGE_SIZE says
        # how large one may be), or it could never be published.
        return self.held + size <= self.limit or self.held == 0

    def take(self, size: int) -> None:
        self.held += size

    def give(self, size: int) -> None:
        self.held -= size
        if self._waiting:
            self._freed.set()

    async def room(self, size: int) -> None:
        """Return once `size` bytes fit; clients are told they are blocked meanwhile."""
        self._waiting += 1
        if self._waiting == 1:
            self.on_blocked(
                f"memory: {self.held // MIB} MiB of publishes being received, "
                f"PUBLISH_BUFFER is {self.limit // MIB} MiB"
            )
        try:
            while not self.fits(size):
                self._freed.clear()
                await self._freed.wait()
        finally:
            self._waiting -= 1
            if not self._waiting:
                self.on_blocked(None)
            else:
                self._freed.set()  # another waiter may fit now
