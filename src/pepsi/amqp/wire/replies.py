"""AMQP 0-9-1 reply codes and the two kinds of error that carry one.

A *channel* error (soft: 311-313, 403-406) closes only the channel with
`channel.close`; a *connection* error (hard: 320, 402, 501-506, 530, 540,
541) closes the whole connection with `connection.close`. The code and the
text travel to the client; `class_id`/`method_id` name the method that
failed (0 when no method is to blame, as the spec allows).

RabbitMQ prefixes the reply text with the code's name ("NOT_FOUND - no queue
'q' in vhost '/'"); `reply_text` renders that form so clients that match on
it (and people reading logs) see what they would see from RabbitMQ.
"""

from __future__ import annotations

from typing import Final

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
