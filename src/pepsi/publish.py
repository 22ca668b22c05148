"""Publishing: a message becomes a committed row (the confirm, R-1).

This is the minimal producer the pipeline needs: `publish()` inserts `count`
copies of one message at a stage in one transaction with
`synchronous_commit = on`, sends one NOTIFY for the whole burst, and returns
the new ids once committed. Unknown stages are refused before anything is
written (R-2).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from pepsi.config import Config
from pepsi.db.queries import query
from pepsi.errors import PepsiError

MAX_COUNT = 1_000_000


class NoRoute(PepsiError):
    """Publishing to a stage that does not exist (RabbitMQ's 312 NO_ROUTE)."""


class InvalidMessage(PepsiError):
    """A message that cannot be published as given; nothing was written."""


def publish(
    conn: psycopg.Connection[Any],
    config: Config,
    stage: str,
    *,
    body: bytes | None = None,
    header: bytes | None = None,
    sender: str | None = None,
    recipients: Sequence[str] = (),
    user: str | None = None,
    peer: str | None = None,
    message_id: str | None = None,
    header_from: str | None = None,
    subject: str | None = None,
    content_type: str | None = None,
    correlation_id: str | None = None,
    properties: Mapping[str, Any] | None = None,
    count: int = 1,
) -> list[int]:
    """Publish `count` copies; return their ids after the commit."""
    if stage not in config.stages:
        known = ", ".join(config.stages) or "none configured"
        raise NoRoute(f"no stage named {stage!r} (stages: {known})")
    if not 1 <= count <= MAX_COUNT:
        raise InvalidMessage(f"count must be between 1 and {MAX_COUNT}, got {count}")
    if peer is not None:
        try:
            peer = str(ipaddress.ip_address(peer))
        except ValueError:
            raise InvalidMessage(f"peer is not an IP address: {peer!r}") from None
    params = {
        "stage": stage,
        "count": count,
        "has_body": body is not None or header is not None,
        "header": header,
        "body": body,
        "message_id": message_id,
        "sender": sender,
        "recipients": list(recipients),
        "origin_user": user,
        "origin_peer": peer,
        "header_from": header_from,
        "subject": subject,
        "content_type": content_type,
        "correlation_id": correlation_id,
        "properties": Jsonb(dict(properties or {})),
    }
    with conn.transaction():
        conn.execute("SET LOCAL synchronous_commit = on")
        rows = conn.execute(query("workqueue_publish"), params).fetchall()
        conn.execute(query("workqueue_notify"))
    return [int(row[0]) for row in rows]
