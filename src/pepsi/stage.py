"""The stage API: what a Python stage function receives and returns.

    from pepsi import Message, PermanentError, stage

    @stage                        # metadata only: the batched, bodyless path
    def route(msg: Message) -> None:
        msg.state["routed"] = True  # state is written back with the outcome
        # returning None advances to NEXT (or finishes at the last stage)

    @stage(needs="body")
    def parse(msg: Message) -> Outcome:
        if not msg.body:
            raise PermanentError("empty body")   # failed at once
        return msg.advance("archive")            # or msg.finish(), msg.pause(60)

Any other exception is a host failure: the message is paused and retried
(1, 2, 4 … minutes, up to an hour) until the stage's MAX_LIFETIME.

    @stage(transactional=True)    # msg.db: the transaction that records the outcome
    def book(msg: Message) -> None:
        msg.db.execute("INSERT INTO bookings (message) VALUES (%s)", (msg.id,))
        # the insert and the advance commit together, or neither does

A transactional stage's writes through `msg.db` commit with its outcome in
one transaction per message (exactly once); an exception rolls them back.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar, overload

from pepsi.config import StageConfig
from pepsi.errors import PepsiError

if TYPE_CHECKING:
    import psycopg


class Needs(Enum):
    """What a stage reads besides the row's metadata."""

    METADATA = "metadata"  # envelope, extracted headers, state: batched (W-8)
    HEADER = "header"  # plus the header block
    BODY = "body"  # plus the header block and the body


class PermanentError(PepsiError):
    """Raised by a stage: this message can never succeed here; fail it now."""


@dataclass(frozen=True)
class Advance:
    to: str | None = None  # None: the stage's NEXT (finish if it has none)
    fuse: bool = True  # False: this message is written and dispatched, never fused (W-10)


@dataclass(frozen=True)
class Finish:
    pass


@dataclass(frozen=True)
class Pause:
    until: datetime
    reason: str | None = None


@dataclass(frozen=True)
class Defer:
    """A part's recipients failed for now: retried on the stage's schedule (as a raise is)."""

    reason: str


@dataclass(frozen=True)
class Fail:
    """A part's recipients failed for good (as a PermanentError is)."""

    reason: str


@dataclass(frozen=True)
class NewMessage:
    """A message a stage makes (a delivery status notification), written with its outcome.

    It starts pending at `stage`, with the metadata given; `arrived` is the
    moment it is written.
    """

    stage: str
    header: bytes | None = None
    body: bytes | None = None
    sender: str | None = None  # '' is the null sender
    recipients: tuple[str, ...] = ()
    message_id: str | None = None
    header_from: str | None = None
    subject: str | None = None
    content_type: str | None = None
    properties: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Part:
    """Some of a message's recipients, and what becomes of them."""

    recipients: tuple[str, ...]
    outcome: Advance | Finish | Pause | Defer | Fail


@dataclass(frozen=True)
class Split:
    """Recipients going different ways (a relay that delivered some, deferred others).

    Each part carries on alone: the first part that is not finished stays on
    the row, each other becomes a row of its own (sharing the body, W-9's
    split), a finished part leaves none. The parts must name each of the
    message's recipients once. `spawn`: messages made with the outcome, in
    the same transaction (delivery status notifications).
    """

    parts: tuple[Part, ...]
    spawn: tuple[NewMessage, ...] = ()


Outcome = Advance | Finish | Pause | Split

F = TypeVar("F", bound=Callable[..., Any])
STAGE_ATTRIBUTE = "__pepsi_needs__"
TRANSACTIONAL_ATTRIBUTE = "__pepsi_transactional__"


@overload
def stage(func: F, /) -> F: ...
@overload
def stage(
    needs: Needs | str = Needs.METADATA, /, *, transactional: bool = False
) -> Callable[[F], F]: ...
@overload
def stage(
    *, needs: Needs | str = Needs.METADATA, transactional: bool = False
) -> Callable[[F], F]: ...


def stage(
    func_or_needs: Any = Needs.METADATA,
    /,
    needs: Needs | str | None = None,
    *,
    transactional: bool = False,
) -> Callable[[F], F] | Any:
    """Declare a function a Pepsi stage, what it needs loaded, and whether it is
    transactional (its writes through `msg.db` commit with its outcome).

    Bare `@stage` (metadata only), `@stage()`, `@stage(needs="body")` and
    `@stage(needs="body", transactional=True)` all work.
    """
    if callable(func_or_needs) and needs is None:  # bare @stage: handed the function
        setattr(func_or_needs, STAGE_ATTRIBUTE, Needs.METADATA)
        return func_or_needs
    wanted = Needs(func_or_needs if needs is None else needs)

    def mark(func: F) -> F:
        setattr(func, STAGE_ATTRIBUTE, wanted)
        if transactional:
            setattr(func, TRANSACTIONAL_ATTRIBUTE, True)
        return func

    return mark


def _content(name: str, value: object) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"msg.{name} takes bytes, not {type(value).__name__}")
    return bytes(value)


def needs_of(func: Callable[..., Any]) -> Needs:
    """What a stage function declared; undecorated functions need metadata only."""
    value = getattr(func, STAGE_ATTRIBUTE, Needs.METADATA)
    return value if isinstance(value, Needs) else Needs.METADATA


def is_transactional(func: Callable[..., Any]) -> bool:
    """Whether a stage function declared `@stage(transactional=True)`."""
    return getattr(func, TRANSACTIONAL_ATTRIBUTE, False) is True


BodyLoader = Callable[[], tuple[bytes | None, bytes | None]]


@dataclass
class Message:
    """One message at one stage, as its stage function sees it."""

    id: int
    stage: str
    arrived: datetime
    options: StageConfig
    message_id: str | None = None
    sender: str | None = None
    recipients: tuple[str, ...] = ()
    origin_user: str | None = None
    origin_peer: str | None = None
    header_from: str | None = None
    subject: str | None = None
    content_type: str | None = None
    correlation_id: str | None = None
    properties: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)  # written back with the outcome
    sender_key: str = ""
    _header: bytes | None = field(default=None, repr=False)
    _body: bytes | None = field(default=None, repr=False)
    _loader: BodyLoader | None = field(default=None, repr=False)
    _token: str | None = field(default=None, repr=False)  # the claim's xmin, as loaded
    _db: psycopg.Connection[Any] | None = field(default=None, repr=False)
    # What the stage replaced: a new header block or body (None: as stored).
    _new_header: bytes | None = field(default=None, repr=False)
    _new_body: bytes | None = field(default=None, repr=False)

    def _load(self) -> None:
        if self._loader is not None:
            header, self._body = self._loader()
            if header is not None:
                self._header = header
            self._loader = None

    @property
    def header(self) -> bytes | None:
        """The header block (loaded on first access if the stage did not declare it).

        Assigning bytes replaces it: the new header block is stored with the
        stage's outcome (a stage that signs or adds a field), for this row
        only (rows split from the same message keep theirs).
        """
        if self._new_header is not None:
            return self._new_header
        if self._header is None:
            self._load()
        return self._header

    @header.setter
    def header(self, value: bytes) -> None:
        self._new_header = _content("header", value)

    @property
    def body(self) -> bytes | None:
        """The body (loaded on first access if the stage did not declare it).

        Assigning bytes replaces it, as for `header`.
        """
        if self._new_body is not None:
            return self._new_body
        self._load()
        return self._body

    @body.setter
    def body(self, value: bytes) -> None:
        self._new_body = _content("body", value)

    @property
    def db(self) -> psycopg.Connection[Any]:
        """The transaction that will record this message's outcome (transactional stages).

        A psycopg connection inside an open transaction: what the stage
        writes through it commits together with the outcome, or not at all.
        Do not commit, roll back or close it; raise to undo. An async stage
        gets the same synchronous connection.
        """
        if self._db is None:
            raise PepsiError("msg.db is only open while a @stage(transactional=True) stage runs")
        return self._db

    def json(self) -> Any:
        """The body decoded as JSON (as `publish(..., json=obj)` sent it).

        A body that is missing or not JSON raises `PermanentError`: such a
        message can never succeed at a stage that expects JSON.
        """
        body = self.body
        if body is None:
            raise PermanentError("message has no body (expected JSON)")
        try:
            return json.loads(body)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both are
            raise PermanentError(f"body is not JSON: {exc}") from None

    @property
    def redelivered(self) -> bool:
        """Whether an earlier delivery of this message at some stage did not complete."""
        return bool(self.state.get("strikes") or self.state.get("temporary_failures"))

    def advance(self, to: str | None = None) -> Advance:
        return Advance(to)

    def finish(self) -> Finish:
        return Finish()

    def pause(
        self,
        delay: float | timedelta | None = None,
        *,
        until: datetime | None = None,
        reason: str | None = None,
    ) -> Pause:
        """Pause for `delay` seconds (or until `until`), then run this stage again."""
        if until is None:
            seconds = delay.total_seconds() if isinstance(delay, timedelta) else (delay or 0.0)
            until = datetime.now(UTC) + timedelta(seconds=seconds)
        return Pause(until, reason)
