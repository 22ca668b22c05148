"""RabbitMQ's permission check, SASL PLAIN/AMQPLAIN parsing, loopback-only users."""

from __future__ import annotations

import contextlib
import ipaddress
import struct
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pepsi.amqp.auth import passwords
from pepsi.amqp.auth.permissions import (
    Access,
    Credentials,
    Permission,
    SaslError,
    allowed,
    can_open_vhost,
    exchange_resource,
    is_loopback,
    login_allowed_from,
    login_refusal,
    parse_amqplain,
    parse_plain,
    parse_response,
    pattern_problem,
)
from pepsi.errors import PepsiError

# -- permissions ---------------------------------------------------------------------------


def test_patterns_are_searched_not_anchored() -> None:
    perm = Permission(configure="^app-", write="orders", read=".*")
    assert allowed(perm, Access.CONFIGURE, "app-orders")
    assert not allowed(perm, Access.CONFIGURE, "my-app-orders")
    # RabbitMQ finds the pattern anywhere in the name: anchor it to mean exactly.
    assert allowed(perm, Access.WRITE, "orders")
    assert allowed(perm, Access.WRITE, "old-orders-2")
    assert not allowed(perm, Access.WRITE, "invoices")
    assert allowed(perm, Access.READ, "anything")
    exact = Permission("^orders$", "^orders$", "^orders$")
    assert allowed(exact, Access.READ, "orders")
    assert not allowed(exact, Access.READ, "orders2")


def test_empty_pattern_allows_nothing() -> None:
    perm = Permission("", "", "")
    for access in Access:
        assert not allowed(perm, access, "q")
        assert not allowed(perm, access, "amq.default")
        assert allowed(perm, access, "")  # RabbitMQ's '^$': no resource is named ''


def test_no_permission_row_allows_nothing() -> None:
    assert not can_open_vhost(None)
    assert can_open_vhost(Permission("", "", ""))
    for access in Access:
        assert not allowed(None, access, "q")


def test_default_exchange_is_checked_as_amq_default() -> None:
    assert exchange_resource("") == "amq.default"
    assert exchange_resource("logs") == "logs"
    perm = Permission(configure="", write="^amq\\.default$", read="")
    assert allowed(perm, Access.WRITE, exchange_resource(""))
    assert not allowed(perm, Access.WRITE, exchange_resource("logs"))


def test_invalid_pattern_is_reported_and_grants_nothing() -> None:
    assert pattern_problem(".*") is None
    assert pattern_problem("") is None
    problem = pattern_problem("(unclosed")
    assert problem is not None
    assert "invalid regular expression" in problem
    assert not allowed(Permission("(unclosed", "[", "*"), Access.CONFIGURE, "(unclosed")
    assert not allowed(Permission("(unclosed", "[", "*"), Access.READ, "x")


def test_permission_pattern_per_access() -> None:
    perm = Permission("c", "w", "r")
    assert [perm.pattern(a) for a in Access] == ["c", "w", "r"]


# -- SASL PLAIN -----------------------------------------------------------------------------


def test_plain() -> None:
    creds = parse_plain(b"\0guest\0guest")
    assert creds == Credentials("guest", b"guest")
    assert "hunter2" not in repr(Credentials("alice", b"hunter2"))  # kept out of logs
    assert parse_plain("\0alice\0pässword") == Credentials("alice", "pässword".encode())
    assert parse_plain(b"admin\0alice\0pw").username == "alice"  # the authzid is ignored
    assert parse_plain(b"\0alice\0").password == b""  # an empty password reaches verify
    assert parse_plain(b"\0alice\0\xff\xfe").password == b"\xff\xfe"


@pytest.mark.parametrize(
    "response",
    [b"", b"guest", b"\0guest", b"\0guest\0pw\0extra", b"\0\0pw", b"\0\xff\0pw", "\0only"],
)
def test_malformed_plain_is_a_clean_error(response: bytes | str) -> None:
    with pytest.raises(SaslError) as info:
        parse_plain(response)
    assert isinstance(info.value, PepsiError)
    assert "pw" not in str(info.value)


# -- SASL AMQPLAIN -------------------------------------------------------------------------


def _short(text: str) -> bytes:
    raw = text.encode()
    return bytes([len(raw)]) + raw


def _long(kind: bytes, raw: bytes) -> bytes:
    return kind + struct.pack(">I", len(raw)) + raw


def _login_table(user: bytes = b"guest", password: bytes = b"guest") -> bytes:
    """A table's contents, without its length, as py-amqp and kombu send AMQPLAIN."""
    return _short("LOGIN") + _long(b"S", user) + _short("PASSWORD") + _long(b"S", password)


def test_amqplain() -> None:
    assert parse_amqplain(_login_table()) == Credentials("guest", b"guest")
    # pamqp hands the long string over as str when it is UTF-8.
    assert parse_amqplain(_login_table().decode()) == Credentials("guest", b"guest")
    with_length = struct.pack(">I", len(_login_table())) + _login_table()
    assert parse_amqplain(with_length) == Credentials("guest", b"guest")
    binary = _short("LOGIN") + _long(b"x", b"bob") + _short("PASSWORD") + _long(b"x", b"\xff")
    assert parse_amqplain(binary) == Credentials("bob", b"\xff")


def test_amqplain_skips_other_fields_of_every_type() -> None:
    others = (
        _short("t") + b"t\x01"
        + _short("b") + b"b\xff"
        + _short("B") + b"B\x01"
        + _short("s") + b"s\x00\x01"
        + _short("u") + b"u\x00\x01"
        + _short("I") + b"I" + struct.pack(">i", -1)
        + _short("i") + b"i" + struct.pack(">I", 1)
        + _short("l") + b"l" + struct.pack(">q", -1)
        + _short("f") + b"f" + struct.pack(">f", 1.5)
        + _short("d") + b"d" + struct.pack(">d", 1.5)
        + _short("D") + b"D\x02" + struct.pack(">i", 314)
        + _short("T") + b"T" + struct.pack(">Q", 0)
        + _short("V") + b"V"
        + _short("F") + _long(b"F", _short("k") + _long(b"S", b"v"))
        + _short("A") + _long(b"A", b"t\x00" + _long(b"S", b"a"))
    )  # fmt: skip
    assert parse_amqplain(others + _login_table(b"carol", b"pw")) == Credentials("carol", b"pw")


def test_amqplain_as_pika_encodes_a_table() -> None:
    data = pytest.importorskip("pika.data")
    pieces: list[bytes] = []
    data.encode_table(
        pieces,
        {
            "LOGIN": "dave",
            "PASSWORD": "pw",
            "n": 7,
            "big": 2**40,
            "ok": True,
            "d": Decimal("1.5"),
            "nested": {"a": [1, "x", None]},
        },
    )
    encoded = b"".join(pieces)
    assert parse_amqplain(encoded[4:]) == Credentials("dave", b"pw")
    assert parse_amqplain(encoded) == Credentials("dave", b"pw")


@pytest.mark.parametrize(
    "response",
    [
        b"",  # no LOGIN
        _short("LOGIN") + _long(b"S", b"guest"),  # no PASSWORD
        _short("LOGIN") + b"I" + struct.pack(">i", 5) + _short("PASSWORD") + _long(b"S", b"p"),
        _login_table()[:-1],  # truncated
        _short("LOGIN") + b"S\xff\xff\xff\xff",  # length beyond the data
        _short("LOGIN") + b"Z",  # unknown field type
        _short("LOGIN") + b"F\x00\x00\x00\x05",  # nested table overruns the data
        _short("X") + _long(b"A", b"tq"),  # array overrunning its own length
        _login_table(user=b""),  # empty user name
        _login_table(user=b"\xff"),  # user name not UTF-8
        b"\x05LOG",  # a key cut short
        b"\x02\xff\xfeV",  # a key not UTF-8
    ],
)
def test_malformed_amqplain_is_a_clean_error(response: bytes) -> None:
    with pytest.raises(SaslError):
        parse_amqplain(response)


def test_deep_nesting_is_refused() -> None:
    inner = _short("k") + b"V"
    for _ in range(50):
        inner = _short("k") + _long(b"F", inner)
    with pytest.raises(SaslError, match="deep"):
        parse_amqplain(inner)
    array = b"V"
    for _ in range(50):
        array = _long(b"A", array)
    with pytest.raises(SaslError, match="deep"):
        parse_amqplain(_short("k") + array)


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_any_bytes_give_credentials_or_sasl_error(response: bytes) -> None:
    for parse in (parse_amqplain, parse_plain):
        try:
            creds = parse(response)
        except SaslError:
            continue
        assert creds.username


@settings(max_examples=200)
@given(st.binary(min_size=1, max_size=100))
def test_corrupted_login_table_never_raises_anything_else(noise: bytes) -> None:
    table = bytearray(_login_table())
    for i, byte in enumerate(noise):
        table[(i * 7) % len(table)] ^= byte
    with contextlib.suppress(SaslError):
        parse_amqplain(bytes(table))


def test_parse_response_by_mechanism() -> None:
    assert parse_response("PLAIN", b"\0u\0p") == Credentials("u", b"p")
    assert parse_response("AMQPLAIN", _login_table(b"u", b"p")) == Credentials("u", b"p")
    with pytest.raises(SaslError, match="unsupported mechanism 'EXTERNAL'"):
        parse_response("EXTERNAL", b"")


# -- loopback-only users and the login decision -------------------------------------------


@pytest.mark.parametrize(
    ("peer", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),  # IPv4 on a dual-stack socket
        (ipaddress.ip_address("127.0.0.2"), True),
        ("::1%lo", True),
        ("10.0.0.1", False),
        ("128.0.0.1", False),
        ("::2", False),
        ("::ffff:10.0.0.1", False),
        ("0.0.0.0", False),
        ("localhost", False),  # a name is not an address
        ("", False),
        (None, False),
    ],
)
def test_loopback(peer: str | ipaddress.IPv4Address | None, loopback: bool) -> None:
    assert is_loopback(peer) is loopback
    assert login_allowed_from("guest", peer) is loopback
    assert login_allowed_from("alice", peer)


def test_loopback_users_can_be_chosen() -> None:
    assert login_allowed_from("guest", "10.0.0.1", loopback_users=frozenset())
    assert not login_allowed_from("ops", "10.0.0.1", loopback_users=frozenset({"ops"}))


def test_login_refusal() -> None:
    stored = passwords.hash_password("pw", log2_n=4)
    guest = passwords.hash_password("guest", log2_n=4)
    assert login_refusal(Credentials("alice", b"pw"), stored, "10.0.0.1") is None
    refusal = login_refusal(Credentials("alice", b"bad"), stored, "10.0.0.1")
    assert refusal is not None
    assert "invalid credentials" in refusal
    assert "bad" not in refusal
    refusal = login_refusal(Credentials("nobody", b"pw"), None, "127.0.0.1")
    assert refusal is not None
    assert "no such user" in refusal
    assert login_refusal(Credentials("guest", b"guest"), guest, "127.0.0.1") is None
    refusal = login_refusal(Credentials("guest", b"guest"), guest, "192.0.2.7")
    assert refusal is not None
    assert "localhost" in refusal
