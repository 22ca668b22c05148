"""What the dispatcher does about its workers (P-6, W-6, W-7). Pure: facts in, decisions out.

The pool supervisor gathers frozen facts about its workers and their exits,
asks these functions what to do, and carries the answer out: it kills,
stops, strikes and requeues; nothing here touches a process, a row or the
clock (the time is a parameter).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pepsi.dispatch.policy import pools
from pepsi.durations import format_seconds
from pepsi.errors import EX_CONFIG, EX_IOERR


class WorkerFacts(NamedTuple):
    """One live worker as the decisions see it (a tuple: built per worker per wakeup)."""

    key: int
    ready: bool = True
    stopping: bool = False
    started_at: float = 0.0
    inflight: int = 0
    head_since: float | None = None  # when the message at the head of its queue got there
    idle_since: float | None = None  # when it last became empty
    handled: int = 0


@dataclass(frozen=True)
class Exit:
    """How a worker ended."""

    returncode: int | None
    was_ready: bool
    expected: bool  # the dispatcher asked it to stop
    reason: str
    unanswered: tuple[int, ...]  # ids written to it without a status line
    last_words: str | None = None  # its last line on stderr (why it refused, say)
    solo: bool = False  # it was running one isolated suspect
    garbled: bool = False  # its answer for the head message was unreadable
    timed_out: bool = False  # killed for exceeding MAX_RUNTIME


# ---- a worker's exit (W-6, W-7) --------------------------------------------


@dataclass(frozen=True)
class Retired:
    """It stopped when asked: what it had not answered goes back, uncharged."""

    requeue: tuple[int, ...]


@dataclass(frozen=True)
class FailedStart:
    """It died before `ready` (W-7): nothing is charged; the stage cools down.

    `database`: it could not reach the database (exit 74: down, lost, a
    standby). That is a failover's symptom, not the stage's fault: the stage
    retries on the reconnect backoff rather than resting START_COOLDOWN.
    """

    requeue: tuple[int, ...]
    cause: str
    database: bool = False


@dataclass(frozen=True)
class Struck:
    """It died holding one known culprit (W-6): a strike; the rest go back."""

    wid: int
    kind: str  # crashed | timed-out
    requeue: tuple[int, ...]


@dataclass(frozen=True)
class Isolate:
    """It died holding several: the culprit is unknown, so each runs alone."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class Lost:
    """It died holding nothing: only a warning."""


ExitDecision = Retired | FailedStart | Struck | Isolate | Lost


def on_exit(exit_: Exit) -> ExitDecision:
    """The W-6/W-7 decision tree for one worker's end."""
    if exit_.expected:
        return Retired(exit_.unanswered)
    if not exit_.was_ready:
        cause = exit_.last_words or exit_.reason
        if exit_.returncode == EX_CONFIG:
            cause = f"refused to run (exit 78): {cause}"
        return FailedStart(exit_.unanswered, cause, database=exit_.returncode == EX_IOERR)
    if not exit_.unanswered:
        return Lost()
    if len(exit_.unanswered) == 1 or exit_.solo or exit_.garbled:
        # The message it held (or answered with garbage) is the culprit. A
        # batched worker answers its ids together, so with several in flight
        # the head is not necessarily the one: those are isolated instead.
        head, *rest = exit_.unanswered
        return Struck(head, "timed-out" if exit_.timed_out else "crashed", tuple(rest))
    return Isolate(exit_.unanswered)


# ---- tending a pool (P-6, W-5, W-6) -----------------------------------------


@dataclass(frozen=True)
class Kill:
    key: int
    reason: str
    timed_out: bool = False  # its head message hung: it gets a timed-out strike


@dataclass(frozen=True)
class Stop:
    """Close its input: it finishes what it holds and exits."""

    key: int


class PoolRules(NamedTuple):
    """The timings and limits one stage's pool is tended by."""

    limit: int  # workers it may run now (PARALLELISM or a back-pressure cap)
    max_runtime: float
    max_messages: int
    ready_timeout: float
    idle_timeout: float


def tend(workers: Sequence[WorkerFacts], rules: PoolRules, now: float) -> list[Kill | Stop]:
    """Kill hung workers; stop idle, spent and surplus ones, the emptiest first."""
    live = [w for w in workers if not w.stopping]
    actions: list[Kill | Stop] = []
    for w in live:
        if not w.ready and now - w.started_at > rules.ready_timeout:
            actions.append(Kill(w.key, f"not ready after {format_seconds(rules.ready_timeout)}"))
        elif w.ready and w.inflight and _hung(w, rules.max_runtime, now):
            actions.append(
                Kill(w.key, f"gave no answer within MAX_RUNTIME ({rules.max_runtime:g}s)", True)
            )
    idle = set(pools.idle_to_stop(live, now, rules.idle_timeout))
    surplus = len(live) - rules.limit
    for w in sorted(live, key=lambda w: w.inflight):
        spent = w.handled >= rules.max_messages and not w.inflight
        if w.key in idle or spent or surplus > 0:
            surplus -= 1
            actions.append(Stop(w.key))
    return actions


def _hung(worker: WorkerFacts, max_runtime: float, now: float) -> bool:
    return worker.head_since is not None and now - worker.head_since > max_runtime


def deadlines(workers: Sequence[WorkerFacts], rules: PoolRules) -> list[float]:
    """When `tend` may next have something to do for these workers."""
    times: list[float] = []
    live = [w for w in workers if not w.stopping]
    for w in live:
        if not w.ready:
            times.append(w.started_at + rules.ready_timeout)
        elif w.inflight and w.head_since is not None:
            times.append(w.head_since + rules.max_runtime)
    idle = pools.next_idle_deadline(live, rules.idle_timeout)
    if idle is not None:
        times.append(idle)
    return times


# ---- isolation (W-6) ----------------------------------------------------------


@dataclass(frozen=True)
class IsolationPlan:
    to_existing: tuple[tuple[int, int], ...] = ()  # (worker key, id): one id each
    to_new: int | None = None  # an id to start a new worker with


def isolate(
    suspects: Sequence[int], workers: Sequence[WorkerFacts], can_start: bool
) -> IsolationPlan:
    """Hand each suspect, alone, to an empty ready worker; else start one for the next."""
    empty = [w.key for w in workers if w.ready and not w.stopping and not w.inflight]
    pairs = tuple(zip(empty, suspects, strict=False))
    left = suspects[len(pairs) :]
    return IsolationPlan(pairs, left[0] if left and can_start else None)


# ---- the loop's sleep and wakeups (P-3, P-9) ----------------------------------


def sleep_time(now: float, times: Iterable[float]) -> float:
    """Seconds until the earliest deadline; 0 if one has passed."""
    return max(0.0, min(times, default=now) - now)


def wakeup_causes(causes: set[str], now: float, next_poll: float) -> set[str]:
    """P-9: each cause once; a wakeup with no event is the poll tick or another timer."""
    if causes:
        return causes
    return {"poll" if now >= next_poll else "timer"}
