"""DKIM signing (pepsi.mail.protocol.dkim) and SRS (pepsi.mail.protocol.srs): pure, no network."""

from __future__ import annotations

import base64
import random
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import dkim
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from pepsi.mail.protocol import canonical, srs
from pepsi.mail.protocol import dkim as signing

MESSAGE = (
    b"From: Alice <alice@example.com>\r\nTo: bob@example.org\r\nSubject: hi there\r\n"
    b"Date: Sat, 05 Dec 2026 12:00:00 +0000\r\nMessage-ID: <1@example.com>\r\n\r\n"
    b"Hello,   world.  \r\n\r\n\r\n"
)


@pytest.fixture(scope="module")
def pem() -> bytes:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def txt_record(pem: bytes) -> bytes:
    key = serialization.load_pem_private_key(pem, None)
    public = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return b"v=DKIM1; k=rsa; p=" + base64.b64encode(public)


# Prose with what relaxed canonicalization rewrites: runs of blanks, tabs, blanks at
# line ends, bare LF line ends, empty lines at the end; and a folded header field.
TEXT_MESSAGE = (
    b"From: Alice <alice@example.com>\r\nTo: bob@example.org\r\nSubject: a long\r\n\t one\r\n"
    b"Date: Sat, 05 Dec 2026 12:00:00 +0000\r\n\r\n"
    + b"".join(
        b"Line %d of the report:  two\tblanks, a tab \t and an end \r\n" % n
        + (b"bare LF line\n" if n % 7 == 0 else b"")
        for n in range(400)
    )
    + b"\r\n\r\n"
)


def dkimpy_s_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """dkimpy as it ships, whatever install() did in this process."""
    monkeypatch.setattr(dkim, "RSASSA_PKCS1_v1_5_sign", dkim.crypto.RSASSA_PKCS1_v1_5_sign)
    monkeypatch.setattr(dkim, "parse_pem_private_key", dkim.crypto.parse_pem_private_key)
    monkeypatch.setattr(dkim, "rfc822_parse", canonical.dkimpy_rfc822_parse)
    monkeypatch.setattr(
        dkim.canonicalization, "compress_whitespace", canonical.dkimpy_compress_whitespace
    )
    monkeypatch.setattr(
        dkim.canonicalization,
        "strip_trailing_whitespace",
        canonical.dkimpy_strip_trailing_whitespace,
    )


@pytest.mark.parametrize("message", [MESSAGE, TEXT_MESSAGE], ids=["short", "text"])
def test_install_gives_dkimpy_s_own_signature_byte_for_byte(
    pem: bytes, monkeypatch: pytest.MonkeyPatch, message: bytes
) -> None:
    monkeypatch.setattr(dkim.time, "time", lambda: 1796400000)  # t= the same in both
    with monkeypatch.context() as pure_dkimpy:
        dkimpy_s_own(pure_dkimpy)
        pure = dkim.sign(message, b"s1", b"example.com", pem, canonicalize=signing.CANONICALIZATION)
    signing.install()
    assert dkim.RSASSA_PKCS1_v1_5_sign is signing.openssl_sign
    assert dkim.parse_pem_private_key is signing.parse_pem
    assert dkim.rfc822_parse is canonical.rfc822_parse
    fast = dkim.sign(message, b"s1", b"example.com", pem, canonicalize=signing.CANONICALIZATION)
    assert fast == pure


def generated(rng: random.Random, pieces: list[bytes], count: int) -> list[bytes]:
    return [b"".join(rng.choices(pieces, k=rng.randint(0, 40))) for _ in range(count)]


def outcome(function: Callable[[bytes], object], value: bytes) -> object:
    try:
        return function(value)
    except Exception as exc:  # noqa: BLE001  # the same failure is the same outcome
        return type(exc)


def test_canonical_functions_give_dkimpy_s_results_for_any_input() -> None:
    rng = random.Random(6376)  # the same inputs every run
    blanks = [b"a", b"b:", b" ", b"  ", b"\t", b"\r", b"\n", b"\r\n", b"\r\r\n", b"\n\n"]
    for value in generated(rng, blanks, 5000):
        assert canonical.compress_whitespace(value) == canonical.dkimpy_compress_whitespace(value)
        assert canonical.strip_trailing_whitespace(value) == (
            canonical.dkimpy_strip_trailing_whitespace(value)
        )
        assert canonical.crlf(value) == b"\r\n".join(re.split(b"\r?\n", value))
    lines = [b"X-A: v", b"From: a", b"From x", b" folded", b"\tfolded", b"bad line", b"b",
             b"\r\n", b"\n", b"\r", b"\r\n\r\n", b"\n\r\n", b"\n\n", b" ", b"\t"]  # fmt: skip
    for value in [*generated(rng, lines, 5000), b"", b"\n", b"\r\n", b"A: b\r\n", b"A: b\n\n"]:
        assert outcome(canonical.rfc822_parse, value) == outcome(
            canonical.dkimpy_rfc822_parse, value
        ), value


def test_a_signature_verifies_and_breaks_when_the_message_changes(pem: bytes) -> None:
    signing.install()
    signer = signing.Signer("example.com", "s1", pem, ["from", "to", "subject", "date"])
    field = signer.signature(MESSAGE)
    assert field.startswith(b"DKIM-Signature: v=1; a=rsa-sha256; c=relaxed/relaxed; d=example.com;")
    assert field.endswith(b"\r\n")
    record = txt_record(pem)

    def dns(name: bytes, timeout: int = 5) -> bytes:
        assert name == b"s1._domainkey.example.com."
        return record

    assert dkim.verify(field + MESSAGE, dnsfunc=dns)
    assert not dkim.verify(field + MESSAGE.replace(b"Hello", b"Hallo"), dnsfunc=dns)


def test_keys_that_cannot_sign_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a PEM private key"):
        signing.load_key(b"not a key")
    other = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )  # fmt: skip
    with pytest.raises(ValueError, match="not an RSA key"):
        signing.load_key(other)
    short = tmp_path / "short.pem"
    subprocess.run(
        ["openssl", "genrsa", "-out", str(short), "512"], check=True, capture_output=True
    )
    with pytest.raises(ValueError, match="too short"):
        signing.load_key(short.read_bytes())


SECRET = b"a secret of the forwarder"
NOW = 1796400000.0


def test_srs0_round_trip() -> None:
    rewritten = srs.forward("Alice@sender.org", "fwd.example", SECRET, NOW)
    local, _, domain = rewritten.rpartition("@")
    assert domain == "fwd.example"
    assert local.startswith("SRS0=")
    assert local.endswith("=sender.org=Alice")
    assert srs.reverse(rewritten, "fwd.example", SECRET, NOW, 21 * 86400) == "Alice@sender.org"
    # some hops lower-case a local part: still ours
    assert srs.reverse(rewritten.lower(), "fwd.example", SECRET, NOW, 21 * 86400) == (
        "alice@sender.org"
    )
    assert srs.is_srs(rewritten, "fwd.example")


def test_srs_refuses_forgeries_expired_and_foreign_addresses() -> None:
    rewritten = srs.forward("alice@sender.org", "fwd.example", SECRET, NOW)
    assert srs.reverse(rewritten, "fwd.example", b"another secret", NOW, 21 * 86400) is None
    tampered = rewritten.replace("alice", "mallory")
    assert srs.reverse(tampered, "fwd.example", SECRET, NOW, 21 * 86400) is None
    later = NOW + 22 * 86400
    assert srs.reverse(rewritten, "fwd.example", SECRET, later, 21 * 86400) is None
    assert srs.reverse(rewritten, "elsewhere.example", SECRET, NOW, 21 * 86400) is None
    assert srs.reverse("bob@fwd.example", "fwd.example", SECRET, NOW, 21 * 86400) is None


def test_a_second_forwarder_writes_srs1_and_a_bounce_goes_back_to_the_first() -> None:
    first = srs.forward("alice@sender.org", "first.example", b"first secret", NOW)
    second = srs.forward(first, "second.example", SECRET, NOW)
    assert second.startswith("SRS1=")
    assert second.endswith("@second.example")
    third = srs.forward(second, "third.example", b"third", NOW)  # SRS1 stays SRS1
    assert third.startswith("SRS1=")
    assert "=first.example==" in third
    back = srs.reverse(second, "second.example", SECRET, NOW, 21 * 86400)
    assert back == first  # the bounce goes to the first forwarder, which decodes its own
    assert srs.reverse(back, "first.example", b"first secret", NOW, 21 * 86400) == (
        "alice@sender.org"
    )


def test_only_fields_the_message_has_are_signed(pem: bytes) -> None:
    signing.install()
    signer = signing.Signer("example.com", "s1", pem, ["from", "cc", "subject", "date"])
    field = signer.signature(MESSAGE)  # no Cc:
    tags = dict(
        part.strip().split("=", 1)
        for part in field.decode().split(":", 1)[1].replace("\r\n", "").split(";")
        if "=" in part
    )
    assert [h.strip() for h in tags["h"].split(":")] == ["from", "subject", "date"]


def test_a_key_is_checked_once_however_often_it_is_loaded_and_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A key of its own: the module's may already be loaded in this process.
    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    loads: list[bytes] = []
    load = serialization.load_pem_private_key

    def counted(data: bytes, password: bytes | None, **kwargs: object) -> object:
        loads.append(data)
        return load(data, password)

    def rebuilt(*args: object, **kwargs: object) -> object:
        raise AssertionError("the key was built again from its numbers")

    monkeypatch.setattr(serialization, "load_pem_private_key", counted)
    monkeypatch.setattr(rsa.RSAPrivateNumbers, "private_key", rebuilt)
    signing.install()
    key = signing.load_key(pem)  # a worker's start: its options' check
    signer = signing.Signer("example.com", "s1", pem, ["from"])
    assert signing.load_key(pem) is key
    signer.signature(MESSAGE)
    signer.signature(MESSAGE)
    assert loads == [pem]
