"""A claimed row as basic.deliver and basic.get-ok need it: `Fetched`, and `fetched_row`.

Pure: the columns of `amqp_delivery_load` (or `amqp_get`) decoded once, when the row is
loaded, so that sending it is encoding frames only. The stored content header goes out
as it is, with x-delivery-count and x-death added where the row has them; a message a
stage of the pipeline sent to an AMQP queue gets properties from its columns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from pamqp import commands

from pepsi.amqp.wire import dead_letters, headers
from pepsi.amqp.wire.properties import encode_properties

EMPTY_PROPERTIES = b"\x00\x00"  # a row without a stored content header: no properties


class Fetched(NamedTuple):
    """A row as basic.deliver and basic.get-ok need it."""

    wid: int
    exchange: str
    routing_key: str
    redelivered: bool
    delivery_count: int
    expires: float | None  # POSIX seconds; RabbitMQ never delivers an expired message
    raw_properties: bytes
    body: bytes

    def expired(self, now: float) -> bool:
        return self.expires is not None and self.expires <= now


def fetched_row(row: Sequence[Any], queue_name: str, quorum: bool = True) -> Fetched:
    """A row of `amqp_delivery_load` (or `amqp_get`): id, exchange, routing key, delivery
    count, redelivered, x-death, first death, expires, header, body. `quorum`: the queue
    counts deliveries in `x-delivery-count` (classic ones do not)."""
    wid, exchange, routing_key, count, redelivered, deaths, first, expires, header, body = row[:10]
    foreign = row[10]
    if foreign is None and not count and not deaths:  # the common case: a first delivery
        return Fetched(
            int(wid), exchange or "", queue_name if routing_key is None else routing_key,
            bool(redelivered), 0, None if expires is None else float(expires),
            EMPTY_PROPERTIES if header is None else bytes(header),
            b"" if body is None else bytes(body),
        )  # fmt: skip
    count = int(count or 0)
    if foreign is not None:  # advanced here by a stage of the pipeline: no AMQP header
        message_id, content_type, correlation_id, properties = foreign
        raw = pipeline_properties(message_id, content_type, correlation_id, properties, header)
    else:
        raw = bytes(header) if header is not None else EMPTY_PROPERTIES
    if (count and quorum) or deaths:
        entries: dict[str, object] = {}
        if count and quorum:
            entries["x-delivery-count"] = count
        if deaths:
            entries.update(dead_letters.death_headers(deaths, first))
            raw = headers.without_expiration(raw)  # RabbitMQ: in x-death's original-expiration
        raw = headers.set_headers(raw, entries)
    return Fetched(
        int(wid),
        exchange or "",
        queue_name if routing_key is None else routing_key,
        bool(redelivered) or count > 0,
        count,
        None if expires is None else float(expires),
        raw,
        bytes(body) if body is not None else b"",
    )


def pipeline_properties(
    message_id: str | None,
    content_type: str | None,
    correlation_id: str | None,
    properties: Mapping[str, Any] | None,
    header: bytes | None,
) -> bytes:
    """AMQP properties for a message a stage of the pipeline sent to an AMQP queue (NEXT
    = amqp:QUEUE): its columns as the properties of the same name, its `properties` as
    headers, its header block (if any) as the header `x-pepsi-header`; persistent."""
    table: dict[str, object] = {
        str(k): v for k, v in (properties or {}).items() if _header_value(v)
    }
    if header is not None:
        table["x-pepsi-header"] = bytes(header)
    raw = encode_properties(
        commands.Basic.Properties(
            content_type=_short(content_type),
            message_id=_short(message_id),
            correlation_id=_short(correlation_id),
            delivery_mode=2,
        )
    )
    return headers.set_headers(raw, table) if table else raw


def _short(text: str | None) -> str | None:
    """A property that fits a shortstr, or none."""
    return text if text is not None and len(text.encode()) <= 255 else None


def _header_value(value: object) -> bool:
    """JSON values a field table carries as they are (nested ones too)."""
    if value is None or isinstance(value, bool | int | float | str):
        return not isinstance(value, int) or -(2**63) <= value < 2**63
    if isinstance(value, list):
        return all(_header_value(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _header_value(v) for k, v in value.items())
    return False


__all__ = ["EMPTY_PROPERTIES", "Fetched", "fetched_row", "pipeline_properties"]
