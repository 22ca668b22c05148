"""The expiry decisions of pepsi.amqp.broker.ttl: message expiry with x-message-ttl, and
which queues with x-expires are due for deletion."""

from __future__ import annotations

import datetime as dt

from pepsi.amqp.broker.catalogue import Queue
from pepsi.amqp.broker.ttl import expired_queues, first_use, ttl_expires
from pepsi.amqp.model.queues import QueueDeclaration

NOW = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)


def queue(name: str, vhost: str = "/", **arguments: object) -> Queue:
    return Queue(QueueDeclaration(name, vhost, arguments=arguments), f"amqp:{vhost}:{name}")


def test_ttl_expires_is_the_sooner_of_the_message_and_the_queue_expiry() -> None:
    second = dt.timedelta(seconds=1)
    assert ttl_expires(None, 1500, NOW) == NOW + 1.5 * second
    assert ttl_expires(NOW + second, 5000, NOW) == NOW + second  # its own is sooner
    assert ttl_expires(NOW + 10 * second, 5000, NOW) == NOW + 5 * second
    assert ttl_expires(None, 0, NOW) == NOW  # x-message-ttl = 0: expired now
    assert ttl_expires(NOW - second, 0, NOW) == NOW - second


def test_first_use_is_the_declaration_or_the_start_whichever_is_later() -> None:
    assert first_use(started=100.0, now=105.0, age_ms=2000) == 103.0
    assert first_use(started=100.0, now=105.0, age_ms=3_600_000) == 100.0  # timer restarts
    assert first_use(started=100.0, now=105.0, age_ms=-50) == 105.0  # clock skew: now


def test_only_queues_with_x_expires_unused_that_long_are_due() -> None:
    idle = queue("idle", **{"x-expires": 1000})
    fresh = queue("fresh", **{"x-expires": 1000})
    other_vhost = queue("idle", "v2", **{"x-expires": 1000})
    unknown = queue("unknown", **{"x-expires": 1})
    plain = queue("plain")
    last_use = {("/", "idle"): 10.0, ("/", "fresh"): 10.5, ("v2", "idle"): 10.0,
                ("/", "plain"): 0.0}  # fmt: skip
    queues = [idle, fresh, other_vhost, unknown, plain]
    assert expired_queues(queues, last_use, 10.999) == []
    assert expired_queues(queues, last_use, 11.0) == [idle, other_vhost]  # exactly due
    assert expired_queues(queues, last_use, 11.5) == [idle, fresh, other_vhost]


def test_a_queue_whose_arguments_do_not_parse_never_expires() -> None:
    broken = queue("broken", **{"x-expires": -5})  # written by hand: no arguments apply
    assert expired_queues([broken], {("/", "broken"): 0.0}, 1e9) == []
