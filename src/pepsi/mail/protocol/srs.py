"""The Sender Rewriting Scheme (SRS0 and SRS1, as libsrs2 and postsrsd write them). Pure.

A forwarder that relays mail for senders of other domains rewrites the
envelope sender into its own domain, so that SPF passes at the next hop
and a bounce comes back to it:

    alice@sender.org             -> SRS0=HHHH=TT=sender.org=alice@fwd.example
    SRS0=HHHH=TT=orig=u@first    -> SRS1=HHHH=first==HHHH=TT=orig=u@fwd.example

HHHH is the start of an HMAC-SHA1 of what follows it under a secret, TT a
day counter (mod 1024, two base32 characters). `reverse` turns a rewritten
address at our domain back into where a bounce must go, if its hash is ours
and it is not older than the maximum age.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

SEPARATOR = "="
HASH_LENGTH = 4
_BASE32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
_DAY = 86400


def _hash(secret: bytes, *parts: str) -> str:
    digest = hmac.new(secret, "".join(parts).lower().encode("utf-8"), hashlib.sha1).digest()
    return base64.b64encode(digest).decode("ascii")[:HASH_LENGTH]


def timestamp(now: float) -> str:
    day = int(now // _DAY) % 1024
    return _BASE32[day >> 5] + _BASE32[day & 31]


def _age_days(stamp: str, now: float) -> int | None:
    if len(stamp) != 2 or any(c not in _BASE32 for c in stamp.upper()):
        return None
    then = (_BASE32.index(stamp[0].upper()) << 5) | _BASE32.index(stamp[1].upper())
    return (int(now // _DAY) - then) % 1024


def forward(address: str, domain: str, secret: bytes, now: float) -> str:
    """`address` rewritten into `domain` (an SRS1 address if it is an SRS address already)."""
    local, _, host = address.rpartition("@")
    upper = local.upper()
    if upper.startswith("SRS0") and local[4:5] in "=+-":
        # SRS0=HHHH=TT=orig=user@first: the first forwarder stays, wrapped in SRS1.
        rest = local[5:]
        mac = _hash(secret, host, rest)
        return f"SRS1{SEPARATOR}{mac}{SEPARATOR}{host}{SEPARATOR}{SEPARATOR}{rest}@{domain}"
    if upper.startswith("SRS1") and local[4:5] in "=+-":
        # SRS1=HHHH=first==rest@last: keep the first forwarder and the rest, re-signed.
        parts = local[5:].split(SEPARATOR, 2)
        if len(parts) == 3:
            _, first, rest = parts
            rest = rest.lstrip("=+-")
            mac = _hash(secret, first, rest)
            return f"SRS1{SEPARATOR}{mac}{SEPARATOR}{first}{SEPARATOR}{SEPARATOR}{rest}@{domain}"
    stamp = timestamp(now)
    mac = _hash(secret, stamp, host, local)
    return f"SRS0{SEPARATOR}{mac}{SEPARATOR}{stamp}{SEPARATOR}{host}{SEPARATOR}{local}@{domain}"


def reverse(address: str, domain: str, secret: bytes, now: float, max_age: float) -> str | None:
    """Where a bounce to `address` goes; None if it is not a valid SRS address of ours."""
    local, _, host = address.rpartition("@")
    if host.lower() != domain.lower() or local[4:5] not in "=+-":
        return None
    kind, body = local[:4].upper(), local[5:]
    if kind == "SRS0":
        return _reverse0(body, secret, now, max_age)
    if kind == "SRS1":
        return _reverse1(body, secret)
    return None


def _reverse0(body: str, secret: bytes, now: float, max_age: float) -> str | None:
    parts = body.split(SEPARATOR, 3)
    if len(parts) != 4:
        return None
    mac, stamp, orig_host, orig_local = parts
    age = _age_days(stamp, now)
    if age is None or age * _DAY > max_age:
        return None
    if not _same(mac, _hash(secret, stamp, orig_host, orig_local)):
        return None
    return f"{orig_local}@{orig_host}"


def _reverse1(body: str, secret: bytes) -> str | None:
    parts = body.split(SEPARATOR, 2)
    if len(parts) != 3 or not parts[2].startswith(SEPARATOR):
        return None
    mac, first, rest = parts[0], parts[1], parts[2][1:]
    if not _same(mac, _hash(secret, first, rest)):
        return None
    return f"SRS0{SEPARATOR}{rest}@{first}"


def _same(given: str, expected: str) -> bool:
    """Hashes compared without regard to case: some hops lower-case local parts."""
    return hmac.compare_digest(given.upper(), expected.upper())


def is_srs(address: str, domain: str) -> bool:
    """Whether `address` is already an SRS address of `domain` (not to be rewritten again)."""
    local, _, host = address.rpartition("@")
    return host.lower() == domain.lower() and local[:4].upper() in ("SRS0", "SRS1")
