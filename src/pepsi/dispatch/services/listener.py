"""The listener: LISTEN on `workqueue`, one wakeup per notification burst (P-3);
and on `config_changed` (P-10) and `telemetry_changed` (P-11).

It runs on a connection of its own for the dispatcher's whole life. The
payload is ignored: a notification only says "look". A (re)connection wakes
the loop too, since notifications sent while it was away are lost; and so
does losing it, so that the loop finds a lost claim connection at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

from pepsi.db.queries import query
from pepsi.dispatch.session import SessionOptions, connect
from pepsi.durations import format_seconds
from pepsi.errors import is_reconnect, one_line

log = logging.getLogger("pepsi.dispatch")


RESYNC = '{"kind": "resync"}'  # amqp_changed: check every open AMQP connection again


class Listener:
    def __init__(
        self,
        options: SessionOptions,
        wake: Callable[[str], None],
        on_channel: Callable[[str, str], None],
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.options = options
        self.wake = wake
        self.on_channel = on_channel  # (channel, payload): config_, telemetry_, amqp_changed
        self.rng = rng  # the backoff's jitter
        self.listening = False  # since the last connection error

    async def run(self) -> None:
        """Listen until cancelled, reconnecting with backoff."""
        delays = self.options.backoff.delays(self.rng)
        while True:
            try:
                await self.run_once()
            except Exception as exc:  # the listener must outlive any failure: it retries
                if self.listening:  # it was up: the backoff starts again
                    self.listening, delays = False, self.options.backoff.delays(self.rng)
                    # A failover ends the claim connection too; an idle loop would find
                    # out only at its next poll tick. A cycle now finds out at once.
                    self.wake("notify")
                delay = next(delays)
                wait = format_seconds(delay)
                if is_reconnect(exc):
                    log.warning("listener: %s; reconnecting in %s", one_line(exc), wait)
                else:
                    log.exception("listener failed; reconnecting in %s", wait)
                await asyncio.sleep(delay)

    async def run_once(self) -> None:
        """One connection's life: wake on connecting and on every notification."""
        options = self.options
        conn = await connect(options.dsn, "pepsi-dispatch-listen", options.connect_timeout)
        async with conn:
            for name in ("workqueue_listen", "config_listen", "telemetry_listen", "amqp_listen"):
                await conn.execute(query(name))
            self.listening = True
            self.wake("notify")  # a (re)connection may have missed notifications
            self.on_channel("amqp_changed", RESYNC)  # ... of AMQP users and vhosts too
            async for notify in conn.notifies():
                if notify.channel == "workqueue":
                    self.wake("notify")
                else:
                    self.on_channel(notify.channel, notify.payload)
