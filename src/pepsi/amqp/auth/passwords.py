"""Password hashes of AMQP users: scrypt from the standard library, one string each.

A hash is stored as `$scrypt$ln=14,r=8,p=1$SALT$KEY` (the PHC string
format: SALT and KEY in unpadded base64), so the cost travels with it and
can be raised later without invalidating stored hashes (`needs_rehash`).

`verify` never raises on a malformed or tampered string (it is False) and
refuses parameters far beyond ours, so a row written by hand cannot make a
login cost gigabytes or minutes. hashlib.scrypt releases the GIL: the
listener can run it in a thread.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

# ~16 MiB and some tens of milliseconds per hash: slow for an attacker with
# a stolen table, cheap enough for a login (RFC 7914's interactive setting).
LOG2_N = 14
BLOCK_SIZE = 8  # r
PARALLELISM = 1  # p
SALT_BYTES = 16
KEY_BYTES = 32

# What `verify` accepts from a stored string: at most 8x our memory and 16x our work.
_MAX_MEMORY = 8 * 128 * BLOCK_SIZE * (1 << LOG2_N)  # 128 MiB
_MAX_WORK = 16 * BLOCK_SIZE * PARALLELISM * (1 << LOG2_N)  # in units of n * r * p
_MAX_KEY_BYTES = 128

_FORMAT = re.compile(
    r"\$scrypt\$ln=(\d{1,2}),r=(\d{1,3}),p=(\d{1,3})\$([A-Za-z0-9+/]+)\$([A-Za-z0-9+/]+)"
)


@dataclass(frozen=True)
class ScryptHash:
    """A parsed hash string."""

    log2_n: int
    r: int
    p: int
    salt: bytes
    key: bytes

    def encode(self) -> str:
        return (
            f"$scrypt$ln={self.log2_n},r={self.r},p={self.p}"
            f"${_b64encode(self.salt)}${_b64encode(self.key)}"
        )


def _b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii").rstrip("=")


def _b64decode(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)


def _as_bytes(password: str | bytes) -> bytes:
    return password.encode("utf-8") if isinstance(password, str) else password


def _derive(password: bytes, salt: bytes, *, log2_n: int, r: int, p: int, length: int) -> bytes:
    n = 1 << log2_n
    # scrypt needs 128 * r * (n + p) bytes; hashlib's default cap (32 MiB) is too tight
    # for the stronger parameters `verify` accepts.
    maxmem = 128 * r * (n + p) + (1 << 20)
    return hashlib.scrypt(password, salt=salt, n=n, r=r, p=p, dklen=length, maxmem=maxmem)


def hash_password(password: str | bytes, *, log2_n: int = LOG2_N) -> str:
    """A new salted hash of `password` (UTF-8 if text), as one string to store.

    ValueError for a password with a NUL: scrypt could not tell it from the
    same password without its trailing NULs.
    """
    if b"\0" in _as_bytes(password):
        raise ValueError("a password cannot contain a NUL character")
    salt = secrets.token_bytes(SALT_BYTES)
    key = _derive(
        _as_bytes(password), salt, log2_n=log2_n, r=BLOCK_SIZE, p=PARALLELISM, length=KEY_BYTES
    )
    return ScryptHash(log2_n, BLOCK_SIZE, PARALLELISM, salt, key).encode()


def parse(stored: str) -> ScryptHash:
    """The parts of a hash string; ValueError if it is not one this module would verify."""
    match = _FORMAT.fullmatch(stored)
    if match is None:
        raise ValueError("not a Pepsi scrypt hash")
    log2_n, r, p = (int(match.group(i)) for i in (1, 2, 3))
    try:
        salt, key = _b64decode(match.group(4)), _b64decode(match.group(5))
    except (binascii.Error, ValueError):
        raise ValueError("bad base64 in the hash") from None
    n = 1 << log2_n
    if not (log2_n >= 1 and r >= 1 and p >= 1) or (
        128 * r * n > _MAX_MEMORY or n * r * p > _MAX_WORK
    ):
        raise ValueError("scrypt parameters out of range")
    # A shorter key would be a prefix of the right one: a truncated string must not verify.
    if not (SALT_BYTES <= len(salt) <= 64 and KEY_BYTES <= len(key) <= _MAX_KEY_BYTES):
        raise ValueError("salt or key of an unusable length")
    parsed = ScryptHash(log2_n, r, p, salt, key)
    if parsed.encode() != stored:  # base64 with stray low bits: one hash, one spelling
        raise ValueError("not the canonical spelling of a hash")
    return parsed


# Verified against when there is no stored hash (unknown user): the same work
# as a real check, so the answer's timing does not tell whether a user exists.
_DUMMY = ScryptHash(LOG2_N, BLOCK_SIZE, PARALLELISM, b"\0" * SALT_BYTES, b"\0" * KEY_BYTES)


def verify(password: str | bytes, stored: str | None) -> bool:
    """Whether `password` matches `stored`; False for None or a malformed string.

    With None (no such user) the work of one check is done all the same.
    """
    try:
        wanted = _DUMMY if stored is None else parse(stored)
    except ValueError:
        return False
    secret = _as_bytes(password)
    key = _derive(
        secret,
        wanted.salt,
        log2_n=wanted.log2_n,
        r=wanted.r,
        p=wanted.p,
        length=len(wanted.key),
    )
    # scrypt keys HMAC, which pads a key with NULs: "pw\0" would pass for "pw". No
    # password holds a NUL (hash_password refuses one), so none may match.
    return hmac.compare_digest(key, wanted.key) and stored is not None and b"\0" not in secret


def needs_rehash(stored: str) -> bool:
    """Whether `stored` is weaker than (or not) what `hash_password` makes now."""
    try:
        parsed = parse(stored)
    except ValueError:
        return True
    return (
        parsed.log2_n < LOG2_N
        or parsed.r < BLOCK_SIZE
        or parsed.p < PARALLELISM
        or len(parsed.key) < KEY_BYTES
    )
