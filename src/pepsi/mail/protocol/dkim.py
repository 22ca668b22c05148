"""DKIM signatures (RFC 6376) on dkimpy, with the RSA operation done by OpenSSL.

dkimpy canonicalizes, chooses and hashes the header fields, and writes the
DKIM-Signature field. Its RSA private-key operation is pure Python (about
6 ms for a 2048-bit key here); the `cryptography` package's OpenSSL does the
same PKCS #1 v1.5 signature in about 0.3 ms. `install()` points dkimpy at it
(its module-level `RSASSA_PKCS1_v1_5_sign`, in this process), at a
remembered `parse_pem_private_key`, and at `canonical.py`'s message split
and whitespace rules (dkimpy's own regexes cost more than the RSA operation
on a text message of a few KB); the unit tests require the signatures to be
the same bytes as dkimpy's own: PKCS #1 v1.5 is deterministic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import dkim
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa, utils

from pepsi.mail.protocol import canonical

CANONICALIZATION = (b"relaxed", b"relaxed")  # the most robust to reformatting on the way
_ALGORITHMS: dict[str, Callable[[], hashes.HashAlgorithm]] = {
    "sha256": hashes.SHA256,
    "sha1": hashes.SHA1,
}
_KEYS: dict[int, rsa.RSAPrivateKey] = {}  # by modulus, for `openssl_sign`
# Keys loaded, by their PEM. OpenSSL checks an RSA key when it loads it (about 40 ms
# for 2048 bits here): a signing worker's start loaded its key three times (the
# options' check, the Signer, the first signature), 0.12 s; now once.
_LOADED: dict[bytes, rsa.RSAPrivateKey] = {}


def load_key(pem: bytes) -> rsa.RSAPrivateKey:
    """An RSA private key in PEM (PKCS #1 or #8); ValueError for anything else."""
    key = _LOADED.get(pem)
    if key is None:
        key = _LOADED[pem] = _checked_key(pem)
        _KEYS[key.public_key().public_numbers().n] = key
    return key


def _checked_key(pem: bytes) -> rsa.RSAPrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not a PEM private key without a passphrase ({exc})") from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError("not an RSA key (rsa-sha256 signatures need one)")  # noqa: TRY004
    if key.key_size < 1024:
        raise ValueError(f"an RSA key of {key.key_size} bits is too short (RFC 8301: 1024+)")
    return key


def openssl_sign(digest: Any, private_key: dict[str, int]) -> bytes:
    """dkimpy's RSASSA_PKCS1_v1_5_sign(hash, key) by OpenSSL: the same signature."""
    key = _KEYS.get(private_key["modulus"])
    if key is None:
        public = rsa.RSAPublicNumbers(private_key["publicExponent"], private_key["modulus"])
        key = rsa.RSAPrivateNumbers(
            p=private_key["prime1"],
            q=private_key["prime2"],
            d=private_key["privateExponent"],
            dmp1=private_key["exponent1"],
            dmq1=private_key["exponent2"],
            iqmp=private_key["coefficient"],
            public_numbers=public,
        ).private_key()
        _KEYS[private_key["modulus"]] = key
    algorithm = _ALGORITHMS[digest.name.lower()]()
    return key.sign(digest.digest(), padding.PKCS1v15(), utils.Prehashed(algorithm))


@functools.lru_cache(maxsize=16)
def parse_pem(pem: bytes) -> dict[str, int]:
    """dkimpy's parse_pem_private_key, remembered: it parsed the key again for each
    signature (0.15 ms of ASN.1 in Python)."""
    parsed: dict[str, int] = _PARSE_PEM(pem)
    return parsed


_PARSE_PEM = dkim.parse_pem_private_key


def install() -> None:
    """Sign with OpenSSL from now on in this process (idempotent)."""
    dkim.RSASSA_PKCS1_v1_5_sign = openssl_sign
    dkim.parse_pem_private_key = parse_pem
    canonical.install()


class Signer:
    """Signs messages for one domain and selector with one key."""

    def __init__(self, domain: str, selector: str, pem: bytes, headers: Sequence[str]) -> None:
        load_key(pem)  # a key dkimpy could not use fails here, at the worker's start
        self.domain = domain.encode("idna")
        self.selector = selector.encode("ascii")
        self.pem = pem
        self.headers = [h.encode("ascii") for h in headers]

    def signature(self, message: bytes) -> bytes:
        """The DKIM-Signature field (with its CRLF) to put on top of `message`.

        Only the wanted fields the message has are signed (and From always): a
        field named but absent would forbid a later hop to add it (Postfix
        adds a missing Date:), which breaks the signature for nothing.
        """
        present = set(_field_names(message))
        wanted = [h for h in self.headers if h == b"from" or h in present]
        field: bytes = dkim.sign(
            message,
            self.selector,
            self.domain,
            self.pem,
            canonicalize=CANONICALIZATION,
            include_headers=wanted,
        )
        return field


def _field_names(message: bytes) -> list[bytes]:
    """The header field names of `message`, lower case."""
    header = message.split(b"\r\n\r\n", 1)[0]
    return [
        line.split(b":", 1)[0].strip().lower()
        for line in header.split(b"\r\n")
        if line and line[:1] not in (b" ", b"\t") and b":" in line
    ]
