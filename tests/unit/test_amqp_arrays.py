"""Packed array arguments of a publish batch (pepsi.amqp.broker.publish.arrays), without a database."""

from __future__ import annotations

import struct
from datetime import UTC, datetime

from pepsi.amqp.broker.publish.arrays import PackedBytea, PackedText, pack, pack_columns


def test_pack_is_postgresqls_binary_array_format() -> None:
    head = struct.pack(">iiIii", 1, 0, 25, 3, 1)
    assert pack("ab", 3) == head + (struct.pack(">i", 2) + b"ab") * 3
    assert isinstance(pack("ab", 3), PackedText)
    assert (
        pack(b"\x00\xff", 2)
        == struct.pack(">iiIii", 1, 0, 17, 2, 1) + (struct.pack(">i", 2) + b"\x00\xff") * 2
    )
    assert isinstance(pack(b"x", 1), PackedBytea)
    assert pack(None, 2) == struct.pack(">iiIii", 1, 1, 25, 2, 1) + b"\xff\xff\xff\xff" * 2
    assert pack("é", 1).endswith(struct.pack(">i", 2) + "é".encode())  # octets, not characters


def test_only_columns_of_one_repeated_value_are_packed() -> None:
    when = datetime(2031, 1, 1, tzinfo=UTC)
    columns = [
        ["s", "s", "s"],  # one stage: packed
        [None, None, None],  # no message ids: packed
        ["m-1", None, "m-3"],  # varying: psycopg's
        [when, when, when],  # not text or bytes: psycopg's
        [b"h", b"h", b"h"],  # one property list: packed
        [b"b", b"b", b"b"],  # the bodies: never packed
    ]
    packed = pack_columns(columns, keep=5)
    assert packed[0] == pack("s", 3)
    assert packed[1] == pack(None, 3)
    assert packed[2] is columns[2]
    assert packed[3] is columns[3]
    assert packed[4] == pack(b"h", 3)
    assert packed[5] is columns[5]
    assert pack_columns([[]], keep=-1) == ([],)  # an empty column stays as it is
