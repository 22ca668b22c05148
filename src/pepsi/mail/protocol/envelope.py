"""MAIL FROM and RCPT TO parameters, and what a row keeps of them. Pure.

ESMTP parameters (RFC 5321 §4.1.2): SIZE (RFC 1870), BODY (RFC 6152),
SMTPUTF8 (RFC 6531), RET and ENVID on MAIL, NOTIFY and ORCPT on RCPT
(RFC 3461, the DSN extension), and AUTH on MAIL (RFC 4954, accepted and
ignored: the session's own login is what counts). A parameter the server
does not know is refused with 555; a malformed one with 501.

What the delivery stages need later goes into the row's `properties` under
`"smtp"` (see `smtp_properties`): the DSN parameters per recipient, RET,
ENVID, and BODY/SMTPUTF8 so that a relay can announce them to the next hop.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pepsi.mail.protocol import replies
from pepsi.mail.protocol.replies import Reply

NOTIFY_WORDS = ("SUCCESS", "FAILURE", "DELAY")
MAX_ENVID = 100  # RFC 3461 §4.4
MAX_ORCPT = 500  # RFC 3461 §4.2
# an esmtp-keyword (RFC 5321 §4.1.2), and the same syntax for ORCPT's addr-type
_KEYWORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")
_XTEXT = re.compile(r"(?:[!-*,-<>-~]|\+[0-9A-F]{2})*")


class ParameterError(Exception):
    """A MAIL or RCPT parameter that cannot be taken; `reply` says why."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(str(reply))
        self.reply = reply


def _bad(text: str) -> ParameterError:
    return ParameterError(replies.BAD_SYNTAX.with_text(text))


@dataclass(frozen=True)
class MailParameters:
    size: int | None = None  # declared size, if any
    body: str | None = None  # 7BIT or 8BITMIME
    smtputf8: bool = False
    ret: str | None = None  # FULL or HDRS
    envid: str | None = None  # decoded


@dataclass(frozen=True)
class RcptParameters:
    notify: tuple[str, ...] = ()  # () not given; ("NEVER",); or some of NOTIFY_WORDS
    orcpt: str | None = None  # "addr-type;address", decoded


def split_parameters(words: Sequence[str]) -> dict[str, str | None]:
    """`KEY[=VALUE]` words as {KEY (upper case): VALUE or None}; 501 if one is malformed."""
    found: dict[str, str | None] = {}
    for word in words:
        key, equals, value = word.partition("=")
        if not _KEYWORD.fullmatch(key) or (equals and not value):
            raise _bad(f"Malformed parameter {word!r}")
        key = key.upper()
        if key in found:
            raise _bad(f"Parameter {key} given twice")
        found[key] = value if equals else None
    return found


def xtext_decode(text: str) -> str:
    """RFC 3461 xtext: printable ASCII with '+XX' for the rest; 501 if malformed."""
    if not _XTEXT.fullmatch(text):
        raise _bad("Malformed xtext")
    return re.sub(r"\+([0-9A-F]{2})", lambda m: chr(int(m.group(1), 16)), text)


def xtext_encode(text: str) -> str:
    """The inverse of `xtext_decode` (for a DSN's Original-Envelope-Id and ORCPT)."""
    return "".join(c if "!" <= c <= "~" and c not in "+=" else f"+{ord(c):02X}" for c in text)


def mail_parameters(words: Sequence[str], *, max_size: int) -> MailParameters:
    """The parameters of one MAIL command, or ParameterError with the reply to give."""
    found: dict[str, Any] = {}
    for key, value in split_parameters(words).items():
        if key == "AUTH":
            continue  # RFC 4954 §5: the session's own login is the identity kept
        parse = _MAIL_PARAMETERS.get(key)
        if parse is None:
            raise ParameterError(replies.UNKNOWN_PARAMETER.with_text(f"{key} not recognized"))
        found[key.lower()] = parse(value)
    size = found.get("size")
    if size is not None and size > max_size:
        raise ParameterError(replies.TOO_BIG)
    return MailParameters(**found)


def _size(value: str | None) -> int:
    if value is None or not value.isdigit() or len(value) > 20:
        raise _bad("SIZE takes a number")
    return int(value)


def _word(key: str, *allowed: str) -> Callable[[str | None], str]:
    def parse(value: str | None) -> str:
        word = (value or "").upper()
        if word not in allowed:
            raise _bad(f"{key} is {' or '.join(allowed)}")
        return word

    return parse


def _flag(value: str | None) -> bool:
    if value is not None:
        raise _bad("SMTPUTF8 takes no value")
    return True


def _envid(value: str | None) -> str:
    text = value or ""
    if not text or len(text) > MAX_ENVID:
        raise _bad(f"ENVID is 1 to {MAX_ENVID} characters of xtext")
    return xtext_decode(text)


_MAIL_PARAMETERS: dict[str, Callable[[str | None], Any]] = {
    "SIZE": _size,
    "BODY": _word("BODY", "7BIT", "8BITMIME"),
    "SMTPUTF8": _flag,
    "RET": _word("RET", "FULL", "HDRS"),
    "ENVID": _envid,
}


def rcpt_parameters(words: Sequence[str]) -> RcptParameters:
    """The parameters of one RCPT command, or ParameterError with the reply to give."""
    notify: tuple[str, ...] = ()
    orcpt = None
    for key, value in split_parameters(words).items():
        if key == "NOTIFY":
            notify = _notify(value or "")
        elif key == "ORCPT":
            orcpt = _orcpt(value or "")
        else:
            raise ParameterError(replies.UNKNOWN_PARAMETER.with_text(f"{key} not recognized"))
    return RcptParameters(notify, orcpt)


def _notify(value: str) -> tuple[str, ...]:
    words = [w.upper() for w in value.split(",")]
    if words == ["NEVER"]:
        return ("NEVER",)
    if not words or len(set(words)) != len(words) or not set(words) <= set(NOTIFY_WORDS):
        raise _bad("NOTIFY is NEVER, or a list of SUCCESS, FAILURE and DELAY")
    return tuple(w for w in NOTIFY_WORDS if w in words)


def _orcpt(value: str) -> str:
    kind, semicolon, address = value.partition(";")
    if not semicolon or not _KEYWORD.fullmatch(kind) or len(value) > MAX_ORCPT:
        raise _bad("ORCPT is addr-type;xtext")
    decoded = xtext_decode(address)
    if not decoded:
        raise _bad("ORCPT has no address")
    return f"{kind.lower()};{decoded}"


def smtp_properties(
    mail: MailParameters, recipients: Mapping[str, RcptParameters], *, queue_id: str
) -> dict[str, Any]:
    """What the row keeps in `properties["smtp"]`: only what was given, keyed by recipient."""
    kept: dict[str, Any] = {"id": queue_id}
    if mail.body == "8BITMIME":
        kept["body"] = mail.body
    if mail.smtputf8:
        kept["smtputf8"] = True
    if mail.ret is not None:
        kept["ret"] = mail.ret
    if mail.envid is not None:
        kept["envid"] = mail.envid
    dsn: dict[str, dict[str, Any]] = {}
    for address, params in recipients.items():
        entry: dict[str, Any] = {}
        if params.notify:
            entry["notify"] = list(params.notify)
        if params.orcpt is not None:
            entry["orcpt"] = params.orcpt
        if entry:
            dsn[address] = entry
    if dsn:
        kept["rcpt"] = dsn
    return kept


_PATH = re.compile(r"\s*<([^<>]*)>(.*)")
_SOURCE_ROUTE = re.compile(r"@[^:,<>]+(?:,@[^:,<>]+)*:")
MAX_PATH = 256  # RFC 5321 §4.5.3.1.3, angle brackets included


def split_path(arg: str) -> tuple[str, list[str]] | None:
    """`<address> PARAMS…` (the part after FROM: or TO:) → (address, parameter words).

    The null path `<>` is `""`; an obsolete source route is dropped; a path
    without angle brackets is taken as Postfix takes it. None if malformed.
    """
    match = _PATH.fullmatch(arg)
    if match is None:
        address, _, rest = arg.strip().partition(" ")
        if not address or "<" in address or ">" in address:
            return None
    else:
        address, rest = match.group(1).strip(), match.group(2)
        if rest and not rest[0].isspace():
            return None
    route = _SOURCE_ROUTE.match(address)
    if route is not None:
        address = address[route.end() :]
    if len(address) + 2 > MAX_PATH:
        return None
    return address, rest.split()
