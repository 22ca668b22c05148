"""Time to live, as RabbitMQ's TTLs: when a message or an unused queue is due to expire.

Pure decisions, for publishing (`ttl_expires`: the row's `expires` under x-message-ttl)
and for the expiry passes (`first_use`, `expired_queues`: x-expires), which
`expiry.Expiry` runs against the database.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping

from pepsi.amqp.broker.catalogue import Queue

QueueKey = tuple[str, str]  # (vhost, name)


def ttl_expires(expires: dt.datetime | None, ttl_ms: int, now: dt.datetime) -> dt.datetime:
    """A message's expiry in a queue with x-message-ttl: the sooner of its own
    (`expiration`, None: none) and the queue's. A TTL of 0 expires it now."""
    queue_expiry = now + dt.timedelta(milliseconds=ttl_ms)
    return queue_expiry if expires is None or queue_expiry < expires else expires


def first_use(started: float, now: float, age_ms: int) -> float:
    """When a queue not seen used yet counts as last used: its declaration (`age_ms`
    ago), or the service's start if later (RabbitMQ's timer restarts with the broker)."""
    return max(started, now - max(age_ms, 0) / 1000)


def expired_queues(
    queues: Iterable[Queue], last_use: Mapping[QueueKey, float], now: float
) -> list[Queue]:
    """The queues with x-expires that have been unused that long (`last_use`: when each
    was last used, in the clock of `now`; a queue missing from it is in use now)."""
    due = []
    for queue in queues:
        expires = queue.arguments.expires
        if expires is None:
            continue
        used = last_use.get((queue.declaration.vhost, queue.name), now)
        if now - used >= expires / 1000:
            due.append(queue)
    return due


__all__ = ["QueueKey", "expired_queues", "first_use", "ttl_expires"]
