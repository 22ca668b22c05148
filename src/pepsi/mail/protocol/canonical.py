"""dkimpy's message split and whitespace rules, the same bytes without its per-byte regexes.

dkimpy splits a message at `\\r?\\n` and rewrites every run of blanks in the
body with `re.sub`, which is slow in proportion to the text: for a 28 KB text
message, 1.9 ms of a 2.7 ms signature (its RSA operation is 0.4). These
functions give the results of dkimpy's own (`rfc822_parse`,
`strip_trailing_whitespace`, `compress_whitespace`) for every input; the
unit tests compare them on generated inputs. Where a message needs no
change, they see that with a search in C and return it; where it does, they
do dkimpy's work, with fewer regex matches. `dkim.install()` puts them in
dkimpy's place, in the signing workers' process.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import dkim
import dkim.canonicalization

Parse = Callable[[bytes], tuple[list[list[bytes]], bytes]]

# dkimpy's own, as imported (before `install`): called for the work they do, and the tests'
dkimpy_rfc822_parse: Parse = dkim.rfc822_parse
dkimpy_strip_trailing_whitespace: Callable[[bytes], bytes] = (
    dkim.canonicalization.strip_trailing_whitespace
)
dkimpy_compress_whitespace: Callable[[bytes], bytes] = dkim.canonicalization.compress_whitespace
# A run of blanks that is not already one space: the only runs `[\t ]+` → " " changes.
_RUNS = re.compile(rb"[\t ]{2,}|\t")


def rfc822_parse(message: bytes) -> tuple[list[list[bytes]], bytes]:
    """dkimpy's (headers, body): its own parse of the header block, the body's line
    endings made CRLF without splitting it into lines."""
    end = _after_blank_line(message)
    if end is None:  # no empty line, or only at the very end: dkimpy's own, whole
        return dkimpy_rfc822_parse(message)
    headers, _ = dkimpy_rfc822_parse(message[:end])
    return headers, crlf(message[end:])


def _after_blank_line(message: bytes) -> int | None:
    """Where the text after the first empty line starts, lines ending in `\\r?\\n`."""
    if message.startswith(b"\n"):
        return 1
    if message.startswith(b"\r\n"):
        return 2
    # A line end followed by an empty line: "\n\r\n" (mail's), or "\n\n" before it. A
    # CRLF message has no "\n\n": searched up to the first "\n\r\n" only, not through
    # the whole body (25 µs for 28 KB).
    crlf_end = message.find(b"\n\r\n")
    bare = message.find(b"\n\n", 0, len(message) if crlf_end < 0 else crlf_end + 2)
    if bare >= 0:
        return bare + 2
    return None if crlf_end < 0 else crlf_end + 3


def crlf(text: bytes) -> bytes:
    """Every `\\r?\\n` as `\\r\\n`: dkimpy's split and join of the body's lines."""
    if text.count(b"\n") == text.count(b"\r\n"):
        return text
    return text.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")


def strip_trailing_whitespace(content: bytes) -> bytes:
    """Blanks before each CRLF removed (dkimpy's, called only when there are some)."""
    if b" \r\n" in content or b"\t\r\n" in content:
        return dkimpy_strip_trailing_whitespace(content)
    return content


def compress_whitespace(content: bytes) -> bytes:
    """Every run of blanks as one space: the runs that are one space already are left."""
    if b"\t" in content or b"  " in content:
        return _RUNS.sub(b" ", content)
    return content


def install() -> None:
    """Put these in dkimpy's place, in this process (idempotent)."""
    dkim.rfc822_parse = rfc822_parse
    dkim.canonicalization.strip_trailing_whitespace = strip_trailing_whitespace
    dkim.canonicalization.compress_whitespace = compress_whitespace
