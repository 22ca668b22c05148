"""Array arguments of a publish batch, packed in PostgreSQL's binary format here.

Most columns of a batch of AMQP publishes repeat one value (the queue's stage, the
user, the client's address, the routing properties, the raw property list) or are
all NULL (message-id, correlation-id, expiration, when the publisher sets none).
psycopg dumps a list element by element (about 0.3 µs each, 3 000 to 4 000 elements
a batch), and finds a dumper for each list first (28 µs for the twelve arguments of
a one-message batch, Celery's usual); such a column is one element repeated, so it
is packed here at once, and any other column of text or octets (and NULLs) in one
pass: `pack_columns` turns it into a `PackedText` or `PackedBytea`, which the
dumpers that `register` installs send as they are (the statement casts text to the
column's type). Other columns (timestamps, numbers, flags) stay lists for psycopg.

The format (`array_send`): dimensions (1), a has-nulls flag, the element type's oid,
then per dimension its length and lower bound (1); then each element as an int32
length (-1 for NULL) and its octets.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, Final

from psycopg.abc import AdaptContext
from psycopg.adapt import Dumper
from psycopg.pq import Format

TEXT_OID: Final = 25
BYTEA_OID: Final = 17
TEXT_ARRAY_OID: Final = 1009
BYTEA_ARRAY_OID: Final = 1001

_HEAD: Final = struct.Struct(">iiIii")  # ndim, has nulls, element oid, length, lower bound
_LENGTH: Final = struct.Struct(">i")
_NULL: Final = _LENGTH.pack(-1)
PACK_BODIES_MAX: Final = 64 * 1024  # body octets of a batch packed here (see pack_columns)


class PackedText(bytes):
    """A text[] in binary form (`pack`)."""


class PackedBytea(bytes):
    """A bytea[] in binary form (`pack`)."""


def pack(value: str | bytes | None, count: int) -> PackedText | PackedBytea:
    """`count` times `value` as a one-dimensional array (text[] for str and NULL)."""
    if value is None:
        return PackedText(_HEAD.pack(1, 1, TEXT_OID, count, 1) + _NULL * count)
    if isinstance(value, str):
        data = value.encode()
        return PackedText(_HEAD.pack(1, 0, TEXT_OID, count, 1) + _item(data) * count)
    return PackedBytea(_HEAD.pack(1, 0, BYTEA_OID, count, 1) + _item(value) * count)


def _item(data: bytes) -> bytes:
    return _LENGTH.pack(len(data)) + data


def pack_list(column: Sequence[Any]) -> PackedText | PackedBytea | None:
    """`column` as one array: text[] when its values are str, bytea[] when bytes (NULLs
    among either); None when it is empty or holds anything else (psycopg's then)."""
    if not column:
        return None
    kind: type | None = None
    parts: list[bytes] = []
    nulls = 0
    for value in column:
        if value is None:
            parts.append(_NULL)
            nulls = 1
            continue
        if kind is None:
            kind = type(value)
            if kind is not str and kind is not bytes:
                return None
        elif type(value) is not kind:
            return None
        try:
            data = value.encode() if kind is str else value
        except UnicodeEncodeError:
            return None  # psycopg's error, then
        parts.append(_LENGTH.pack(len(data)))
        parts.append(data)  # joined once, not copied per element
    if kind is bytes:
        return PackedBytea(_HEAD.pack(1, nulls, BYTEA_OID, len(column), 1) + b"".join(parts))
    return PackedText(_HEAD.pack(1, nulls, TEXT_OID, len(column), 1) + b"".join(parts))


def pack_columns(columns: Sequence[list[Any] | None], *, keep: int) -> tuple[Any, ...]:
    """`columns` packed: one that repeats one str, bytes or NULL at once, any other of
    text or octets element by element (`pack_list`); the rest as they are. The column
    at index `keep` (the bodies: rarely equal, long to compare) is packed only while
    its octets are few (PACK_BODIES_MAX): psycopg's C copies large ones faster."""
    out: list[Any] = []
    for index, column in enumerate(columns):
        if not column:
            out.append(column)
            continue
        if index == keep:
            small = sum(len(b) for b in column if b is not None) <= PACK_BODIES_MAX
            packed = pack_list(column) if small else None
            out.append(column if packed is None else packed)
            continue
        first = column[0]
        if (first is None or type(first) is str or type(first) is bytes) and column.count(
            first
        ) == len(column):
            out.append(pack(first, len(column)))
            continue
        packed = pack_list(column)
        out.append(column if packed is None else packed)
    return tuple(out)


class _PackedDumper(Dumper):
    format = Format.BINARY

    def dump(self, obj: PackedText | PackedBytea) -> bytes:
        return obj  # packed already (a bytes subclass)


class PackedTextDumper(_PackedDumper):
    oid = TEXT_ARRAY_OID


class PackedByteaDumper(_PackedDumper):
    oid = BYTEA_ARRAY_OID


def register(context: AdaptContext) -> None:
    """Let `context` (a connection) send packed arrays."""
    context.adapters.register_dumper(PackedText, PackedTextDumper)
    context.adapters.register_dumper(PackedBytea, PackedByteaDumper)


__all__ = ["PackedBytea", "PackedText", "pack", "pack_columns", "pack_list", "register"]
