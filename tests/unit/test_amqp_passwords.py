"""AMQP user passwords: salted scrypt strings, verified in constant time."""

from __future__ import annotations

import base64

import pytest

from pepsi.amqp.auth import passwords


@pytest.fixture(scope="module")
def stored() -> str:
    return passwords.hash_password("s3cret")


def test_hash_verifies_and_describes_itself(stored: str) -> None:
    assert stored.startswith("$scrypt$ln=14,r=8,p=1$")
    assert "s3cret" not in stored
    assert passwords.verify("s3cret", stored)
    assert passwords.verify(b"s3cret", stored)  # a SASL response's bytes
    parsed = passwords.parse(stored)
    assert (len(parsed.salt), len(parsed.key)) == (passwords.SALT_BYTES, passwords.KEY_BYTES)
    assert parsed.encode() == stored
    assert not passwords.needs_rehash(stored)


def test_wrong_password_is_refused(stored: str) -> None:
    for wrong in ("s3cret ", "S3cret", "", "s3cre", b"s3cret\0"):
        assert not passwords.verify(wrong, stored)


def test_same_password_gets_different_salts(stored: str) -> None:
    again = passwords.hash_password("s3cret")
    assert again != stored
    assert passwords.parse(again).salt != passwords.parse(stored).salt
    assert passwords.verify("s3cret", again)


def test_unicode_password() -> None:
    stored = passwords.hash_password("pässwörd🐇", log2_n=4)
    assert passwords.verify("pässwörd🐇", stored)
    assert passwords.verify("pässwörd🐇".encode(), stored)
    assert not passwords.verify("passwörd🐇", stored)


def _flip(text: str) -> str:
    return text[:-1] + ("A" if text[-1] != "A" else "B")


def test_tampered_strings_are_refused_without_raising(stored: str) -> None:
    prefix, salt, key = stored.rsplit("$", 2)
    tampered = [
        f"{prefix}${salt}${_flip(key)}",  # another key
        f"{prefix}${_flip(salt)}${key}",  # another salt
        stored.replace("ln=14", "ln=13"),  # cheaper cost
        stored.replace("r=8", "r=9"),
        stored.replace("$scrypt$", "$pbkdf2$"),
        stored[:-5],  # truncated key
        stored + "$",
        stored.replace("ln=14", "ln=40"),  # absurd cost: refused before any work
        stored.replace("r=8", "r=999"),
        f"{prefix}$!!!!${key}",  # not base64
        "",
        "guest",
        "$scrypt$ln=14,r=8,p=1$$",
    ]
    for text in tampered:
        assert not passwords.verify("s3cret", text), text


def test_parse_errors_are_value_errors() -> None:
    short_salt = base64.b64encode(b"x").decode().rstrip("=")
    key = base64.b64encode(b"k" * 32).decode().rstrip("=")
    for text in ("nope", f"$scrypt$ln=14,r=8,p=1${short_salt}${key}"):
        with pytest.raises(ValueError, match=r"scrypt|length"):
            passwords.parse(text)


def test_unknown_user_costs_a_check_and_is_false() -> None:
    assert not passwords.verify("anything", None)
    assert not passwords.verify("", None)


def test_weaker_hash_needs_rehash() -> None:
    weak = passwords.hash_password("x", log2_n=4)
    assert passwords.verify("x", weak)
    assert passwords.needs_rehash(weak)
    assert passwords.needs_rehash("garbage")


def test_nul_in_a_password_is_refused(stored: str) -> None:
    # HMAC (inside scrypt) pads its key with NULs: "s3cret\0" must not pass for "s3cret".
    with pytest.raises(ValueError, match="NUL"):
        passwords.hash_password("pw\0")
    assert not passwords.verify("s3cret\0\0", stored)


def test_costly_parameters_are_refused_before_any_work(stored: str) -> None:
    # A row written by hand must not make one login take gigabytes or minutes.
    for params in ("ln=18,r=16,p=1", "ln=14,r=8,p=99", "ln=21,r=1,p=1", "ln=0,r=8,p=1"):
        with pytest.raises(ValueError, match="out of range"):
            passwords.parse(stored.replace("ln=14,r=8,p=1", params))
    passwords.parse(stored.replace("ln=14,r=8,p=1", "ln=17,r=8,p=1"))  # 8x memory: allowed
