"""The seam for the broker: a `ChannelHandler` per open `Channel`, by `CHANNEL_METHODS`.

Every channel-level method but channel.* reaches the channel's handler through
one table, `CHANNEL_METHODS`; the base handler answers each with 540
NOT_IMPLEMENTED, and a broker overrides what it implements (the contract is in
`connection`'s module doc). `Channel` is what a handler is given: its number,
its content assembly, and the connection it sends on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Protocol

from pamqp import base, commands

from pepsi.amqp.auth.permissions import Permission
from pepsi.amqp.wire import methods, replies, writer
from pepsi.amqp.wire.assembler import ContentAssembler
from pepsi.amqp.wire.frames import Content
from pepsi.config.model import AmqpOptions


class OwnerOptions(Protocol):
    """The options a channel reads (a `shell.ConnectionOptions`)."""

    @property
    def amqp(self) -> AmqpOptions: ...


class Owner(Protocol):
    """What a channel and its handler ask of the connection they live on (a `Connection`:
    named by its members so that this seam imports none of the layers built on it)."""

    @property
    def options(self) -> OwnerOptions: ...

    @property
    def frame_max(self) -> int: ...

    @property
    def peer(self) -> str | None: ...

    @property
    def permission(self) -> Permission | None: ...

    @property
    def client_capabilities(self) -> dict[str, Any]: ...

    def send(self, data: bytes) -> None: ...


# Every method a client sends on an open channel, except channel.*, to the name of the
# ChannelHandler coroutine that takes it. basic.publish gets the whole Content.
CHANNEL_METHODS: Final[Mapping[type[base.Frame], str]] = {
    commands.Exchange.Declare: "exchange_declare",
    commands.Exchange.Delete: "exchange_delete",
    commands.Exchange.Bind: "exchange_bind",
    commands.Exchange.Unbind: "exchange_unbind",
    commands.Queue.Declare: "queue_declare",
    commands.Queue.Bind: "queue_bind",
    commands.Queue.Unbind: "queue_unbind",
    commands.Queue.Purge: "queue_purge",
    commands.Queue.Delete: "queue_delete",
    commands.Basic.Qos: "basic_qos",
    commands.Basic.Consume: "basic_consume",
    commands.Basic.Cancel: "basic_cancel",
    commands.Basic.Publish: "basic_publish",
    commands.Basic.Get: "basic_get",
    commands.Basic.Ack: "basic_ack",
    commands.Basic.Nack: "basic_nack",
    commands.Basic.Reject: "basic_reject",
    commands.Basic.Recover: "basic_recover",
    commands.Basic.RecoverAsync: "basic_recover_async",
    commands.Confirm.Select: "confirm_select",
    commands.Tx.Select: "tx_select",
    commands.Tx.Commit: "tx_commit",
    commands.Tx.Rollback: "tx_rollback",
}


def method_label(handler_name: str) -> str:
    """`basic_recover_async` → `basic.recover-async` (the spec's spelling, for messages)."""
    cls, _, rest = handler_name.partition("_")
    return f"{cls}.{rest.replace('_', '-')}"


def not_implemented(method: base.Frame) -> replies.ChannelError:
    name = CHANNEL_METHODS.get(type(method))
    label = method_label(name) if name else method.name
    return replies.ChannelError(
        replies.NOT_IMPLEMENTED,
        f"{label} is not implemented yet",
        method.index >> 16,
        method.index & 0xFFFF,
    )


class ChannelHandler:
    """One open channel's methods beyond channel.*; the base refuses each with 540.

    A broker subclasses this and overrides what it implements (see the module doc).
    """

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    async def closed(self) -> None:
        """The channel is gone (either side closed it, or the connection went)."""

    async def exchange_declare(self, method: commands.Exchange.Declare) -> None:
        raise not_implemented(method)

    async def exchange_delete(self, method: commands.Exchange.Delete) -> None:
        raise not_implemented(method)

    async def exchange_bind(self, method: commands.Exchange.Bind) -> None:
        raise not_implemented(method)

    async def exchange_unbind(self, method: commands.Exchange.Unbind) -> None:
        raise not_implemented(method)

    async def queue_declare(self, method: commands.Queue.Declare) -> None:
        raise not_implemented(method)

    async def queue_bind(self, method: commands.Queue.Bind) -> None:
        raise not_implemented(method)

    async def queue_unbind(self, method: commands.Queue.Unbind) -> None:
        raise not_implemented(method)

    async def queue_purge(self, method: commands.Queue.Purge) -> None:
        raise not_implemented(method)

    async def queue_delete(self, method: commands.Queue.Delete) -> None:
        raise not_implemented(method)

    async def basic_qos(self, method: commands.Basic.Qos) -> None:
        raise not_implemented(method)

    async def basic_consume(self, method: commands.Basic.Consume) -> None:
        raise not_implemented(method)

    async def basic_cancel(self, method: commands.Basic.Cancel) -> None:
        raise not_implemented(method)

    async def basic_publish(self, content: Content) -> None:
        raise not_implemented(content.method)

    async def publish_started(self, method: base.Frame) -> None:
        """A content method has arrived, its header and body not yet: raise the
        ChannelError its publish would end in now (permission, exchange), so that its
        body is discarded unread. The default leaves every check to `basic_publish`."""

    def ack_now(self, tag: int, multiple: bool) -> None:
        """basic.ack without a coroutine (a consumer's hot path): as `basic_ack`."""
        raise not_implemented(methods.ack_method(tag, multiple))

    def publish_now(self, content: Content) -> bool:
        """Handle a publish without awaiting, if possible; False (before doing anything)
        sends it to `basic_publish`. A fast path only: the default always declines."""
        return False

    async def basic_get(self, method: commands.Basic.Get) -> None:
        raise not_implemented(method)

    async def basic_ack(self, method: commands.Basic.Ack) -> None:
        raise not_implemented(method)

    async def basic_nack(self, method: commands.Basic.Nack) -> None:
        raise not_implemented(method)

    async def basic_reject(self, method: commands.Basic.Reject) -> None:
        raise not_implemented(method)

    async def basic_recover(self, method: commands.Basic.Recover) -> None:
        raise not_implemented(method)

    async def basic_recover_async(self, method: commands.Basic.RecoverAsync) -> None:
        raise not_implemented(method)

    async def confirm_select(self, method: commands.Confirm.Select) -> None:
        raise not_implemented(method)

    async def tx_select(self, method: commands.Tx.Select) -> None:
        raise not_implemented(method)

    async def tx_commit(self, method: commands.Tx.Commit) -> None:
        raise not_implemented(method)

    async def tx_rollback(self, method: commands.Tx.Rollback) -> None:
        raise not_implemented(method)


class Broker(Protocol):
    """What the connection layer asks of the broker: a handler per opened channel."""

    def channel_handler(self, channel: Channel) -> ChannelHandler: ...


class NoBroker:
    """Until the broker exists: every channel-level method is 540 NOT_IMPLEMENTED."""

    def channel_handler(self, channel: Channel) -> ChannelHandler:
        return ChannelHandler(channel)


class Channel:
    """An open channel: its number, content assembly and handler; sends on its number."""

    __slots__ = ("assembler", "closing", "connection", "handler", "number", "reserved")

    def __init__(self, connection: Owner, number: int) -> None:
        self.connection = connection
        self.number = number
        self.assembler = ContentAssembler(
            number, max_message_size=connection.options.amqp.max_message_size
        )
        self.closing = False  # we sent channel.close and wait for close-ok
        self.handler: ChannelHandler | None = None
        self.reserved = 0  # bytes of PublishMemory its content in progress holds

    def send_method(self, method: base.Frame) -> None:
        self.connection.send(writer.encode_method(self.number, method))

    def send_content(self, method: base.Frame, raw_properties: bytes, body: bytes) -> None:
        self.connection.send(
            writer.encode_content(
                self.number, method, raw_properties, body, self.connection.frame_max
            )
        )


__all__ = [
    "CHANNEL_METHODS",
    "Broker",
    "Channel",
    "ChannelHandler",
    "NoBroker",
]
