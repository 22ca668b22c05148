"""Content-header properties: the raw octets checked, decoded by pamqp, encoded (pure).

A content header is kept as its raw property octets (`frames.RawContentHeader`)
because pamqp's table re-encoding is lossy (it sorts keys, picks its own integer
widths, turns doubles into 32-bit floats, drops milliseconds from timestamps, fails on
-128..-1) while a broker must forward properties byte for byte. The reader checks
their structure as they arrive (`_check_properties`: a fast pass without tables, else
the walker); they are decoded only when something needs a value.
"""

from __future__ import annotations

import struct
from typing import Final

from pamqp import commands

from pepsi.amqp.wire.protocol import BASIC_CLASS_ID
from pepsi.amqp.wire.replies import FrameSyntaxError
from pepsi.amqp.wire.tables import _FIXED_FIELD_SIZES, _Malformed, _Walker

_U16 = struct.Struct(">H")

_PROPERTY_SLOTS: Final = tuple(
    (
        commands.Basic.Properties.flags[name],
        _FIXED_FIELD_SIZES.get(kind, kind),
    )
    for name in commands.Basic.Properties.__slots__
    for kind in (commands.Basic.Properties.amqp_type(name),)
)
# The two low bits of the flag word are not properties: bit 0 announces a further flag
# word (class 60 has only 14 properties). RabbitMQ ignores both; so do we, which also
# keeps them away from pamqp (which loops forever on the continuation bit).
_PROPERTY_FLAG_MASK: Final = 0xFFFC


def _properties_fast_ok(raw: bytes) -> bool:
    """True when property octets without tables are well formed (the common case, checked
    without the walker); False means "not sure": the walker decides and names the error."""
    end = len(raw)
    if end < 2:
        return False
    flags = (raw[0] << 8) | raw[1]
    pos = 2
    for flag, item in _PROPERTY_SLOTS:
        if not flags & flag:
            continue
        if item == "shortstr":
            if pos >= end:
                return False
            pos += 1 + raw[pos]
        elif isinstance(item, int):
            pos += item
        else:  # a table: leave it to the walker (depth and item bounds)
            return False
        if pos > end:
            return False
    return pos == end


def _check_properties(raw: bytes) -> None:
    if _properties_fast_ok(raw):
        return
    walker = _Walker(raw)
    end = len(raw)
    pos = walker.need(0, 2, end)
    flags = _U16.unpack_from(raw, 0)[0]
    if flags & _PROPERTY_FLAG_MASK:
        layout = tuple(item for flag, item in _PROPERTY_SLOTS if flags & flag)
        pos = walker.fields(layout, pos, end)
    if pos != end:
        raise _Malformed(f"{end - pos} octets after the last property")


def decode_properties(raw_properties: bytes, *, channel: int = 0) -> commands.Basic.Properties:
    """Decode raw content-header property octets with pamqp (FrameSyntaxError if bad)."""
    where = {"channel": channel, "class_id": BASIC_CLASS_ID}
    try:
        _check_properties(raw_properties)
        flags = _U16.unpack_from(raw_properties, 0)[0] & _PROPERTY_FLAG_MASK
        properties = commands.Basic.Properties()
        properties.unmarshal(flags, raw_properties[2:])
    except _Malformed as error:
        raise FrameSyntaxError(f"malformed content properties: {error}", **where) from None
    # pamqp raises whatever its decoders hit on hostile values (UnicodeDecodeError in a
    # shortstr, OverflowError on a timestamp...): all of it is the peer's syntax error.
    except Exception as error:  # noqa: BLE001
        raise FrameSyntaxError(f"undecodable content properties: {error}", **where) from None
    return properties


def encode_properties(properties: commands.Basic.Properties) -> bytes:
    """Raw property octets for properties the server builds itself (pamqp's encoder)."""
    return properties.marshal()
