"""Pool sizing and packing decisions (P-6). Pure: loads in, decisions out.

A stage's pool grows on demand up to PARALLELISM workers, each holding up to
its window of ids. Work is packed onto as few workers as possible (the busiest
worker with room first), so surplus workers go idle and are stopped after
WORKER_IDLE_TIMEOUT; under light load a stage settles on one worker.

The window is adaptive, up to QUEUE_LIMIT: a worker's queue holds about
PREFETCH_SECONDS of work at the stage's measured pace. A fast stage gets the
whole QUEUE_LIMIT (large batches, few claims); a slow one gets a window of one
or two, so its messages spread over the pool instead of queueing behind one
worker. A worker is topped up once it is down to half its window, so a claim
takes half a window at least rather than one id per answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

PREFETCH_SECONDS = 0.05  # a worker's queue holds about this much work at most
INITIAL_WINDOW = 4  # ids per worker until the stage's pace is known
PACE_UP = 0.5  # weight of an answer slower than the pace: a slowdown shows at once
PACE_DOWN = 0.1  # weight of a faster one: the window grows back gradually


@dataclass
class Pace:
    """A stage's seconds per message, from how long its workers take to answer.

    A sample is what one read of a worker's answers covers: the time from the
    first of them reaching the head of the worker's queue to their arrival,
    divided by their number. A batch answered at once is one sample of its
    time per message, whatever its size. The average follows a slowdown at
    once (a too-large window queues slow messages behind one worker) and a
    speed-up gradually (a too-small one only costs more claims).
    """

    seconds: float | None = None

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        if self.seconds is None:
            self.seconds = seconds
        else:
            weight = PACE_UP if seconds > self.seconds else PACE_DOWN
            self.seconds += weight * (seconds - self.seconds)

    def window(self, queue_limit: int) -> int:
        """Ids a worker may hold: PREFETCH_SECONDS of work, 1 … QUEUE_LIMIT."""
        if self.seconds is None:
            return min(queue_limit, INITIAL_WINDOW)
        if self.seconds * queue_limit <= PREFETCH_SECONDS:
            return queue_limit
        # (a hair under the exact quotient, so that 0.05 / 0.01 is 5, not 6)
        return max(1, min(queue_limit, math.ceil(PREFETCH_SECONDS / self.seconds - 1e-9)))


@dataclass(frozen=True)
class WorkerLoad:
    key: int
    inflight: int  # ids written to it and not yet answered
    room: int  # ids it may still take now (its window and MAX_MESSAGES allowing)
    idle_since: float | None = None  # monotonic time it last became empty
    ready: bool = True  # False until the worker has printed `ready`


def room_for(inflight: int, handled: int, window: int, max_messages: int) -> int:
    """Ids a worker may take: its window's free slots once it is down to half of it,
    within its MAX_MESSAGES budget."""
    if inflight > window // 2:
        return 0  # topped up at half: claims come in half windows, not an id per answer
    return max(0, min(window - inflight, max_messages - handled - inflight))


@dataclass(frozen=True)
class Assignment:
    to_existing: dict[int, list[int]] = field(default_factory=dict)  # worker key -> ids
    to_new: list[list[int]] = field(default_factory=list)  # one id list per new worker
    leftover: list[int] = field(default_factory=list)  # no room for them any more


def worker_limit(parallelism: int, cap: int | None = None) -> int:
    """How many workers a stage may run: PARALLELISM, or a temporary lower cap."""
    return max(1, min(parallelism, cap)) if cap is not None else parallelism


def startable(workers: Sequence[WorkerLoad], limit: int) -> int:
    """Workers the stage may start now: one at a time (slow start).

    A new worker is started only once the previous one has announced
    `ready`, so a burst grows the pool step by step instead of paying every
    process start at once (on two cores, sixteen interpreters starting
    together stall the whole pipeline for seconds).
    """
    if any(not w.ready for w in workers):
        return 0
    return 1 if len(workers) < limit else 0


def free_capacity(workers: Sequence[WorkerLoad], limit: int, window: int) -> int:
    """Ids the stage can take now: room in its workers plus a worker it may start."""
    return sum(w.room for w in workers) + startable(workers, limit) * window


def assign(
    ids: Sequence[int], workers: Sequence[WorkerLoad], limit: int, window: int
) -> Assignment:
    """Pack `ids` onto the busiest workers with room first, then onto new workers.

    The caller claimed at most the free capacity, but workers may have died
    while the claim ran: ids beyond the capacity left are returned as
    `leftover`, for the caller to requeue.
    """
    result = Assignment()
    pending = list(ids)
    candidates = sorted((w for w in workers if w.room > 0), key=lambda w: (-w.inflight, w.key))
    for worker in candidates:
        if not pending:
            break
        take = worker.room
        result.to_existing[worker.key], pending = pending[:take], pending[take:]
    if pending and startable(workers, limit):
        result.to_new.append(pending[:window])
        pending = pending[window:]
    result.leftover.extend(pending)
    return result


class Idling(Protocol):
    """What idle retirement needs of a worker (a load, or the decisions' facts)."""

    @property
    def key(self) -> int: ...
    @property
    def inflight(self) -> int: ...
    @property
    def idle_since(self) -> float | None: ...


def idle_to_stop(workers: Sequence[Idling], now: float, idle_timeout: float) -> list[int]:
    """Workers empty for at least `idle_timeout`."""
    return [
        w.key
        for w in workers
        if w.inflight == 0 and w.idle_since is not None and now - w.idle_since >= idle_timeout
    ]


def next_idle_deadline(workers: Sequence[Idling], idle_timeout: float) -> float | None:
    """When the next idle worker is due to stop, if any is idle."""
    times = [
        w.idle_since + idle_timeout for w in workers if w.inflight == 0 and w.idle_since is not None
    ]
    return min(times) if times else None
