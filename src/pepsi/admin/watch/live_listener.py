"""Listening for the dispatcher's live snapshots: LISTEN on a connection, feed a `LiveRates`.

`LiveListener` (a sync connection: `pepsi top`) and `AsyncLiveListener` (an
asyncio application: the web console) LISTEN on CHANNEL; each notification is
parsed and joined (`pepsi.admin.watch.live_snapshot`) and the whole snapshots
feed the rates (`pepsi.admin.watch.live.LiveRates`), stamped with the
reader's own monotonic clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import psycopg

from pepsi.admin.watch.live import LiveRates, LiveView
from pepsi.admin.watch.live_snapshot import Assembler, LiveSnapshot, parse
from pepsi.db.queries import query

log = logging.getLogger("pepsi.admin")

CHANNEL = "pepsi_live"  # pepsi.dispatch.services.live.CHANNEL


class _Feed:
    """Notifications in, snapshots out: the part both listeners share."""

    def __init__(self, rates: LiveRates | None, clock: Callable[[], float]) -> None:
        self.rates = LiveRates() if rates is None else rates
        self.clock = clock
        self.assembler = Assembler()

    def notify(self, channel: str, payload: str) -> LiveSnapshot | None:
        if channel != CHANNEL:
            return None
        try:
            part = parse(payload)
        except ValueError as exc:
            log.debug("ignoring a notification on %s: %s", CHANNEL, exc)
            return None
        snapshot = self.assembler.add(part)
        if snapshot is not None:
            self.rates.feed(snapshot, self.clock())
        return snapshot

    def view(self) -> LiveView:
        return self.rates.view(self.clock())


class LiveListener:
    """LISTEN on a sync (autocommit) connection; notifications feed `rates`.

    Notifications that arrive while the connection runs other queries are kept
    by psycopg and read by the next `snapshots`/`wait`, so one connection can
    serve both the reads and the listening (as `pepsi top` does).
    """

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        rates: LiveRates | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.conn = conn
        self._feed = _Feed(rates, clock)

    @property
    def rates(self) -> LiveRates:
        return self._feed.rates

    def start(self) -> None:
        self.conn.execute(query("live_listen"))

    def snapshots(self, timeout: float) -> Iterator[LiveSnapshot]:
        """The snapshots that come within `timeout` seconds (0: those already here)."""
        for notify in self.conn.notifies(timeout=max(0.0, timeout)):
            snapshot = self._feed.notify(notify.channel, notify.payload)
            if snapshot is not None:
                yield snapshot

    def wait(self, timeout: float) -> None:
        """Spend `timeout` seconds reading notifications (instead of sleeping)."""
        for _ in self.snapshots(timeout):
            pass

    def view(self) -> LiveView:
        return self._feed.view()


class AsyncLiveListener:
    """The same on an asyncio connection: `await start()`, then iterate `snapshots()` in a
    task (it runs until cancelled or the connection fails); `view()` at any time."""

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        rates: LiveRates | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.conn = conn
        self._feed = _Feed(rates, clock)

    @property
    def rates(self) -> LiveRates:
        return self._feed.rates

    async def start(self) -> None:
        await self.conn.execute(query("live_listen"))

    async def snapshots(self, timeout: float | None = None) -> AsyncIterator[LiveSnapshot]:
        async for notify in self.conn.notifies(timeout=timeout):
            snapshot = self._feed.notify(notify.channel, notify.payload)
            if snapshot is not None:
                yield snapshot

    async def run(self) -> None:
        """Feed the rates until cancelled."""
        async for _ in self.snapshots():
            pass

    def view(self) -> LiveView:
        return self._feed.view()
