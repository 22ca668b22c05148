"""Broker-added headers in raw content properties (wire.headers, dead_letters): the field encoder,
in-place table edits checked with pamqp's decoder and byte for byte, and the x-death
bookkeeping of RabbitMQ 3.13."""

from __future__ import annotations

import decimal
import struct
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import commands
from pamqp import decode as pamqp_decode

from pepsi.amqp.wire import dead_letters, headers
from pepsi.amqp.wire.dead_letters import death_headers, deaths_from_header, record_death
from pepsi.amqp.wire.headers import (
    CONTENT_ENCODING_BIT,
    CONTENT_TYPE_BIT,
    DELIVERY_MODE_BIT,
    HEADERS_BIT,
    MESSAGE_ID_BIT,
    PRIORITY_BIT,
    TIMESTAMP_BIT,
    encode_entries,
    encode_value,
    header_entry,
    set_headers,
)
from pepsi.amqp.wire.properties import decode_properties

# --- building raw properties independently of the module --------------------------------

_KINDS: dict[int, str] = {
    15: "s", 14: "s", 13: "t", 12: "o", 11: "o", 10: "s", 9: "s", 8: "s", 7: "s",
    6: "q", 5: "s", 4: "s", 3: "s", 2: "s",
}  # fmt: skip
_NAMES: dict[int, str] = {
    15: "content_type", 14: "content_encoding", 12: "delivery_mode", 11: "priority",
    10: "correlation_id", 9: "reply_to", 8: "expiration", 7: "message_id", 6: "timestamp",
    5: "message_type", 4: "user_id", 3: "app_id", 2: "cluster_id",
}  # fmt: skip


def build_raw(props: dict[int, Any], table_items: bytes | None = None) -> bytes:
    """Property octets by hand: `props` maps flag bits to values, `table_items` is the
    headers table's content (None: no headers property)."""
    flags = 0
    parts: list[bytes] = []
    for bit in range(15, 1, -1):
        if bit == HEADERS_BIT:
            if table_items is None:
                continue
            parts.append(struct.pack(">I", len(table_items)) + table_items)
        elif bit in props:
            value = props[bit]
            kind = _KINDS[bit]
            if kind == "s":
                data = value.encode()
                parts.append(bytes([len(data)]) + data)
            elif kind == "o":
                parts.append(bytes([value]))
            else:
                parts.append(struct.pack(">Q", value))
        else:
            continue
        flags |= 1 << bit
    return struct.pack(">H", flags) + b"".join(parts)


def item(name: str, value_octets: bytes) -> bytes:
    data = name.encode()
    return bytes([len(data)]) + data + value_octets


def others(raw: bytes) -> dict[str, Any]:
    """Every property but headers, as pamqp decodes them."""
    decoded = decode_properties(raw)
    return {name: getattr(decoded, name) for name in _NAMES.values()}


def decoded_headers(raw: bytes) -> dict[str, Any] | None:
    return decode_properties(raw).headers


# --- encoding ---------------------------------------------------------------------------


def test_encode_value_uses_rabbitmq_types() -> None:
    assert encode_value(True) == b"t\x01"
    assert encode_value(False) == b"t\x00"
    assert encode_value(1) == b"l" + struct.pack(">q", 1)
    assert encode_value(-1) == b"l" + struct.pack(">q", -1)
    assert encode_value("é") == b"S\x00\x00\x00\x02\xc3\xa9"
    assert encode_value(b"\x00\xff") == b"x\x00\x00\x00\x02\x00\xff"
    assert encode_value(1.5) == b"d" + struct.pack(">d", 1.5)
    when = datetime(2024, 5, 1, 12, 0, 0, 900000, tzinfo=UTC)
    assert encode_value(when) == b"T" + struct.pack(">Q", int(when.timestamp()))
    assert encode_value(when.replace(tzinfo=None)) == encode_value(when)  # naive is UTC
    assert encode_value([1, "a"]) == b"A\x00\x00\x00\x0f" + encode_value(1) + encode_value("a")
    assert encode_value(()) == b"A\x00\x00\x00\x00"
    assert encode_value({"k": None}) == b"F\x00\x00\x00\x03\x01kV"
    assert encode_value(None) == b"V"


def test_encoded_table_decodes_with_pamqp() -> None:
    when = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
    table = {
        "b": True,
        "i": -(2**63),
        "s": "text",
        "x": b"\x01\x02",
        "d": 2.25,
        "t": when,
        "a": [1, "two", [False]],
        "f": {"nested": {"deep": 2**63 - 1}},
        "v": None,
    }
    data = encode_entries(table)
    _, decoded = pamqp_decode.field_table(struct.pack(">I", len(data)) + data)
    assert decoded == {**table, "x": bytearray(b"\x01\x02")}


def test_encode_limits() -> None:
    with pytest.raises(ValueError, match="field name"):
        encode_entries({"n" * 256: 1})
    assert encode_entries({"n" * 255: None}) == b"\xff" + b"n" * 255 + b"V"
    with pytest.raises(ValueError, match="field name"):
        encode_entries({"é" * 128: 1})  # 256 octets
    with pytest.raises(ValueError, match="64-bit"):
        encode_value(2**63)
    with pytest.raises(ValueError, match="64-bit"):
        encode_value(-(2**63) - 1)
    with pytest.raises(TypeError):
        encode_value(decimal.Decimal(1))
    with pytest.raises(TypeError):
        encode_entries({1: 2})  # type: ignore[dict-item]


# --- set_headers ------------------------------------------------------------------------


def test_insert_table_without_other_properties() -> None:
    raw = build_raw({})
    out = set_headers(raw, {"x-delivery-count": 1})
    assert out == b"\x20\x00" + struct.pack(">I", 26) + item("x-delivery-count", encode_value(1))
    assert decoded_headers(out) == {"x-delivery-count": 1}


def test_insert_table_after_content_type_and_encoding() -> None:
    props = {
        CONTENT_TYPE_BIT: "text/plain",
        CONTENT_ENCODING_BIT: "gzip",
        DELIVERY_MODE_BIT: 2,
        PRIORITY_BIT: 5,
        MESSAGE_ID_BIT: "m-1",
        TIMESTAMP_BIT: 1_700_000_000,
    }
    raw = build_raw(props)
    entries = {"x-delivery-count": 3}
    out = set_headers(raw, entries)
    assert out == build_raw(props, encode_entries(entries))
    assert others(out) == others(raw)
    assert decoded_headers(out) == entries


@pytest.mark.parametrize(
    "props",
    [
        {CONTENT_TYPE_BIT: "application/json"},
        {CONTENT_ENCODING_BIT: "utf-8"},
        {DELIVERY_MODE_BIT: 1},
        {CONTENT_TYPE_BIT: "a", DELIVERY_MODE_BIT: 2, PRIORITY_BIT: 0},
        {CONTENT_ENCODING_BIT: "b", TIMESTAMP_BIT: 7},
    ],
)
def test_insert_table_position(props: dict[int, Any]) -> None:
    raw = build_raw(props)
    out = set_headers(raw, {"h": "v"})
    assert out == build_raw(props, encode_entries({"h": "v"}))
    assert others(out) == others(raw)
    assert decoded_headers(out) == {"h": "v"}


def test_client_entries_keep_their_octets() -> None:
    # Types pamqp would re-encode differently (widths, 32-bit float, decimal).
    client = [
        item("small", b"b\xfb"),  # short-short int -5
        item("port", b"u\xff\xff"),  # unsigned short
        item("price", b"D\x02\x00\x00\x04\xd2"),  # decimal 12.34
        item("ratio", b"f" + struct.pack(">f", 0.5)),
        item("when", b"T" + struct.pack(">Q", 1_700_000_000)),
    ]
    props = {CONTENT_TYPE_BIT: "text/plain", DELIVERY_MODE_BIT: 2, MESSAGE_ID_BIT: "id"}
    raw = build_raw(props, b"".join(client))
    out = set_headers(raw, {"x-delivery-count": 1})
    added = item("x-delivery-count", encode_value(1))
    assert out == build_raw(props, b"".join(client) + added)
    for octets in client:
        assert octets in out
    assert decoded_headers(out) == {
        "small": -5,
        "port": 65535,
        "price": decimal.Decimal("12.34"),
        "ratio": 0.5,
        "when": datetime.fromtimestamp(1_700_000_000, tz=UTC),
        "x-delivery-count": 1,
    }
    assert others(out) == others(raw)


def test_replace_existing_entry_moves_it_last() -> None:
    raw = build_raw(
        {DELIVERY_MODE_BIT: 2},
        item("x-delivery-count", b"b\x01") + item("app", b"S\x00\x00\x00\x01a"),
    )
    out = set_headers(raw, {"x-delivery-count": 2})
    assert out == build_raw(
        {DELIVERY_MODE_BIT: 2},
        item("app", b"S\x00\x00\x00\x01a") + item("x-delivery-count", encode_value(2)),
    )
    assert list(decoded_headers(out) or {}) == ["app", "x-delivery-count"]
    assert header_entry(out, "x-delivery-count") == 2


def test_remove_names_and_duplicates() -> None:
    table = (
        item("keep", b"t\x01")
        + item("x-death", b"V")
        + item("gone", b"s\x00\x01")
        + item("x-death", b"b\x02")
    )
    raw = build_raw({CONTENT_TYPE_BIT: "t"}, table)
    out = set_headers(raw, {}, remove=["x-death", "gone", "absent"])
    assert out == build_raw({CONTENT_TYPE_BIT: "t"}, item("keep", b"t\x01"))
    emptied = set_headers(raw, {}, remove=["keep", "x-death", "gone"])
    assert emptied == build_raw({CONTENT_TYPE_BIT: "t"}, b"")  # the (empty) table stays
    assert decoded_headers(emptied) == {}
    # No table and nothing to add: an empty table is inserted (simplest correct).
    assert set_headers(build_raw({}), {}) == build_raw({}, b"")


def test_entries_keep_their_order_and_nested_values() -> None:
    raw = build_raw({}, item("a", b"V"))
    entries = {"z": [1, {"k": "v"}], "m": b"\x00", "a": False}
    out = set_headers(raw, entries)
    assert list(decoded_headers(out) or {}) == ["z", "m", "a"]
    assert decoded_headers(out) == {"z": [1, {"k": "v"}], "m": bytearray(b"\x00"), "a": False}


def test_low_flag_bits_and_other_octets_are_kept() -> None:
    raw = bytes([0x80, 0x03]) + b"\x01t"  # content_type + the two reserved low bits
    out = set_headers(raw, {"h": 1})
    assert out[:2] == bytes([0xA0, 0x03])
    assert out[2:4] == b"\x01t"


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\x80",
        b"\x80\x00",  # content_type announced, absent
        b"\x80\x00\x05ab",  # shortstr overruns
        b"\x00\x00\x00",  # trailing octet
        b"\x20\x00\x00\x00\x00\x05\x01a",  # table length overruns
        b"\x20\x00\x00\x00\x00\x03\x01aZ",  # unknown field type
        b"\x20\x00\x00\x00\x00\x03\x01ab",  # 'b' value truncated by the table length
        b"\x20\x00\x00\x00\x00\x02\x05a",  # name overruns
        b"\x10\x00",  # delivery_mode missing
    ],
)
def test_malformed_raw_is_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError, match="malformed"):
        set_headers(raw, {"x-delivery-count": 1})
    with pytest.raises(ValueError, match="malformed"):
        header_entry(raw, "x-delivery-count")


def test_header_entry() -> None:
    assert header_entry(build_raw({CONTENT_TYPE_BIT: "t"}), "x-death") is None
    raw = build_raw(
        {PRIORITY_BIT: 1},
        item("a", b"b\xff") + item("b", encode_value([{"count": 2}])) + item("a", b"b\x01"),
    )
    assert header_entry(raw, "a") == -1  # the first of duplicates, as RabbitMQ
    assert header_entry(raw, "b") == [{"count": 2}]
    assert header_entry(raw, "c") is None
    bad_string = build_raw({}, item("s", b"S\x00\x00\x00\x01\xff"))
    assert header_entry(bad_string, "s") == b"\xff"  # pamqp: not UTF-8 stays bytes


# --- x-death ----------------------------------------------------------------------------


def test_record_death_new_entries_go_first() -> None:
    deaths = record_death(
        [], queue="q1", reason="rejected", exchange="ex", routing_keys=["rk"], now=100.5
    )
    assert deaths == [
        {
            "queue": "q1",
            "reason": "rejected",
            "count": 1,
            "time": 100.5,
            "exchange": "ex",
            "routing-keys": ["rk"],
        }
    ]
    after = record_death(
        deaths, queue="q1", reason="expired", exchange="dlx", routing_keys=["a", "b"],
        now=200.0, original_expiration="5000",
    )  # fmt: skip
    assert [(d["queue"], d["reason"], d["count"]) for d in after] == [
        ("q1", "expired", 1),
        ("q1", "rejected", 1),
    ]
    assert after[0]["original-expiration"] == "5000"
    assert after[1] == deaths[0]


def test_record_death_same_queue_and_reason_counts_and_moves_first() -> None:
    deaths: list[dict[str, Any]] = []
    deaths = record_death(deaths, queue="q1", reason="rejected", exchange="e1",
                          routing_keys=["k1"], now=10.0)  # fmt: skip
    deaths = record_death(deaths, queue="q2", reason="expired", exchange="dlx",
                          routing_keys=["k2"], now=20.0, original_expiration="1")  # fmt: skip
    snapshot = [dict(d) for d in deaths]
    again = record_death(deaths, queue="q1", reason="rejected", exchange="dlx",
                         routing_keys=["k3"], now=30.0)  # fmt: skip
    assert deaths == snapshot  # the input is not changed
    assert [(d["queue"], d["reason"], d["count"]) for d in again] == [
        ("q1", "rejected", 2),
        ("q2", "expired", 1),
    ]
    # RabbitMQ 3.13 keeps the entry's first time, exchange and routing keys.
    first = again[0]
    assert (first["time"], first["exchange"], first["routing-keys"]) == (10.0, "e1", ["k1"])
    assert (first["last-exchange"], first["last-time"]) == ("dlx", 30.0)
    third = record_death(again, queue="q1", reason="rejected", exchange="dlx",
                         routing_keys=[], now=40.0)  # fmt: skip
    assert third[0]["count"] == 3
    assert third[1] == again[1]


def test_record_death_refuses_unknown_reason() -> None:
    with pytest.raises(ValueError, match="reason"):
        record_death([], queue="q", reason="nope", exchange="", routing_keys=[], now=0.0)


def test_death_headers_shape_and_types() -> None:
    deaths = record_death([], queue="q1", reason="rejected", exchange="e1",
                          routing_keys=["k1", "cc"], now=1_700_000_000.75)  # fmt: skip
    first = deaths[0]
    deaths = record_death(deaths, queue="q2", reason="expired", exchange="dlx",
                          routing_keys=["k2"], now=1_700_000_100.0,
                          original_expiration="60000")  # fmt: skip
    deaths = record_death(deaths, queue="q1", reason="rejected", exchange="dlx2",
                          routing_keys=["k9"], now=1_700_000_200.0)  # fmt: skip
    entries = death_headers(deaths, first)
    assert list(entries) == [
        "x-death",
        "x-first-death-reason",
        "x-first-death-queue",
        "x-first-death-exchange",
        "x-last-death-reason",
        "x-last-death-queue",
        "x-last-death-exchange",
    ]
    raw = set_headers(build_raw({CONTENT_TYPE_BIT: "text/plain"}), entries)
    got = decoded_headers(raw)
    assert got == {
        "x-death": [
            {
                "count": 2,
                "reason": "rejected",
                "queue": "q1",
                "time": datetime.fromtimestamp(1_700_000_000, tz=UTC),
                "exchange": "e1",
                "routing-keys": ["k1", "cc"],
            },
            {
                "count": 1,
                "reason": "expired",
                "queue": "q2",
                "time": datetime.fromtimestamp(1_700_000_100, tz=UTC),
                "exchange": "dlx",
                "routing-keys": ["k2"],
                "original-expiration": "60000",
            },
        ],
        "x-first-death-reason": "rejected",
        "x-first-death-queue": "q1",
        "x-first-death-exchange": "e1",
        "x-last-death-reason": "rejected",
        "x-last-death-queue": "q1",
        "x-last-death-exchange": "dlx2",
    }
    # Wire types: count a signed 64-bit 'l', time a 'T', strings 'S', keys an 'A'.
    assert b"\x05countl" + struct.pack(">q", 2) in raw
    assert b"\x04timeT" + struct.pack(">Q", 1_700_000_000) in raw
    assert b"\x06reasonS\x00\x00\x00\x08rejected" in raw
    assert b"\x0crouting-keysA" in raw
    assert b"\x14x-first-death-reasonS" in raw


def test_death_headers_without_history() -> None:
    assert death_headers([], None) == {}
    one = record_death([], queue="q", reason="maxlen", exchange="", routing_keys=[], now=0.0)
    assert "x-first-death-queue" not in death_headers(one, None)
    assert death_headers(one, None)["x-last-death-reason"] == "maxlen"


def test_deaths_from_header_round_trip() -> None:
    deaths = record_death([], queue="q1", reason="delivery_limit", exchange="e",
                          routing_keys=["a"], now=1000.9, original_expiration="5")  # fmt: skip
    deaths = record_death(deaths, queue="q2", reason="rejected", exchange="d",
                          routing_keys=[], now=2000.0)  # fmt: skip
    raw = set_headers(build_raw({}), death_headers(deaths, deaths[-1]))
    recovered = deaths_from_header(header_entry(raw, "x-death"))
    assert recovered == [
        {**deaths[0], "time": 2000.0},
        {**deaths[1], "time": 1000.0},  # whole seconds on the wire
    ]
    # A republished dead letter goes on counting from the client's history.
    again = record_death(recovered, queue="q1", reason="delivery_limit", exchange="x",
                         routing_keys=[], now=3000.0)  # fmt: skip
    assert again[0]["count"] == 2


def test_deaths_from_header_is_tolerant() -> None:
    when = datetime(2024, 1, 1, tzinfo=UTC)
    good = {"queue": "q", "reason": "rejected", "count": 3, "time": when}
    value = [
        "not a table",
        {"reason": "rejected", "count": 1, "time": when},  # no queue
        {**good, "count": True},
        {**good, "count": 0},
        {**good, "time": "yesterday"},
        {**good, "queue": b"\xff"},  # not UTF-8
        {**good, "exchange": b"ex", "routing-keys": ["a", 1, b"b"], "original-expiration": 7},
        {**good, "count": 9},  # a repeated (queue, reason): the first one counts
        {"queue": "q", "reason": "expired", "count": 1, "time": 5},
    ]
    assert deaths_from_header(value) == [
        {
            "queue": "q",
            "reason": "rejected",
            "count": 3,
            "time": when.timestamp(),
            "exchange": "ex",
            "routing-keys": ["a", "b"],
        },
        {
            "queue": "q",
            "reason": "expired",
            "count": 1,
            "time": 5.0,
            "exchange": "",
            "routing-keys": [],
        },
    ]
    assert deaths_from_header(None) == []
    assert deaths_from_header({"queue": "q"}) == []
    assert deaths_from_header("x-death") == []


# --- property test ----------------------------------------------------------------------

_names = st.text(min_size=0, max_size=12)
_values = st.one_of(
    st.text(max_size=20),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.booleans(),
)
_tables = st.dictionaries(_names, _values, max_size=6)
_shortstrs = st.text(alphabet=st.characters(codec="ascii"), max_size=20)
_other_props = st.fixed_dictionaries(
    {},
    optional={
        15: _shortstrs, 14: _shortstrs, 12: st.integers(0, 255), 11: st.integers(0, 255),
        10: _shortstrs, 9: _shortstrs, 8: _shortstrs, 7: _shortstrs,
        6: st.integers(0, 0xFFFFFFFF), 5: _shortstrs, 4: _shortstrs, 3: _shortstrs,
        2: _shortstrs,
    },
)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(props=_other_props, old=st.none() | _tables, data=st.data())
def test_set_headers_property(
    props: dict[int, Any], old: dict[str, Any] | None, data: st.DataObject
) -> None:
    known = sorted(old or {})
    key_choice = st.sampled_from(known) | _names if known else _names
    entries = data.draw(st.dictionaries(key_choice, _values, max_size=4), label="entries")
    remove = data.draw(st.lists(key_choice, max_size=3), label="remove")
    raw = build_raw(props, None if old is None else encode_entries(old))

    out = set_headers(raw, entries, remove)

    expected = {k: v for k, v in (old or {}).items() if k not in entries and k not in remove}
    expected.update(entries)
    got = decoded_headers(out)
    assert got == expected
    assert list(got or {}) == list(expected)  # kept entries in place, then the new ones
    assert others(out) == others(raw)
    for name in entries:
        assert header_entry(out, name) == entries[name]


def test_module_constants() -> None:
    assert HEADERS_BIT == 13
    assert commands.Basic.Properties.flags["headers"] == 1 << HEADERS_BIT
    assert commands.Basic.Properties.flags["content_type"] == 1 << CONTENT_TYPE_BIT
    assert commands.Basic.Properties.flags["cluster_id"] == 1 << headers.CLUSTER_ID_BIT
    assert {"rejected", "expired", "maxlen", "delivery_limit"} == dead_letters.DEATH_REASONS


@settings(max_examples=150, deadline=None)
@given(props=_other_props, old=st.none() | _tables)
def test_without_expiration_drops_that_property_only(
    props: dict[int, Any], old: dict[str, Any] | None
) -> None:
    raw = build_raw(props, None if old is None else encode_entries(old))
    assert headers.expiration(raw) == props.get(8)
    dropped = headers.without_expiration(raw)
    assert headers.expiration(dropped) is None
    before, after = decode_properties(raw), decode_properties(dropped)
    assert after.expiration is None
    for name in _NAMES.values():
        if name != "expiration":
            assert getattr(after, name) == getattr(before, name), name
    assert after.headers == before.headers
    if 8 not in props:
        assert dropped == raw  # nothing to drop: the same octets
