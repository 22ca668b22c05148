"""Headers the broker adds to a message's raw content properties on delivery (pure: no I/O).

Pepsi stores a publisher's property octets exactly as sent and hands them back byte for
byte (`properties` says why: pamqp's table re-encoding is lossy). Yet, like RabbitMQ, it
must add headers of its own when delivering: `x-delivery-count` on a quorum queue's
redelivery, and dead-lettering's `x-death` with the `x-first-death-*` and
`x-last-death-*` summaries (`dead_letters` makes them). This module edits the headers
table *in place* in the raw octets: the client's entries are copied as the octets they
were, only the named entries are replaced or removed, the table's length is
recomputed, and every other property is left untouched.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Collection, Mapping
from datetime import UTC, datetime
from typing import Final

from pepsi.amqp.wire.replies import FrameError
from pepsi.amqp.wire.tables import _Malformed, _Walker, decode_table

# --- the property list ------------------------------------------------------------------

# Flag bits of the basic class's property-flags word (bit 15 is the first property).
CONTENT_TYPE_BIT: Final = 15
CONTENT_ENCODING_BIT: Final = 14
HEADERS_BIT: Final = 13
DELIVERY_MODE_BIT: Final = 12
PRIORITY_BIT: Final = 11
CORRELATION_ID_BIT: Final = 10
REPLY_TO_BIT: Final = 9
EXPIRATION_BIT: Final = 8
MESSAGE_ID_BIT: Final = 7
TIMESTAMP_BIT: Final = 6
TYPE_BIT: Final = 5
USER_ID_BIT: Final = 4
APP_ID_BIT: Final = 3
CLUSTER_ID_BIT: Final = 2

_SHORTSTR: Final = "s"
_TABLE: Final = "t"
# Each property's bit and wire form: "s" shortstr, "t" table, an int: that many octets.
_LAYOUT: Final[tuple[tuple[int, str | int], ...]] = (
    (CONTENT_TYPE_BIT, _SHORTSTR), (CONTENT_ENCODING_BIT, _SHORTSTR), (HEADERS_BIT, _TABLE),
    (DELIVERY_MODE_BIT, 1), (PRIORITY_BIT, 1), (CORRELATION_ID_BIT, _SHORTSTR),
    (REPLY_TO_BIT, _SHORTSTR), (EXPIRATION_BIT, _SHORTSTR), (MESSAGE_ID_BIT, _SHORTSTR),
    (TIMESTAMP_BIT, 8), (TYPE_BIT, _SHORTSTR), (USER_ID_BIT, _SHORTSTR),
    (APP_ID_BIT, _SHORTSTR), (CLUSTER_ID_BIT, _SHORTSTR),
)  # fmt: skip

# Header names the broker writes.
DELIVERY_COUNT: Final = "x-delivery-count"

_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_U64 = struct.Struct(">Q")
_F64 = struct.Struct(">d")
_SHORTSTR_MAX: Final = 255
_LONG_MAX: Final = 0xFFFFFFFF

# --- encoding ---------------------------------------------------------------------------


def _shortstr(name: str) -> bytes:
    data = name.encode()
    if len(data) > _SHORTSTR_MAX:
        raise ValueError(f"field name of {len(data)} octets (at most {_SHORTSTR_MAX})")
    return bytes([len(data)]) + data


def _long_prefixed(data: bytes) -> bytes:
    if len(data) > _LONG_MAX:
        raise ValueError(f"field value of {len(data)} octets (at most {_LONG_MAX})")
    return _U32.pack(len(data)) + data


def encode_value(value: object) -> bytes:  # noqa: PLR0911  # one return per type
    """One field value, type octet first, with the types RabbitMQ itself writes.

    bool 't', int 'l' (signed 64-bit), str 'S', bytes 'x', float 'd', datetime 'T'
    (POSIX seconds; a naive datetime is taken as UTC), list/tuple 'A', Mapping 'F',
    None 'V'. pamqp's encoder is not used: it picks its own integer widths and turns
    floats into 32-bit 'f'. TypeError for other types, ValueError for values out of range.
    """
    # bool before int: bool is an int subclass.
    if isinstance(value, bool):
        return b"t\x01" if value else b"t\x00"
    if isinstance(value, int):
        if not -(1 << 63) <= value < (1 << 63):
            raise ValueError(f"integer {value} does not fit a signed 64-bit field")
        return b"l" + _I64.pack(value)
    if isinstance(value, str):
        return b"S" + _long_prefixed(value.encode())
    if isinstance(value, bytes | bytearray | memoryview):
        return b"x" + _long_prefixed(bytes(value))
    if isinstance(value, float):
        return b"d" + _F64.pack(value)
    if isinstance(value, datetime):
        aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        seconds = math.floor(aware.timestamp())
        if not 0 <= seconds < (1 << 64):
            raise ValueError(f"timestamp {value} is outside the unsigned 64-bit range")
        return b"T" + _U64.pack(seconds)
    if isinstance(value, list | tuple):
        return b"A" + _long_prefixed(b"".join(encode_value(item) for item in value))
    if isinstance(value, Mapping):
        return b"F" + _long_prefixed(encode_entries(value))
    if value is None:
        return b"V"
    raise TypeError(f"cannot encode {type(value).__name__} as an AMQP field value")


def encode_entries(entries: Mapping[str, object]) -> bytes:
    """Field-table items (name, value, ...) without the table's 4-octet length."""
    parts: list[bytes] = []
    for name, value in entries.items():
        if not isinstance(name, str):
            raise TypeError(f"field names are str, not {type(name).__name__}")
        parts.append(_shortstr(name))
        parts.append(encode_value(value))
    return b"".join(parts)


# --- reading and editing raw properties -------------------------------------------------


def _locate_headers(raw: bytes) -> tuple[int, int | None, int]:
    """Walk raw property octets: (flags, start of the headers table's length field or
    None when absent, where a table goes: the octet after content_type/encoding).

    ValueError when the structure is malformed (as the reader would refuse it).
    """
    end = len(raw)
    if end < 2:
        raise ValueError("malformed properties: shorter than the flag word")
    flags = int.from_bytes(raw[:2], "big")
    pos = 2
    table_at: int | None = None
    insert_at = 2
    walker = _Walker(raw)
    try:
        for bit, kind in _LAYOUT:
            if bit == HEADERS_BIT:
                insert_at = pos
            if not flags & (1 << bit):
                continue
            if kind == _SHORTSTR:
                pos = walker.shortstr(pos, end)
            elif kind == _TABLE:
                table_at = pos
                pos = walker.longstr(pos, end)  # its items are walked by _table_items
            else:
                assert isinstance(kind, int)
                pos = walker.need(pos, kind, end)
    except _Malformed as error:
        raise ValueError(f"malformed properties: {error}") from None
    if pos != end:
        raise ValueError(f"malformed properties: {end - pos} octets after the last property")
    return flags, table_at, insert_at


def _table_items(raw: bytes, start: int, end: int) -> list[tuple[bytes, int, int]]:
    """The items of the table in raw[start:end]: (name octets, item start, item end),
    each item's structure checked (ValueError if malformed)."""
    items: list[tuple[bytes, int, int]] = []
    pos = start
    try:
        while pos < end:
            # One walker per item: the item-count bound applies to each entry, so a
            # long x-death that Pepsi itself wrote stays editable.
            walker = _Walker(raw)
            key_end = walker.shortstr(pos, end)
            item_end = walker.value(key_end, end, 1)
            items.append((raw[pos + 1 : key_end], pos, item_end))
            pos = item_end
    except _Malformed as error:
        raise ValueError(f"malformed headers table: {error}") from None
    return items


def set_headers(raw: bytes, entries: Mapping[str, object], remove: Collection[str] = ()) -> bytes:
    """New raw property octets whose headers table holds `entries` (appended in order,
    each replacing any entry of that name) and no entry named in `remove`.

    Every other octet is kept: the other properties and the other table entries as the
    client encoded them. Without a headers property, flag bit 13 is set and a table is
    inserted where it belongs. ValueError if `raw` is malformed.
    """
    flags, table_at, insert_at = _locate_headers(raw)
    added = encode_entries(entries)
    dropped = {name.encode() for name in entries} | {name.encode() for name in remove}
    if table_at is None:
        new_flags = (flags | (1 << HEADERS_BIT)).to_bytes(2, "big")
        return new_flags + raw[2:insert_at] + _long_prefixed(added) + raw[insert_at:]
    start = table_at + 4
    end = start + _U32.unpack_from(raw, table_at)[0]
    kept = [
        raw[item_start:item_end]
        for name, item_start, item_end in _table_items(raw, start, end)
        if name not in dropped  # duplicates of a dropped name all go
    ]
    table = _long_prefixed(b"".join(kept) + added)
    return raw[:table_at] + table + raw[end:]


def expiration(raw: bytes) -> str | None:
    """The `expiration` property of raw property octets (None without one)."""
    span = _property_span(raw, EXPIRATION_BIT)
    if span is None:
        return None
    start, end = span
    return raw[start + 1 : end].decode("utf-8", "replace")


def without_expiration(raw: bytes) -> bytes:
    """The raw properties without `expiration` (its flag and its octets), every other
    octet kept: RabbitMQ removes it from a message it dead-letters, which then expires
    by its new queue's x-message-ttl only. ValueError if `raw` is malformed."""
    span = _property_span(raw, EXPIRATION_BIT)
    if span is None:
        return raw
    start, end = span
    flags = int.from_bytes(raw[:2], "big") & ~(1 << EXPIRATION_BIT)
    return flags.to_bytes(2, "big") + raw[2:start] + raw[end:]


def _property_span(raw: bytes, wanted: int) -> tuple[int, int] | None:
    """Where property `wanted` (its flag bit) lies in raw property octets, None if absent."""
    end = len(raw)
    if end < 2:
        raise ValueError("malformed properties: shorter than the flag word")
    flags = int.from_bytes(raw[:2], "big")
    if not flags & (1 << wanted):
        return None
    pos = 2
    walker = _Walker(raw)
    try:
        for bit, kind in _LAYOUT:
            if not flags & (1 << bit):
                continue
            start = pos
            if kind == _SHORTSTR:
                pos = walker.shortstr(pos, end)
            elif kind == _TABLE:
                pos = walker.longstr(pos, end)
            else:
                assert isinstance(kind, int)
                pos = walker.need(pos, kind, end)
            if bit == wanted:
                return start, pos
    except _Malformed as error:
        raise ValueError(f"malformed properties: {error}") from None
    return None


def header_entry(raw: bytes, name: str) -> object | None:
    """The decoded value of header `name` in raw properties (None if absent).

    Only that entry is decoded (by pamqp, through `tables.decode_table`); with
    duplicate names the first one counts, as in RabbitMQ's table lookup.
    ValueError if the properties or the entry are malformed.
    """
    _, table_at, _ = _locate_headers(raw)
    if table_at is None:
        return None
    start = table_at + 4
    end = start + _U32.unpack_from(raw, table_at)[0]
    wanted = name.encode()
    for key, item_start, item_end in _table_items(raw, start, end):
        if key == wanted:
            try:
                decoded = decode_table(raw[item_start:item_end])
            except FrameError as error:
                raise ValueError(str(error)) from None
            value: object = next(iter(decoded.values()))
            return value
    return None
