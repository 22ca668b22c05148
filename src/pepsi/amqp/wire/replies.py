"""AMQP 0-9-1 reply codes and the errors that carry one: the server's two kinds, the codec's.

A *channel* error (soft: 311-313, 403-406) closes only the channel with
`channel.close`; a *connection* error (hard: 320, 402, 501-506, 530, 540,
541) closes the whole connection with `connection.close`. The code and the
text travel to the client; `class_id`/`method_id` name the method that
failed (0 when no method is to blame, as the spec allows).

RabbitMQ prefixes the reply text with the code's name ("NOT_FOUND - no queue
'q' in vhost '/'"); `reply_text` renders that form so clients that match on
it (and people reading logs) see what they would see from RabbitMQ.

The wire codec's errors are `FrameError`s: every problem with the peer's bytes, with
the reply code RabbitMQ uses (501 frame, 502 syntax, 505 unexpected frame, 540 not
implemented; 406 for a message over the configured size). `fatal` errors mean the
byte stream lost its frame boundaries: send `connection.close` and drop the socket
without waiting for close-ok, as RabbitMQ does. A `ProtocolHeaderMismatch` is
answered with `answer` (`AMQP 0-0-9-1`) and a close, never with a method.
"""

from __future__ import annotations

from typing import Final

from pepsi.amqp.wire.protocol import PROTOCOL_HEADER

REPLY_SUCCESS: Final = 200
CONTENT_TOO_LARGE: Final = 311
NO_ROUTE: Final = 312
NO_CONSUMERS: Final = 313
CONNECTION_FORCED: Final = 320
INVALID_PATH: Final = 402
ACCESS_REFUSED: Final = 403
NOT_FOUND: Final = 404
RESOURCE_LOCKED: Final = 405
PRECONDITION_FAILED: Final = 406
FRAME_ERROR: Final = 501
SYNTAX_ERROR: Final = 502
COMMAND_INVALID: Final = 503
CHANNEL_ERROR: Final = 504
UNEXPECTED_FRAME: Final = 505
RESOURCE_ERROR: Final = 506
NOT_ALLOWED: Final = 530
NOT_IMPLEMENTED: Final = 540
INTERNAL_ERROR: Final = 541

# The spec's names, upper-cased with underscores as RabbitMQ writes them.
REPLY_NAMES: Final[dict[int, str]] = {
    REPLY_SUCCESS: "REPLY_SUCCESS",
    CONTENT_TOO_LARGE: "CONTENT_TOO_LARGE",
    NO_ROUTE: "NO_ROUTE",
    NO_CONSUMERS: "NO_CONSUMERS",
    CONNECTION_FORCED: "CONNECTION_FORCED",
    INVALID_PATH: "INVALID_PATH",
    ACCESS_REFUSED: "ACCESS_REFUSED",
    NOT_FOUND: "NOT_FOUND",
    RESOURCE_LOCKED: "RESOURCE_LOCKED",
    PRECONDITION_FAILED: "PRECONDITION_FAILED",
    FRAME_ERROR: "FRAME_ERROR",
    SYNTAX_ERROR: "SYNTAX_ERROR",
    COMMAND_INVALID: "COMMAND_INVALID",
    CHANNEL_ERROR: "CHANNEL_ERROR",
    UNEXPECTED_FRAME: "UNEXPECTED_FRAME",
    RESOURCE_ERROR: "RESOURCE_ERROR",
    NOT_ALLOWED: "NOT_ALLOWED",
    NOT_IMPLEMENTED: "NOT_IMPLEMENTED",
    INTERNAL_ERROR: "INTERNAL_ERROR",
}

# Codes the spec marks as soft (channel-level); every other error code is hard.
SOFT_ERRORS: Final = frozenset(
    {CONTENT_TOO_LARGE, NO_ROUTE, NO_CONSUMERS, ACCESS_REFUSED, NOT_FOUND, RESOURCE_LOCKED,
     PRECONDITION_FAILED}
)  # fmt: skip


def is_hard_error(code: int) -> bool:
    """True when `code` must close the connection rather than the channel."""
    return code != REPLY_SUCCESS and code not in SOFT_ERRORS


class AMQPError(Exception):
    """An AMQP error with its reply code and text (base of the two kinds)."""

    def __init__(self, code: int, text: str, class_id: int = 0, method_id: int = 0) -> None:
        self.code = code
        self.text = text
        self.class_id = class_id
        self.method_id = method_id
        super().__init__(self.reply_text)

    @property
    def reply_text(self) -> str:
        """The text as sent on the wire: "NOT_FOUND - no queue 'q' in vhost '/'"."""
        name = REPLY_NAMES.get(self.code)
        return f"{name} - {self.text}" if name else self.text

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.code}, {self.text!r}, "
            f"class_id={self.class_id}, method_id={self.method_id})"
        )


class ChannelError(AMQPError):
    """Closes the channel (`channel.close`); the connection stays open."""


class AMQPConnectionError(AMQPError):
    """Closes the connection (`connection.close`).

    Named so as not to shadow the builtin `ConnectionError`.
    """


# --- the codec's errors: the peer's bytes break the protocol ---------------------------


class FrameError(Exception):
    """The peer sent bytes that break the protocol; carries the reply code to close with.

    `channel`, `class_id` and `method_id` say where it happened (0 when unknown), for the
    `connection.close`/`channel.close` the server sends. `fatal` is True when frame
    boundaries are lost: nothing more can be read from this connection.
    """

    fatal: bool = False

    def __init__(
        self,
        reply_code: int,
        text: str,
        *,
        channel: int = 0,
        class_id: int = 0,
        method_id: int = 0,
    ) -> None:
        super().__init__(reply_code, text)
        self.reply_code = reply_code
        self.text = text
        self.channel = channel
        self.class_id = class_id
        self.method_id = method_id

    @property
    def hard(self) -> bool:
        """True for a connection error (5xx, 3xx hard codes); False for a channel error."""
        return self.reply_code not in SOFT_ERRORS

    def __str__(self) -> str:
        return f"{self.reply_code} {self.text}"


class FrameFormatError(FrameError):
    """501 FRAME_ERROR: a frame or a method that cannot be decoded."""

    def __init__(self, text: str, **where: int) -> None:
        super().__init__(FRAME_ERROR, text, **where)


class FatalFrameError(FrameFormatError):
    """501 with lost frame boundaries (bad frame-end octet): close without waiting."""

    fatal = True


class FrameTooLarge(FatalFrameError):
    """501: a frame announced a payload over the negotiated frame_max."""


class ProtocolHeaderMismatch(FatalFrameError):
    """The first 8 octets are not an AMQP 0-9-1 header: send `answer`, then close.

    0-9-1 and 0-9 headers are accepted (as RabbitMQ does); anything else is refused as
    soon as its octets differ, with the 0-9-1 header as the spec asks (RabbitMQ 4 answers
    non-0-9 versions with its AMQP 1.0 header instead, since it also speaks 1.0).
    """

    answer: bytes = PROTOCOL_HEADER

    def __init__(self, received: bytes) -> None:
        super().__init__(f"unsupported protocol header {received!r}")
        self.received = received


class FrameSyntaxError(FrameError):
    """502 SYNTAX_ERROR: content-header properties that cannot be decoded."""

    def __init__(self, text: str, **where: int) -> None:
        super().__init__(SYNTAX_ERROR, text, **where)


class CommandInvalid(FrameError):
    """503 COMMAND_INVALID (for the server's use; the codec itself does not raise it)."""

    def __init__(self, text: str, **where: int) -> None:
        super().__init__(COMMAND_INVALID, text, **where)


class UnexpectedFrame(FrameError):
    """505 UNEXPECTED_FRAME: a frame out of order (header or body without a method...)."""

    def __init__(self, text: str, **where: int) -> None:
        super().__init__(UNEXPECTED_FRAME, text, **where)


class MethodNotImplemented(FrameError):
    """540 NOT_IMPLEMENTED: a class/method id pair that AMQP 0-9-1 does not define."""

    def __init__(self, text: str, **where: int) -> None:
        super().__init__(NOT_IMPLEMENTED, text, **where)


class MessageTooLarge(FrameError):
    """406 PRECONDITION_FAILED (a channel error, as RabbitMQ's max_message_size check)."""

    def __init__(self, text: str, **where: int) -> None:
        super().__init__(PRECONDITION_FAILED, text, **where)
