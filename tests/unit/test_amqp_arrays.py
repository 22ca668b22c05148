"""Packed array arguments of a publish batch (pepsi.amqp.broker.publish.arrays), without a database."""

from __future__ import annotations

import struct
from datetime import UTC, datetime

from pepsi.amqp.broker.publish.arrays import PackedBytea, PackedText, pack, pack_columns, pack_list


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


def test_columns_of_text_or_octets_are_packed_and_others_left_to_psycopg() -> None:
    when = datetime(2031, 1, 1, tzinfo=UTC)
    columns = [
        ["s", "s", "s"],  # one stage: packed at once
        [None, None, None],  # no message ids: packed at once
        ["m-1", None, "mé"],  # varying text with a NULL: packed element by element
        [when, when, when],  # not text or bytes: psycopg's
        [b"h", b"h", b"h"],  # one property list: packed at once
        [b"b1", b"", None],  # the bodies: packed, never compared
        [True, False, True],  # flags: psycopg's
        ["x", b"y", None],  # text and octets mixed: psycopg's
    ]
    packed = pack_columns(columns, keep=5)
    assert packed[0] == pack("s", 3)
    assert packed[1] == pack(None, 3)
    assert packed[2] == PackedText(
        struct.pack(">iiIii", 1, 1, 25, 3, 1)
        + struct.pack(">i", 3) + b"m-1" + b"\xff\xff\xff\xff" + struct.pack(">i", 3) + "mé".encode()
    )  # fmt: skip
    assert packed[3] is columns[3]
    assert packed[4] == pack(b"h", 3)
    assert packed[5] == PackedBytea(
        struct.pack(">iiIii", 1, 1, 17, 3, 1)
        + struct.pack(">i", 2) + b"b1" + struct.pack(">i", 0) + b"\xff\xff\xff\xff"
    )  # fmt: skip
    assert packed[6] is columns[6]
    assert packed[7] is columns[7]
    assert pack_columns([[]], keep=-1) == ([],)  # an empty column stays as it is
    assert pack_columns([None], keep=-1) == (None,)  # NULL: nothing to send
    assert pack_list(["\ud800"]) is None  # not UTF-8: psycopg says so
