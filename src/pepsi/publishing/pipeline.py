"""Pipelined publishing: `Pipeline` (async, the source) and `SyncPipeline` (a thin side).

`SyncPipeline` runs an async `Pipeline` with a publisher of its own on a
private event loop in a thread: the batching, the bound on unconfirmed
messages and the refusals are the async pipeline's, written once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Iterable
from concurrent.futures import Future
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self, TypeVar

from pepsi.publishing import batch
from pepsi.publishing.message import OutgoingMessage

if TYPE_CHECKING:
    from pepsi.config import Config

T = TypeVar("T")


class AsyncPublisher(Protocol):
    """What a pipeline needs of its publisher: `publishing.async_client.AsyncPublisher`, which
    makes pipelines (so this module does not import it back)."""

    @property
    def config(self) -> Config: ...

    async def open(self) -> None: ...

    async def refresh(self) -> None: ...

    async def publish_many(self, messages: Iterable[OutgoingMessage]) -> list[int]: ...

    def pipeline(
        self, *, max_outstanding: int = ..., max_batch: int = ..., concurrency: int = ...
    ) -> Pipeline: ...

    async def close(self) -> None: ...


def _check(max_outstanding: int, max_batch: int, concurrency: int) -> None:
    if max_outstanding < 1 or max_batch < 1 or concurrency < 1:
        raise ValueError("max_outstanding, max_batch and concurrency must be at least 1")


class Pipeline:
    """Pipelined publishing with a bound on unconfirmed messages.

    `submit()` validates the message and returns a future of its id at once;
    it waits only while `max_outstanding` messages are unconfirmed (RabbitMQ's
    outstanding-confirms limiter). Sender tasks gather what is queued into
    batches of up to `max_batch`, one transaction each, on `concurrency`
    connections. A batch that is refused fails the futures of its messages.
    """

    def __init__(
        self, publisher: AsyncPublisher, *, max_outstanding: int, max_batch: int, concurrency: int
    ) -> None:
        _check(max_outstanding, max_batch, concurrency)
        self.publisher = publisher
        self.max_batch = max_batch
        self.slots = asyncio.Semaphore(max_outstanding)
        self.queue: asyncio.Queue[tuple[OutgoingMessage, asyncio.Future[int]]] = asyncio.Queue()
        self.senders = [asyncio.create_task(self._send()) for _ in range(concurrency)]
        self.outstanding: set[asyncio.Future[int]] = set()
        self.batches = 0  # transactions sent, confirmed or not

    async def submit(self, message: OutgoingMessage) -> asyncio.Future[int]:
        if message.stage not in self.publisher.config.stages:
            await self.publisher.refresh()  # a stage added to the overlay since
        batch.build([message], self.publisher.config)  # refuse a bad message now, not later
        await self.slots.acquire()
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.outstanding.add(future)
        future.add_done_callback(self._settled)
        self.queue.put_nowait((message, future))
        return future

    def _settled(self, future: asyncio.Future[int]) -> None:
        self.outstanding.discard(future)
        self.slots.release()

    async def _send(self) -> None:
        while True:
            items = [await self.queue.get()]
            while len(items) < self.max_batch and not self.queue.empty():
                items.append(self.queue.get_nowait())
            self.batches += 1
            try:
                ids = await self.publisher.publish_many([m for m, _ in items])
            except Exception as exc:  # noqa: BLE001  # each future carries its batch's refusal
                for _, future in items:
                    if not future.done():
                        future.set_exception(exc)
            else:
                for (_, future), wid in zip(items, ids, strict=True):
                    if not future.done():
                        future.set_result(wid)

    async def flush(self) -> None:
        """Wait until every submitted message is confirmed or refused."""
        if self.outstanding:
            await asyncio.wait(list(self.outstanding))

    async def close(self) -> None:
        await self.flush()
        for task in self.senders:
            task.cancel()
        for task in self.senders:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class SyncPipeline:
    """`Pipeline` for synchronous code: `submit()` returns a `concurrent.futures.Future`.

    `submit()` blocks only while `max_outstanding` messages are unconfirmed,
    and raises `InvalidMessage`/`NoRoute` itself, as the async one does.
    """

    def __init__(
        self,
        publisher: Callable[[], AsyncPublisher],
        *,
        max_outstanding: int,
        max_batch: int,
        concurrency: int,
    ) -> None:
        _check(max_outstanding, max_batch, concurrency)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="pepsi-pipeline", daemon=True
        )
        self.thread.start()
        self.publisher = publisher()
        try:
            self._call(self.publisher.open())
            self.pipe = self._call(self._start(max_outstanding, max_batch, concurrency))
        except BaseException:
            self._stop()
            raise

    async def _start(self, max_outstanding: int, max_batch: int, concurrency: int) -> Pipeline:
        return self.publisher.pipeline(
            max_outstanding=max_outstanding, max_batch=max_batch, concurrency=concurrency
        )

    def _call(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result()

    def submit(self, message: OutgoingMessage) -> Future[int]:
        """A future of the message's id, set once its batch is confirmed (or refused)."""
        result: Future[int] = Future()
        self._call(self._submit(message, result))
        return result

    async def _submit(self, message: OutgoingMessage, result: Future[int]) -> None:
        future = await self.pipe.submit(message)

        def settle(done: asyncio.Future[int]) -> None:
            if done.cancelled():
                result.cancel()
            elif (exc := done.exception()) is not None:
                result.set_exception(exc)
            else:
                result.set_result(done.result())

        future.add_done_callback(settle)

    @property
    def outstanding(self) -> int:
        """How many submitted messages are not yet confirmed or refused."""
        return len(self.pipe.outstanding)

    def flush(self) -> None:
        """Wait until every submitted message is confirmed or refused."""
        self._call(self.pipe.flush())

    def close(self) -> None:
        """Flush, stop the senders, close the pipeline's own publisher and loop."""
        try:
            self._call(self.pipe.close())
        finally:
            self._stop()

    def _stop(self) -> None:
        try:
            self._call(self.publisher.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
