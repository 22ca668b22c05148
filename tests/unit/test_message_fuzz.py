"""Any field values give a valid row or InvalidMessage, never another exception.

A row that `validate` returns must be one PostgreSQL accepts: its text holds
no NUL and no lone surrogate, its JSON is jsonb-valid, its expiry a datetime.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pepsi.publishing import InvalidMessage, OutgoingMessage
from pepsi.publishing.message import MAX_TEXT, Row, encode_json, validate

NOW = datetime(2030, 1, 1, tzinfo=UTC)

# Text PostgreSQL would refuse is what a fuzzer must try: NUL, lone surrogates.
nasty_text = st.text(
    alphabet=st.one_of(
        st.characters(codec=None),
        st.sampled_from(["\x00", "\ud800", "\udcff", "@", "<", " ", '"', "\\", "{", ","]),
    ),
    max_size=30,
)
anything = st.one_of(
    st.none(),
    nasty_text,
    st.binary(max_size=20),
    st.integers(),
    st.floats(),
    st.booleans(),
    st.lists(nasty_text, max_size=3),
    st.dictionaries(nasty_text, nasty_text, max_size=2),
    st.just(object()),
)
address = st.builds(lambda a, b: f"{a}@{b}", nasty_text, nasty_text)
json_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.floats(), st.integers(), nasty_text),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(nasty_text, inner, max_size=3)
    ),
    max_leaves=8,
)
expiry = st.one_of(
    st.none(),
    st.floats(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.datetimes(timezones=st.just(UTC)),
    st.datetimes(),  # naive
    st.datetimes(timezones=st.sampled_from([timezone(timedelta(hours=14)), UTC])),
    st.just(10**400),
    st.just(float("inf")),
    st.just(float("nan")),
    st.booleans(),
)
fields = st.fixed_dictionaries(
    {},
    optional={
        "body": st.one_of(st.binary(max_size=50), nasty_text, anything),
        "header": st.one_of(st.binary(max_size=50), nasty_text, anything),
        "sender": st.one_of(address, anything),
        "recipients": st.one_of(st.lists(st.one_of(address, anything), max_size=3), anything),
        "origin_user": anything,
        "origin_peer": st.one_of(st.ip_addresses().map(str), anything),
        "message_id": anything,
        "dedup": anything,
        "header_from": anything,
        "subject": anything,
        "content_type": anything,
        "correlation_id": anything,
        "properties": st.one_of(st.dictionaries(nasty_text, json_value, max_size=3), anything),
        "expires": expiry,
    },
)

# Mostly acceptable values, so that accepted rows carry every field (the
# integration test stores them): any UTF-8 text but NUL, with quotes,
# backslashes, braces and commas that the array literal must escape.
plain_text = st.text(
    alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=20
)
address_part = st.text(
    alphabet=st.characters(
        codec="utf-8", exclude_categories=("Cc", "Zs", "Zl", "Zp"), exclude_characters="@<> \x00"
    ),
    min_size=1,
    max_size=12,
)
plausible_address = st.builds(lambda a, b: f"{a}@{b}", address_part, address_part)
plain_json = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.integers(),
        plain_text,
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(plain_text, inner, max_size=3)
    ),
    max_leaves=8,
)
plausible_fields = st.fixed_dictionaries(
    {},
    optional={
        "body": st.one_of(st.binary(max_size=50), plain_text),
        "header": st.one_of(st.binary(max_size=50), plain_text),
        "sender": st.one_of(plausible_address, st.just("")),
        "recipients": st.lists(plausible_address, max_size=3),
        "origin_user": plain_text,
        "origin_peer": st.ip_addresses().map(str),
        "message_id": plain_text,
        "dedup": st.booleans(),
        "header_from": plain_text,
        "subject": st.one_of(plain_text, st.just("")),
        "content_type": plain_text,
        "correlation_id": plain_text,
        "properties": st.dictionaries(plain_text, plain_json, max_size=3),
        "expires": st.one_of(
            st.floats(min_value=0.001, max_value=1e9),
            st.datetimes(timezones=st.just(UTC)),
        ),
    },
)
any_fields = st.one_of(fields, plausible_fields)

_UNESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def _no_constant(token: str) -> object:
    raise AssertionError(f"jsonb refuses {token}")


def _postgres_would_take(row: Row) -> None:
    for name, value in zip(Row._fields, row, strict=True):
        if isinstance(value, str):
            assert "\x00" not in value, name
            value.encode("utf-8")  # no lone surrogate
            assert len(value) <= MAX_TEXT or name in {"recipients", "properties"}, name
    if row.properties is not None:
        assert isinstance(json.loads(row.properties, parse_constant=_no_constant), dict)
        assert not _UNESCAPED_NUL.search(row.properties)
    assert row.expires is None or (
        isinstance(row.expires, datetime) and row.expires.utcoffset() == timedelta(0)
    )
    assert isinstance(row.dedup, bool)
    assert row.header is None or isinstance(row.header, bytes)
    assert row.body is None or isinstance(row.body, bytes)


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(any_fields)
def test_any_fields_give_a_row_or_invalid_message(given_fields: dict[str, Any]) -> None:
    try:
        msg = OutgoingMessage("inbound", **given_fields)
        row = validate(msg, max_size=4096, now=NOW)
    except InvalidMessage as exc:
        problem = str(exc)
    else:
        _postgres_would_take(row)
        return
    assert problem
    assert "\n" not in problem  # one line on stderr


@settings(max_examples=300)
@given(json_value)
def test_json_payload_encodes_or_refuses(value: object) -> None:
    try:
        body = encode_json(value)
    except InvalidMessage:
        return
    assert json.loads(body) == value  # NaN and Infinity were refused


def test_the_reported_defects() -> None:
    cases: list[dict[str, Any]] = [
        {"sender": "a\udcff@x.org"},  # undecodable argv bytes (surrogateescape)
        {"recipients": ["b\udcff@x.org"]},
        {"subject": "\udcff"},
        {"expires": 99999999999999999999999 * 3600},  # --expires 99999999999999999999999h
        {"expires": float("inf")},
        {"expires": float("nan")},
        {"expires": datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=5)))},
        {"properties": {"k": "\x00"}},
        {"properties": {"k": "\ud800"}},
        {"properties": {"k": float("nan")}},
        {"recipients": 5},
        {"dedup": "yes", "message_id": "m"},
    ]
    for case in cases:
        try:
            validate(OutgoingMessage("inbound", **case), max_size=100, now=NOW)
        except InvalidMessage:
            continue
        raise AssertionError(f"accepted {case!r}")


def test_an_escaped_backslash_before_u0000_is_not_a_nul() -> None:
    row = validate(OutgoingMessage("s", properties={"k": "\\u0000"}), max_size=10, now=NOW)
    assert row.properties is not None
    assert json.loads(row.properties) == {"k": "\\u0000"}
