"""The AMQP 0-9-1 frames as values: what the reader yields, and a whole `Content`.

A method frame carries its decoded method (a `pamqp.commands` instance); a content
header is kept as its raw property octets (`RawContentHeader`, see `properties` for
why), decoded only on demand; `ContentAssembler` (`assembler`) joins a channel's
method, header and body frames into one `Content`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Final

from pamqp import base, commands

from pepsi.amqp.wire.properties import decode_properties

# Content-bearing methods (class 60): a header and body frames follow them.
CONTENT_METHODS: Final[tuple[type[base.Frame], ...]] = (
    commands.Basic.Publish,
    commands.Basic.Return,
    commands.Basic.Deliver,
    commands.Basic.GetOk,
)


# Frames are values, but not frozen dataclasses: a frozen __init__ sets each field with
# object.__setattr__ and costs about four times as much, and three are made per publish.
@dataclass(slots=True)
class ProtocolHeaderFrame:
    """The client's protocol header was accepted; `version` is (0, 9, 1) or (0, 9, 0)."""

    version: tuple[int, int, int]
    channel: int = 0


@dataclass(slots=True)
class MethodFrame:
    """A decoded method (a `pamqp.commands` instance) on a channel."""

    channel: int
    method: base.Frame

    @property
    def has_content(self) -> bool:
        """True for basic.publish/return/deliver/get-ok: a header and body follow."""
        return isinstance(self.method, CONTENT_METHODS)


@dataclass  # no slots: `properties` is a cached_property
class RawContentHeader:
    """A content header kept as received: `raw_properties` is the property flags and the
    property list exactly as on the wire, to be stored and forwarded unchanged."""

    channel: int
    body_size: int
    raw_properties: bytes

    @cached_property
    def properties(self) -> commands.Basic.Properties:
        """The properties decoded by pamqp (on first use; raises FrameSyntaxError)."""
        return decode_properties(self.raw_properties, channel=self.channel)


@dataclass(slots=True)
class BodyFrame:
    """One content body frame's payload."""

    channel: int
    payload: bytes


@dataclass(slots=True)
class HeartbeatFrame:
    """A heartbeat (always on channel 0)."""

    channel: int = 0


Frame = ProtocolHeaderFrame | MethodFrame | RawContentHeader | BodyFrame | HeartbeatFrame


@dataclass(slots=True)
class Content:
    """A complete content-bearing method: method, header (raw) and the whole body."""

    channel: int
    method: base.Frame
    header: RawContentHeader
    body: bytes

    @property
    def raw_properties(self) -> bytes:
        """The property octets to store and forward unchanged."""
        return self.header.raw_properties
