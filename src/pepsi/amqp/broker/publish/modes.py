"""A channel's publish modes: confirm.select (an ack or nack once the batch commits) and tx.*.

`PublishModes` is the part of `broker.BrokerChannel` that holds a channel's
mode: in confirm mode each publish gets a delivery tag, settled when the batcher
reports it and sent grouped (`confirms.group_confirms`), one transport write per
flush; in tx mode publishes are held until tx.commit submits them as one unit.
Without either, a publish the batcher could not commit closes the connection.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pamqp import base, commands

from pepsi.amqp.broker.publish.confirms import group_confirms
from pepsi.amqp.broker.publish.units import Item, Unit
from pepsi.amqp.session.closing import close_for
from pepsi.amqp.session.connection import Connection
from pepsi.amqp.session.handler import Channel, ChannelHandler
from pepsi.amqp.wire import methods, writer
from pepsi.amqp.wire.frames import Content
from pepsi.amqp.wire.replies import (
    INTERNAL_ERROR,
    PRECONDITION_FAILED,
    AMQPConnectionError,
    ChannelError,
)

if TYPE_CHECKING:
    from pepsi.amqp.broker.publish.batcher import Batcher


class Broker(Protocol):
    """What the publish modes need of the broker (`broker.Broker`, whose channels these
    are: this module does not import it back)."""

    batcher: Batcher

    def spawn(self, coro: Any) -> None: ...


@dataclass
class _Confirms:
    """One confirm-mode channel's delivery tags."""

    next_tag: int = 1
    settled_through: int = 0


class PublishModes(ChannelHandler):
    """confirm.select and tx.*, and the confirms; mixed into BrokerChannel."""

    broker: Broker
    connection: Connection
    open: bool

    def __init__(self, channel: Channel) -> None:
        super().__init__(channel)
        self.confirms: _Confirms | None = None
        self.tx: list[Item] | None = None  # tx mode: publishes held until tx.commit
        self.tx_returns: list[Content] = []
        self._settled: list[tuple[int, bool]] = []
        self._flush_scheduled = False

    # provided by BrokerChannel and PublishingChannel
    def _reply(self, method: base.Frame) -> None:
        raise NotImplementedError

    def _return(self, content: Content) -> None:
        raise NotImplementedError

    # ---- confirm and tx modes --------------------------------------------------------------

    async def confirm_select(self, method: commands.Confirm.Select) -> None:
        if self.tx is not None:
            raise ChannelError(PRECONDITION_FAILED, "cannot switch from tx to confirm mode", 85, 10)
        if self.confirms is None:
            self.confirms = _Confirms()
        if not method.nowait:
            self._reply(commands.Confirm.SelectOk())

    async def tx_select(self, method: commands.Tx.Select) -> None:
        if self.confirms is not None:
            raise ChannelError(PRECONDITION_FAILED, "cannot switch from confirm to tx mode", 90, 10)
        if self.tx is None:
            self.tx = []
        self._reply(commands.Tx.SelectOk())

    def _transactional(self, method: base.Frame) -> list[Item]:
        if self.tx is None:
            raise ChannelError(
                PRECONDITION_FAILED,
                "channel is not transactional",
                method.index >> 16,
                method.index & 0xFFFF,
            )
        return self.tx

    async def tx_commit(self, method: commands.Tx.Commit) -> None:
        items = self._transactional(method)
        self.tx, returns, self.tx_returns = [], self.tx_returns, []
        for content in returns:
            self._return(content)
        if any(item.rows for item in items):
            loop = asyncio.get_running_loop()
            committed: asyncio.Future[BaseException | None] = loop.create_future()

            def done(_: list[Item], error: BaseException | None) -> None:
                if not committed.done():
                    committed.set_result(error)

            await self.broker.batcher.room()
            self.broker.batcher.submit(Unit(items, done))
            error = await committed
            if error is not None:
                raise AMQPConnectionError(
                    INTERNAL_ERROR, "the transaction could not be committed", 90, 20
                )
        self._reply(commands.Tx.CommitOk())

    async def tx_rollback(self, method: commands.Tx.Rollback) -> None:
        self._transactional(method)
        self.tx, self.tx_returns = [], []
        self._reply(commands.Tx.RollbackOk())

    # ---- settling publishes ----------------------------------------------------------------

    def _settle(self, tag: int, items: list[Item], error: BaseException | None) -> None:
        ok = error is None
        if ok:
            for item in items:
                if item.refused:
                    ok = False
                    break
        self._settled.append((tag, ok))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send the confirms of everything settled since the last flush, grouped."""
        self._flush_scheduled = False
        settled, self._settled = self._settled, []
        confirms = self.confirms
        if confirms is None or not self.open or not settled:
            return
        plan, confirms.settled_through = group_confirms(confirms.settled_through, settled)
        frames: list[bytes] = []
        for confirm in plan:
            cls = commands.Basic.Ack if confirm.ok else commands.Basic.Nack
            fields: dict[str, Any] = {"delivery_tag": confirm.tag, "multiple": confirm.multiple}
            if not confirm.ok:
                fields["requeue"] = False
            frames.append(
                writer.encode_method(self.channel.number, methods.build_method(cls, **fields))
            )
        if frames:  # one transport write for the whole flush
            self.channel.connection.send(b"".join(frames))

    def _unconfirmed(self, items: list[Item], error: BaseException | None) -> None:
        """A publish without confirms: a refused one is dropped as in RabbitMQ; one that was
        not committed must not vanish silently, so the connection is closed (541)."""
        if error is None or not self.open:
            return
        close = close_for(
            AMQPConnectionError(INTERNAL_ERROR, "a publish could not be stored", 60, 40)
        )
        # The connection's own way to send a close and drop the channels (session/closing.py).
        self.broker.spawn(self.connection._answer(close))
