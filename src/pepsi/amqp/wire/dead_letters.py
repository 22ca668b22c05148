"""The dead-letter history of a message and the `x-death` headers made from it (pure).

Pepsi keeps the history in a JSON-able form (stored in a jsonb column) and turns it
into the `x-death` headers, with the `x-first-death-*` and `x-last-death-*`
summaries, for `headers.set_headers` to write into the raw properties; following
RabbitMQ 3.13 (https://www.rabbitmq.com/docs/3.13/dlx#effects and rabbit's
`mc:record_death`). A client-sent `x-death` is read back into the same form.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

# Header names the broker writes for dead-lettering.
X_DEATH: Final = "x-death"
FIRST_DEATH_REASON: Final = "x-first-death-reason"
FIRST_DEATH_QUEUE: Final = "x-first-death-queue"
FIRST_DEATH_EXCHANGE: Final = "x-first-death-exchange"
LAST_DEATH_REASON: Final = "x-last-death-reason"
LAST_DEATH_QUEUE: Final = "x-last-death-queue"
LAST_DEATH_EXCHANGE: Final = "x-last-death-exchange"

# Dead-lettering reasons (the `reason` field's values).
REJECTED: Final = "rejected"
EXPIRED: Final = "expired"
MAXLEN: Final = "maxlen"
DELIVERY_LIMIT: Final = "delivery_limit"
DEATH_REASONS: Final = frozenset({REJECTED, EXPIRED, MAXLEN, DELIVERY_LIMIT})

# --- dead-letter history ----------------------------------------------------------------
#
# Stored form, most recent first (as x-death is): one dict per (queue, reason) with
# "queue", "reason", "count", "time" (float epoch seconds of the first death for that
# pair), "exchange", "routing-keys" (of that first death), and optionally
# "original-expiration" (the expiration property removed on dead-lettering),
# "last-exchange" and "last-time" (set when the pair is counted again).

Death = dict[str, Any]


def record_death(
    deaths: list[Death],
    *,
    queue: str,
    reason: str,
    exchange: str,
    routing_keys: list[str],
    now: float,
    original_expiration: str | None = None,
) -> list[Death]:
    """The history after one more dead-lettering (the input is not changed).

    As RabbitMQ 3.13 (`mc:record_death`): an entry for the same (queue, reason) gets
    count + 1 and moves to the front, keeping its time, exchange, routing keys and
    original expiration (x-death's `time` is the pair's first death); otherwise a new
    entry with count 1 goes first. `routing_keys` should include CC keys, not BCC ones.
    `original_expiration` is the message's expiration property if it had one.
    """
    if reason not in DEATH_REASONS:
        raise ValueError(f"unknown dead-lettering reason {reason!r}")
    rest: list[Death] = []
    found: Death | None = None
    for death in deaths:
        if found is None and death.get("queue") == queue and death.get("reason") == reason:
            found = death
        else:
            rest.append(dict(death))
    if found is not None:
        updated = dict(found)
        updated["count"] = int(found.get("count", 0)) + 1
        updated["routing-keys"] = list(found.get("routing-keys", []))
        # RabbitMQ reports the latest exchange in x-last-death-exchange (not the entry's).
        updated["last-exchange"] = exchange
        updated["last-time"] = now
        return [updated, *rest]
    new: Death = {
        "queue": queue,
        "reason": reason,
        "count": 1,
        "time": now,
        "exchange": exchange,
        "routing-keys": list(routing_keys),
    }
    if original_expiration is not None:
        new["original-expiration"] = original_expiration
    return [new, *rest]


def _death_table(death: Death) -> dict[str, object]:
    # RabbitMQ's field order and types (mc_amqpl:death_table): count 'l', strings 'S',
    # time 'T' in seconds, routing-keys an array of 'S'.
    table: dict[str, object] = {
        "count": int(death["count"]),
        "reason": str(death["reason"]),
        "queue": str(death["queue"]),
        "time": datetime.fromtimestamp(float(death["time"]), tz=UTC),
        "exchange": str(death.get("exchange", "")),
        "routing-keys": [str(key) for key in death.get("routing-keys", [])],
    }
    if "original-expiration" in death:
        table["original-expiration"] = str(death["original-expiration"])
    return table


def death_headers(deaths: list[Death], first: Death | None) -> dict[str, object]:
    """The dead-lettering headers to pass to `set_headers`.

    `x-death` (one table per entry, most recent first), `x-last-death-*` from the most
    recent death (`deaths[0]`), and `x-first-death-*` from `first`, the first death
    ever (kept apart since entries move; RabbitMQ never changes these once set). None
    of a group is produced when its source is missing.
    """
    headers: dict[str, object] = {}
    if deaths:
        headers[X_DEATH] = [_death_table(death) for death in deaths]
    if first is not None:
        headers[FIRST_DEATH_REASON] = str(first["reason"])
        headers[FIRST_DEATH_QUEUE] = str(first["queue"])
        headers[FIRST_DEATH_EXCHANGE] = str(first.get("exchange", ""))
    if deaths:
        last = deaths[0]
        headers[LAST_DEATH_REASON] = str(last["reason"])
        headers[LAST_DEATH_QUEUE] = str(last["queue"])
        headers[LAST_DEATH_EXCHANGE] = str(last.get("last-exchange", last.get("exchange", "")))
    return headers


def _text(value: object) -> str | None:
    """A decoded long string (pamqp gives bytes when it is not UTF-8): str or None."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode()
        except UnicodeDecodeError:
            return None
    return None


def _epoch(value: object) -> float | None:
    if isinstance(value, datetime):
        aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        return aware.timestamp()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def deaths_from_header(value: object) -> list[Death]:
    """A client-sent x-death (as `tables.decode_table` returns it) in the stored form,
    so that a republished dead letter keeps its history (RabbitMQ 3.13.3+ reads it too).

    Tolerant: anything but a list gives []; items without a string queue and reason,
    a positive integer count and a time are skipped; a missing exchange is "", routing
    keys that are not strings are dropped; a repeated (queue, reason) keeps its first
    (most recent) item.
    """
    if not isinstance(value, list | tuple):
        return []
    deaths: list[Death] = []
    seen: set[tuple[str, str]] = set()
    for item in value:
        if not isinstance(item, Mapping):
            continue
        queue, reason = _text(item.get("queue")), _text(item.get("reason"))
        count, time = item.get("count"), _epoch(item.get("time"))
        if queue is None or reason is None or time is None:
            continue
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            continue
        if (queue, reason) in seen:
            continue
        seen.add((queue, reason))
        keys = item.get("routing-keys")
        routing_keys = [
            text
            for key in (keys if isinstance(keys, list | tuple) else ())
            if (text := _text(key)) is not None
        ]
        death: Death = {
            "queue": queue,
            "reason": reason,
            "count": count,
            "time": time,
            "exchange": _text(item.get("exchange")) or "",
            "routing-keys": routing_keys,
        }
        expiration = _text(item.get("original-expiration"))
        if expiration is not None:
            death["original-expiration"] = expiration
        deaths.append(death)
    return deaths
