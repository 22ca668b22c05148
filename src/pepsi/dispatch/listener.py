"""The listener: LISTEN on `workqueue`, one wakeup per notification burst (P-3);
and on `config_changed` (P-10) and `telemetry_changed` (P-11).

It runs on a connection of its own for the dispatcher's whole life. The
payload is ignored: a notification only says "look". A (re)connection wakes
the loop too, since notifications sent while it was away are lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pepsi.db.queries import query
from pepsi.dispatch.session import RECONNECT_FIRST, SessionOptions, backoff, connect
from pepsi.durations import format_seconds
from pepsi.errors import is_reconnect, one_line

log = logging.getLogger("pepsi.dispatch")


class Listener:
    def __init__(
        self,
        options: SessionOptions,
        wake: Callable[[str], None],
        on_channel: Callable[[str], None],
    ) -> None:
        self.options = options
        self.wake = wake
        self.on_channel = on_channel  # config_changed, telemetry_changed
        self.listening = False  # since the last connection error

    async def run(self) -> None:
        """Listen until cancelled, reconnecting with backoff."""
        delay = RECONNECT_FIRST
        while True:
            try:
                await self.run_once()
            except Exception as exc:  # the listener must outlive any failure: it retries
                if self.listening:  # it was up: the backoff starts again
                    self.listening, delay = False, RECONNECT_FIRST
                wait = format_seconds(delay)
                if is_reconnect(exc):
                    log.warning("listener: %s; reconnecting in %s", one_line(exc), wait)
                else:
                    log.exception("listener failed; reconnecting in %s", wait)
                await asyncio.sleep(delay)
                delay = backoff(delay, self.options.reconnect_max)

    async def run_once(self) -> None:
        """One connection's life: wake on connecting and on every notification."""
        options = self.options
        conn = await connect(options.dsn, "pepsi-dispatch-listen", options.connect_timeout)
        async with conn:
            for name in ("workqueue_listen", "config_listen", "telemetry_listen"):
                await conn.execute(query(name))
            self.listening = True
            self.wake("notify")  # a (re)connection may have missed notifications
            async for notify in conn.notifies():
                if notify.channel == "workqueue":
                    self.wake("notify")
                else:
                    self.on_channel(notify.channel)
