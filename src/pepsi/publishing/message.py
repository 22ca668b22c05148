"""An outgoing message and its validation. Pure: no I/O.

Every check runs before anything is written, so an invalid message in a batch
refuses the whole batch with one clear error.
"""

from __future__ import annotations

import ipaddress
import json as _json
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import islice
from typing import Any, NamedTuple

from pepsi.addresses import ADDRESS, MAX_TEXT
from pepsi.publishing.errors import InvalidMessage

MAX_RECIPIENTS = 100_000

Body = bytes | bytearray | memoryview | str


_UNSET: Any = object()  # json= not given (None is the JSON null)
JSON_TYPE = "application/json"
# Old keyword -> its name now (deprecated for one release, see CHANGELOG.md).
RENAMED = {"headers": "properties", "user": "origin_user", "peer": "origin_peer"}


@dataclass(frozen=True, init=False)
class OutgoingMessage:
    """What a producer hands over. `body`/`header` text is encoded as UTF-8.

    Field names are those the stage reads on `Message` and the row's columns.
    `json=obj` makes the body `obj` as UTF-8 JSON and, unless given, sets
    `content_type` to application/json.
    """

    stage: str
    body: Body | None = None
    header: Body | None = None
    sender: str | None = None  # '' is the null sender
    recipients: tuple[str, ...] = ()
    origin_user: str | None = None  # authenticated submitter
    origin_peer: str | None = None  # IP address of the connecting peer
    message_id: str | None = None
    dedup: bool = False  # idempotent on message_id within the dedup window
    header_from: str | None = None
    subject: str | None = None
    content_type: str | None = None
    correlation_id: str | None = None
    properties: Mapping[str, Any] = field(default_factory=dict)  # producer properties
    expires: datetime | float | None = None  # when, or seconds from now
    priority: int = 0  # 0 to 255, higher first (FIFO within one, and within a sender)

    def __init__(  # one keyword per field, as the dataclass had
        self,
        stage: str,
        body: Body | None = None,
        header: Body | None = None,
        *,
        sender: str | None = None,
        recipients: tuple[str, ...] = (),
        origin_user: str | None = None,
        origin_peer: str | None = None,
        message_id: str | None = None,
        dedup: bool = False,
        header_from: str | None = None,
        subject: str | None = None,
        content_type: str | None = None,
        correlation_id: str | None = None,
        properties: Mapping[str, Any] | None = None,
        expires: datetime | float | None = None,
        priority: int = 0,
        json: Any = _UNSET,
        headers: Mapping[str, Any] | None = None,  # deprecated: properties
        user: str | None = None,  # deprecated: origin_user
        peer: str | None = None,  # deprecated: origin_peer
    ) -> None:
        if headers is not None:
            properties = _renamed("headers", headers, properties)
        if user is not None:
            origin_user = _renamed("user", user, origin_user)
        if peer is not None:
            origin_peer = _renamed("peer", peer, origin_peer)
        if json is not _UNSET:
            if body is not None:
                raise InvalidMessage("give body= or json=, not both")
            body = encode_json(json)
            if content_type is None:
                content_type = JSON_TYPE
        put = object.__setattr__  # frozen: the dataclass's own __init__ does the same
        put(self, "stage", stage)
        put(self, "body", body)
        put(self, "header", header)
        put(self, "sender", sender)
        put(self, "recipients", recipients)
        put(self, "origin_user", origin_user)
        put(self, "origin_peer", origin_peer)
        put(self, "message_id", message_id)
        put(self, "dedup", dedup)
        put(self, "header_from", header_from)
        put(self, "subject", subject)
        put(self, "content_type", content_type)
        put(self, "correlation_id", correlation_id)
        put(self, "properties", {} if properties is None else properties)
        put(self, "expires", expires)
        put(self, "priority", priority)

    @property
    def headers(self) -> Mapping[str, Any]:
        """Deprecated: `properties`."""
        _warn("headers")
        return self.properties

    @property
    def user(self) -> str | None:
        """Deprecated: `origin_user`."""
        _warn("user")
        return self.origin_user

    @property
    def peer(self) -> str | None:
        """Deprecated: `origin_peer`."""
        _warn("peer")
        return self.origin_peer


def _warn(old: str) -> None:
    warnings.warn(
        f"OutgoingMessage.{old} is deprecated; use {RENAMED[old]}",
        DeprecationWarning,
        stacklevel=3,
    )


def _renamed(old: str, value: Any, new_value: object) -> Any:
    """The value given under a deprecated keyword (one release: see CHANGELOG.md)."""
    new = RENAMED[old]
    if new_value is not None and new_value != ():
        raise TypeError(f"OutgoingMessage() got both {old}= and {new}=")
    warnings.warn(
        f"OutgoingMessage({old}=...) is deprecated; use {new}=",
        DeprecationWarning,
        stacklevel=3,
    )
    return value


def encode_json(value: object) -> bytes:
    """`value` as compact UTF-8 JSON, as `json=` sends it; InvalidMessage if it is not JSON."""
    try:
        text = _json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:  # UnicodeEncodeError is a ValueError
        raise InvalidMessage(f"json= is not JSON: {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, UnicodeEncodeError):
        return "a string is not encodable as UTF-8"
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc)


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
    if "\x00" in value:  # PostgreSQL text cannot hold NUL
        raise InvalidMessage(f"{name} contains a NUL character")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate, e.g. undecodable bytes from argv
            raise InvalidMessage(f"{name} is not encodable as UTF-8 text") from None
    if len(value) > MAX_TEXT:
        raise InvalidMessage(f"{name} is longer than {MAX_TEXT} characters")
    if not value and not empty:
        raise InvalidMessage(f"{name} is empty")
    return value


def _address(name: str, value: object, *, null_ok: bool = False) -> str | None:
    text = _text(name, value, empty=null_ok)
    if text is None or (null_ok and text == ""):
        return text
    if not ADDRESS.fullmatch(text):
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
    priority: int = 0  # higher first; 0: none

    @property
    def plain(self) -> bool:
        """Only a stage, a header block and a body: `workqueue_publish_plain` can take it."""
        return self[1:13] == _NOTHING and not self[15]


_NOTHING = (None, False, *(None,) * 10)
MAX_PRIORITY = 255  # as AMQP's octet (RabbitMQ's x-max-priority ceiling)


def _too_large(size: int, max_size: int) -> InvalidMessage:
    return InvalidMessage(
        f"message is {size} bytes, over the limit of {max_size} ([pepsi-ingress] MAX_MESSAGE_SIZE)"
    )


def checked_body(value: Body | None, *, max_size: int) -> bytes | None:
    """The body of a message that is only a stage and a body, checked as `validate` does."""
    body = _as_bytes("body", value)
    if body is not None and len(body) > max_size:
        raise _too_large(len(body), max_size)
    return body


def validate(msg: OutgoingMessage, *, max_size: int, now: datetime | None = None) -> Row:
    """Check `msg`; return the row it becomes, with its header block and body."""
    stage = msg.stage
    if not isinstance(stage, str) or not stage:
        raise InvalidMessage("stage must be a non-empty string")
    header, body = parts(msg, max_size=max_size)
    if bare(msg):
        return Row(stage, *_NOTHING, header, body)
    return _checked(msg, header, body, now)


def parts(msg: OutgoingMessage, *, max_size: int) -> tuple[bytes | None, bytes | None]:
    """The header block and the body, as bytes, within MAX_MESSAGE_SIZE together."""
    header = _as_bytes("header", msg.header)
    body = _as_bytes("body", msg.body)
    size = (0 if header is None else len(header)) + (0 if body is None else len(body))
    if size > max_size:
        raise _too_large(size, max_size)
    return header, body


def bare(msg: OutgoingMessage) -> bool:
    """Only a stage, a header block and a body: no envelope, no properties, no expiry,
    no priority, nothing else to check or store (the publish functions' fast paths)."""
    recipients = msg.recipients
    return (
        msg.sender is None
        and msg.message_id is None
        and not msg.dedup
        and isinstance(recipients, tuple | list)
        and not recipients
        and msg.origin_user is None
        and msg.origin_peer is None
        and msg.header_from is None
        and msg.subject is None
        and msg.content_type is None
        and msg.correlation_id is None
        and msg.expires is None
        and isinstance(msg.properties, dict)
        and not msg.properties
        and msg.priority == 0
        and type(msg.priority) is int
    )


def _checked(
    msg: OutgoingMessage, header: bytes | None, body: bytes | None, now: datetime | None
) -> Row:
    given = msg.recipients
    if isinstance(given, str | bytes | Mapping) or not isinstance(given, Iterable):
        raise InvalidMessage("recipients must be a list of addresses")
    listed = list(islice(given, MAX_RECIPIENTS + 1))
    if len(listed) > MAX_RECIPIENTS:
        raise InvalidMessage(f"more than {MAX_RECIPIENTS} recipients")
    recipients = [_address("recipient", r) for r in listed]
    peer = _text("origin_peer", msg.origin_peer)
    if peer is not None:
        try:
            peer = str(ipaddress.ip_address(peer))
        except ValueError:
            raise InvalidMessage(f"origin_peer is not an IP address: {peer!r}") from None
    message_id = _text("message_id", msg.message_id)
    if not isinstance(msg.dedup, bool):
        raise InvalidMessage(f"dedup must be True or False, not {type(msg.dedup).__name__}")
    if msg.dedup and message_id is None:
        raise InvalidMessage("dedup=True needs a message_id")
    return Row(
        msg.stage,
        message_id,
        msg.dedup,
        _address("sender", msg.sender, null_ok=True),
        _array_literal(recipients) if recipients else None,
        _text("origin_user", msg.origin_user),
        peer,
        _text("header_from", msg.header_from),
        _text("subject", msg.subject, empty=True),
        _text("content_type", msg.content_type),
        _text("correlation_id", msg.correlation_id),
        _properties(msg.properties),
        _expiry(msg.expires, now),
        header,
        body,
        _priority(msg.priority),
    )


def _priority(value: object) -> int:
    if type(value) is not int or not 0 <= value <= MAX_PRIORITY:
        raise InvalidMessage(f"priority must be an integer from 0 to {MAX_PRIORITY}, not {value!r}")
    return value


def _array_literal(items: list[str | None]) -> str:
    """A PostgreSQL text[] literal of `items` (checked addresses: never None)."""
    quoted = ('"' + str(item).replace("\\", "\\\\").replace('"', '\\"') + '"' for item in items)
    return "{" + ",".join(quoted) + "}"


# A JSON \u0000 escape not itself escaped: jsonb refuses it (text cannot hold NUL).
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def _properties(value: object) -> str | None:
    """The producer properties as JSON text that jsonb accepts; None when empty."""
    if not isinstance(value, Mapping):
        raise InvalidMessage("properties must be a mapping")
    if not value:
        return None
    try:
        text = _json.dumps(dict(value), ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidMessage(f"properties are not JSON: {_reason(exc)}") from None
    if "\\u0000" in text and _JSON_NUL.search(text):
        raise InvalidMessage("properties contain a NUL character")
    return text


def _expiry(value: object, now: datetime | None) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.utcoffset() is None:
            raise InvalidMessage("expires must be a timezone-aware datetime")
        try:
            return value.astimezone(UTC)
        except OverflowError:
            raise InvalidMessage("expires is out of range") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise InvalidMessage("expires must be a datetime or a number of seconds > 0")
    try:
        return (now or datetime.now(UTC)) + timedelta(seconds=float(value))
    except (OverflowError, ValueError):  # inf, or past the year 9999
        raise InvalidMessage(f"expires is too far in the future: {value} seconds") from None
