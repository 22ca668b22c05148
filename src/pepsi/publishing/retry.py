"""Whether a failed publish is tried again, and after how long. Pure: no I/O, no clock.

A failed publish is one of three things (Q-3):

- *not written*: nothing reached a primary that could commit it (no connection
  from the pool, a read-only node, a server in recovery, too many clients).
  Trying again cannot duplicate anything.
- *outcome unknown*: the connection went, or the confirm did not come
  (`NotConfirmed`), after the statement may have committed. Trying again is
  safe only when every message carries a message id under `dedup=True`: the
  database then returns the first publish's id instead of a second row.
- *final*: anything else (a refusal, a bad message, the caller's bug); trying
  again would give the same answer.

`idempotent()` gives each message without a message id a fresh one (uuid4)
and `dedup=True` before the first attempt, so that an unknown outcome can be
retried. `decide()` says whether to try again and after which delay; the
delays come from the shared reconnect policy (`pepsi.db.backoff`).
"""

from __future__ import annotations

import dataclasses
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from pepsi.db.backoff import DEFAULT_CAP, Backoff
from pepsi.errors import DatabaseLost, classify, is_unwritten
from pepsi.publishing.message import OutgoingMessage

DEFAULT_DEADLINE = 60.0  # seconds: longer than a tuned failover (~30 s), see docs/replication.md


@dataclass(frozen=True)
class Retry:
    """How a publish is retried (`retry=` of the publish API; `retry=True` is `Retry()`).

    Attempts stop at whichever bound comes first: `attempts` in all (None: no
    count), or `deadline` seconds after the first attempt began. The delay
    between attempts doubles from 0.1 s up to `max_delay`, jittered.
    """

    deadline: float = DEFAULT_DEADLINE
    attempts: int | None = None
    max_delay: float = DEFAULT_CAP

    def __post_init__(self) -> None:
        if not self.deadline > 0:
            raise ValueError(f"Retry.deadline must be > 0 seconds, not {self.deadline!r}")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"Retry.attempts must be at least 1, not {self.attempts!r}")
        if not self.max_delay > 0:
            raise ValueError(f"Retry.max_delay must be > 0 seconds, not {self.max_delay!r}")


class Failure(Enum):
    NOT_WRITTEN = "not written"
    UNKNOWN = "outcome unknown"
    FINAL = "final"


def failure(error: BaseException) -> Failure:
    """What a publish's error says about its messages (classified by `pepsi.errors`)."""
    if is_unwritten(error):
        return Failure.NOT_WRITTEN
    if isinstance(classify(error), DatabaseLost):  # NotConfirmed is one
        return Failure.UNKNOWN
    return Failure.FINAL


def policy(given: Retry | bool | None, default: Retry | None) -> Retry | None:
    """A call's `retry=`: None keeps the publisher's, False turns it off, True is `Retry()`."""
    if given is None:
        return default
    if given is True:
        return Retry()
    if given is False:
        return None
    if isinstance(given, Retry):
        return given
    raise TypeError(f"retry must be a Retry, True, False or None, not {type(given).__name__}")


def _uuid() -> str:
    return str(uuid.uuid4())


def idempotent(
    messages: Sequence[OutgoingMessage], make_id: Callable[[], str] = _uuid
) -> list[OutgoingMessage]:
    """`messages` with a generated message id and dedup=True where they had no message id.

    A message that has its own message id keeps it, and its own `dedup`.
    """
    return [
        dataclasses.replace(m, message_id=make_id(), dedup=True) if m.message_id is None else m
        for m in messages
    ]


def all_deduplicated(messages: Sequence[OutgoingMessage]) -> bool:
    """Whether publishing `messages` again cannot create a second copy of any of them."""
    return all(m.dedup is True and m.message_id is not None for m in messages)


def decide(
    rule: Retry,
    error: BaseException,
    *,
    attempt: int,
    elapsed: float,
    delay: float,
    idempotent: bool,
    spent: float = 0.0,
) -> float | None:
    """The pause before attempt `attempt + 1`, or None: raise `error`.

    `attempt` attempts have been made, the first `elapsed` seconds ago, the
    last one failing after `spent` seconds; `delay` is the next delay of the
    backoff series, counted from the failed attempt's start: an attempt that
    already waited (for a pool connection) is not made to wait twice.
    `idempotent`: every message is deduplicated by its message id.
    """
    kind = failure(error)
    if kind is Failure.FINAL:
        return None
    if kind is Failure.UNKNOWN and not idempotent:
        return None  # a second copy is possible: the caller decides
    if rule.attempts is not None and attempt >= rule.attempts:
        return None
    pause = max(0.0, delay - spent)
    if elapsed + pause >= rule.deadline:
        return None
    return pause


class Attempts:
    """The attempts of one publish call under `rule`: count, deadline, backoff. Clock injected."""

    def __init__(
        self,
        rule: Retry,
        *,
        idempotent: bool,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.rule = rule
        self.idempotent = idempotent
        self.clock = clock
        self.delays = Backoff(rule.max_delay).delays(rng)
        self.started = clock()
        self.began = self.started
        self.made = 0

    def begin(self) -> None:
        self.made += 1
        self.began = self.clock()

    def remaining(self) -> float:
        """Seconds left before the deadline (an attempt waits no longer for a connection)."""
        return max(0.0, self.rule.deadline - (self.clock() - self.started))

    def failed(self, error: BaseException) -> float | None:
        """The pause before the next attempt, or None: raise `error`."""
        now = self.clock()
        return decide(
            self.rule,
            error,
            attempt=self.made,
            elapsed=now - self.started,
            delay=next(self.delays),
            idempotent=self.idempotent,
            spent=now - self.began,
        )
