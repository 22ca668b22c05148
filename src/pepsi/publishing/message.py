"""An outgoing message and its validation. Pure: no I/O.

Every check runs before anything is written, so an invalid message in a batch
refuses the whole batch with one clear error.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from pepsi.publishing.errors import InvalidMessage

MAX_RECIPIENTS = 100_000
MAX_TEXT = 4096  # characters in one envelope or header field
# local@domain: no spaces, control characters or angle brackets; one '@' that
# separates two non-empty parts (quoted local parts are not supported).
_ADDRESS = re.compile(r"[^\s<>@\x00-\x1f\x7f]+@[^\s<>@\x00-\x1f\x7f]+")

Body = bytes | bytearray | memoryview | str


@dataclass(frozen=True)
class OutgoingMessage:
    """What a producer hands over. `body`/`header` text is encoded as UTF-8."""

    stage: str
    body: Body | None = None
    header: Body | None = None
    sender: str | None = None  # '' is the null sender
    recipients: tuple[str, ...] = ()
    user: str | None = None  # authenticated submitter
    peer: str | None = None  # IP address of the connecting peer
    message_id: str | None = None
    dedup: bool = False  # idempotent on message_id within the dedup window
    header_from: str | None = None
    subject: str | None = None
    content_type: str | None = None
    correlation_id: str | None = None
    headers: Mapping[str, Any] = field(default_factory=dict)  # producer properties
    expires: datetime | float | None = None  # when, or seconds from now


def _as_bytes(name: str, value: Body | None) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidMessage(f"{name} is not encodable as UTF-8 text") from None
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise InvalidMessage(f"{name} must be bytes or str, not {type(value).__name__}")


def _text(name: str, value: object, *, empty: bool = False) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidMessage(f"{name} is not UTF-8 text") from None
    if not isinstance(value, str):
        raise InvalidMessage(f"{name} must be text, not {type(value).__name__}")
    if "\x00" in value:
        raise InvalidMessage(f"{name} contains a NUL character")
    if len(value) > MAX_TEXT:
        raise InvalidMessage(f"{name} is longer than {MAX_TEXT} characters")
    if not value and not empty:
        raise InvalidMessage(f"{name} is empty")
    return value


def _address(name: str, value: object, *, null_ok: bool = False) -> str | None:
    text = _text(name, value, empty=null_ok)
    if text is None or (null_ok and text == ""):
        return text
    if not _ADDRESS.fullmatch(text):
        raise InvalidMessage(f"{name} is not an address (local@domain): {text!r}")
    return text


class Row(NamedTuple):
    """A checked message as `pepsi.workqueue_publish` takes it (one array element each)."""

    stage: str
    message_id: str | None
    dedup: bool
    sender: str | None
    recipients: str | None  # an array literal; None: no recipients
    origin_user: str | None
    origin_peer: str | None
    header_from: str | None
    subject: str | None
    content_type: str | None
    correlation_id: str | None
    properties: str | None  # JSON text; None: {}
    expires: datetime | None
    header: bytes | None
    body: bytes | None

    @property
    def plain(self) -> bool:
        """Only a stage, a header block and a body: `workqueue_publish_plain` can take it."""
        return self[1:13] == _NOTHING


_NOTHING = (None, False, *(None,) * 10)


def validate(msg: OutgoingMessage, *, max_size: int, now: datetime | None = None) -> Row:
    """Check `msg`; return the row it becomes, with its header block and body."""
    stage = msg.stage
    if not isinstance(stage, str) or not stage:
        raise InvalidMessage("stage must be a non-empty string")
    header = _as_bytes("header", msg.header)
    body = _as_bytes("body", msg.body)
    size = (0 if header is None else len(header)) + (0 if body is None else len(body))
    if size > max_size:
        raise InvalidMessage(
            f"message is {size} bytes, over the limit of {max_size} ([pepsi-ingress] "
            "MAX_MESSAGE_SIZE)"
        )
    recipients = msg.recipients
    if (  # the common case: no envelope, no properties, no expiry; nothing else to check
        msg.sender is None
        and msg.message_id is None
        and not msg.dedup
        and isinstance(recipients, tuple | list)
        and not recipients
        and msg.user is None
        and msg.peer is None
        and msg.header_from is None
        and msg.subject is None
        and msg.content_type is None
        and msg.correlation_id is None
        and msg.expires is None
        and isinstance(msg.headers, dict)
        and not msg.headers
    ):
        return Row(stage, *_NOTHING, header, body)
    return _checked(msg, header, body, now)


def _checked(
    msg: OutgoingMessage, header: bytes | None, body: bytes | None, now: datetime | None
) -> Row:
    if isinstance(msg.recipients, str | bytes) or msg.recipients is None:
        raise InvalidMessage("recipients must be a list of addresses")
    recipients = [_address("recipient", r) for r in msg.recipients]
    if len(recipients) > MAX_RECIPIENTS:
        raise InvalidMessage(f"more than {MAX_RECIPIENTS} recipients")
    peer = _text("peer", msg.peer)
    if peer is not None:
        try:
            peer = str(ipaddress.ip_address(peer))
        except ValueError:
            raise InvalidMessage(f"peer is not an IP address: {peer!r}") from None
    message_id = _text("message_id", msg.message_id)
    if msg.dedup and message_id is None:
        raise InvalidMessage("dedup=True needs a message_id")
    if not isinstance(msg.headers, Mapping):
        raise InvalidMessage("headers must be a mapping")
    properties = None
    if msg.headers:
        try:
            properties = json.dumps(dict(msg.headers))
        except (TypeError, ValueError) as exc:
            raise InvalidMessage(f"headers are not JSON: {exc}") from None
    return Row(
        msg.stage,
        message_id,
        bool(msg.dedup),
        _address("sender", msg.sender, null_ok=True),
        _array_literal(recipients) if recipients else None,
        _text("user", msg.user),
        peer,
        _text("header_from", msg.header_from),
        _text("subject", msg.subject, empty=True),
        _text("content_type", msg.content_type),
        _text("correlation_id", msg.correlation_id),
        properties,
        _expiry(msg.expires, now),
        header,
        body,
    )


def _array_literal(items: list[str | None]) -> str:
    """A PostgreSQL text[] literal of `items` (checked addresses: never None)."""
    quoted = ('"' + str(item).replace("\\", "\\\\").replace('"', '\\"') + '"' for item in items)
    return "{" + ",".join(quoted) + "}"


def _expiry(value: datetime | float | None, now: datetime | None) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise InvalidMessage("expires must be a timezone-aware datetime")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise InvalidMessage("expires must be a datetime or a number of seconds > 0")
    return (now or datetime.now(UTC)) + timedelta(seconds=float(value))
