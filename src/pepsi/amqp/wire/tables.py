"""AMQP field structures walked and bounded before pamqp decodes any (pure).

pamqp is only ever given structures this module has already walked and bounded: its
decoder loops forever on a field array longer than its frame and on a content-header
flag word with the continuation bit set, recurses per nesting level, and copies the
rest of the payload for every table item (quadratic). `_Walker` checks every length
against its container and counts table items, without building any value: `methods`
runs it over method arguments, `properties` over content properties, `headers` over
the tables it edits. `decode_table` decodes a table (AMQPLAIN's response, one header).
"""

from __future__ import annotations

import struct
from typing import Any, Final

from pamqp import decode as pamqp_decode

from pepsi.amqp.wire.replies import FrameSyntaxError

# Bounds on field tables that pamqp will decode: it recurses per level (Python's
# recursion limit) and copies the rest of the payload per item (quadratic). Real clients
# send a few dozen items two or three levels deep; RabbitMQ itself has no such limits.
MAX_TABLE_DEPTH: Final = 32
MAX_TABLE_ITEMS: Final = 1024

_U32 = struct.Struct(">I")

_FIXED_FIELD_SIZES: Final = {"octet": 1, "short": 2, "long": 4, "longlong": 8, "timestamp": 8}
_FIXED_VALUE_SIZES: Final = {
    # The field-value types RabbitMQ accepts (the 0-9-1 errata's table, as RabbitMQ
    # reads it: 'l' and 'L' are both 64-bit signed).
    ord("t"): 1, ord("b"): 1, ord("B"): 1, ord("s"): 2, ord("u"): 2, ord("I"): 4,
    ord("i"): 4, ord("l"): 8, ord("L"): 8, ord("f"): 4, ord("d"): 8, ord("D"): 5,
    ord("T"): 8, ord("V"): 0,
}  # fmt: skip
_LENGTH_PREFIXED: Final = frozenset({ord("S"), ord("x")})
_TABLE, _ARRAY = ord("F"), ord("A")


class _Malformed(Exception):
    """Internal: the structure walk failed (mapped to the caller's error class)."""


class _Walker:
    """Walks AMQP field structures over a buffer, checking every length against its
    container and counting table items, without building any value."""

    __slots__ = ("buf", "items")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.items = 0

    def need(self, pos: int, size: int, end: int) -> int:
        if pos + size > end:
            raise _Malformed(f"field overruns its container at octet {pos}")
        return pos + size

    def shortstr(self, pos: int, end: int) -> int:
        self.need(pos, 1, end)
        return self.need(pos + 1, self.buf[pos], end)

    def longstr(self, pos: int, end: int) -> int:
        self.need(pos, 4, end)
        return self.need(pos + 4, _U32.unpack_from(self.buf, pos)[0], end)

    def field(self, kind: str, pos: int, end: int) -> int:
        if kind == "shortstr":
            return self.shortstr(pos, end)
        if kind == "longstr":
            return self.longstr(pos, end)
        if kind == "table":
            inner_end = self.longstr(pos, end)
            self.table(pos + 4, inner_end, 1)
            return inner_end
        size = _FIXED_FIELD_SIZES.get(kind)
        if size is None:  # pragma: no cover - pamqp's spec has no other argument types
            raise _Malformed(f"unknown field type {kind}")
        return self.need(pos, size, end)

    def fields(self, layout: tuple[int | str, ...], pos: int, end: int) -> int:
        """Walk a layout (fixed sizes as ints, variable kinds by name); the end position."""
        for item in layout:
            pos = self.need(pos, item, end) if isinstance(item, int) else self.field(item, pos, end)
        return pos

    # table, array and value run once per item of a table (a Celery task's properties
    # hold about twenty): `need`, `shortstr` and `longstr` are written out in them, the
    # same checks and the same errors (about 40 % of the walk's time).

    def table(self, pos: int, end: int, depth: int) -> None:
        buf = self.buf
        value = self.value
        while pos < end:  # the key, a shortstr, then its value
            key = pos + 1
            if key + buf[pos] > end:
                raise _Malformed(f"field overruns its container at octet {key}")
            pos = value(key + buf[pos], end, depth)

    def array(self, pos: int, end: int, depth: int) -> None:
        value = self.value
        while pos < end:
            pos = value(pos, end, depth)

    def value(self, pos: int, end: int, depth: int) -> int:
        self.items += 1
        if self.items > MAX_TABLE_ITEMS:
            raise _Malformed(f"more than {MAX_TABLE_ITEMS} field-table items in one frame")
        if pos >= end:
            raise _Malformed(f"field overruns its container at octet {pos}")
        tag = self.buf[pos]
        pos += 1
        size = _FIXED_VALUE_SIZES.get(tag)
        if size is not None:
            if pos + size > end:
                raise _Malformed(f"field overruns its container at octet {pos}")
            return pos + size
        if tag in _LENGTH_PREFIXED:
            if pos + 4 > end:
                raise _Malformed(f"field overruns its container at octet {pos}")
            after: int = pos + 4 + _U32.unpack_from(self.buf, pos)[0]
            if after > end:
                raise _Malformed(f"field overruns its container at octet {pos + 4}")
            return after
        if tag in (_TABLE, _ARRAY):
            if depth >= MAX_TABLE_DEPTH:
                raise _Malformed(f"field tables nested deeper than {MAX_TABLE_DEPTH}")
            inner_end = self.longstr(pos, end)
            if tag == _TABLE:
                self.table(pos + 4, inner_end, depth + 1)
            else:
                self.array(pos + 4, inner_end, depth + 1)
            return inner_end
        raise _Malformed(f"unknown field-value type {bytes([tag])!r}")


def decode_table(raw: bytes) -> dict[str, Any]:
    """A field table's items given without their length (AMQPLAIN's response), bounded
    by the walker before pamqp decodes them; FrameSyntaxError if malformed."""
    try:
        _Walker(raw).table(0, len(raw), 1)
        _, table = pamqp_decode.field_table(_U32.pack(len(raw)) + raw)
    except _Malformed as error:
        raise FrameSyntaxError(f"malformed field table: {error}") from None
    except Exception as error:  # noqa: BLE001  # pamqp's decoders on hostile values
        raise FrameSyntaxError(f"undecodable field table: {error}") from None
    return dict(table)
