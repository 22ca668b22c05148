"""Delivery status notifications (RFC 3464): failure, delay and success reports. Pure.

A report is a `multipart/report; report-type=delivery-status` message from
the null sender to the original envelope sender: a human-readable part, the
`message/delivery-status` part (one block per recipient: Final-Recipient,
Original-Recipient, Action, Status), and the original message (RET=FULL, a
failure) or its header block (RET=HDRS, a delay, a success, or a message
too large to return whole).

The reason given is generic: a status code and the sentence that goes with
its class. What went wrong precisely (a remote reply that may name hosts, a
local error that may name files) stays in the message's `state.last_error`,
as the manual asks.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from email.utils import format_datetime

from pepsi.mail.protocol.envelope import xtext_encode
from pepsi.stage import NewMessage

FAILURE, DELAY, SUCCESS = "failure", "delay", "success"
RETURN_WHOLE_LIMIT = 100 * 1024  # a larger original is returned as its header block only

_SUBJECTS = {
    FAILURE: "Undelivered Mail Returned to Sender",
    DELAY: "Delayed Mail (still being retried)",
    SUCCESS: "Successful Mail Delivery Report",
}
_INTRO = {
    FAILURE: "Your message could not be delivered to one or more recipients.\r\n"
    "This is a permanent error: it will not be tried again.",
    DELAY: "Your message has not been delivered yet to one or more recipients.\r\n"
    "It is still being tried: you need not send it again.",
    SUCCESS: "Your message was delivered, as you asked to be told.",
}
# What a status's class and subject mean, for people (RFC 3463).
_MEANING = {
    "1": "the address of the recipient",
    "2": "the recipient's mailbox",
    "3": "the receiving mail system",
    "4": "the network or the route to the recipient",
    "5": "the mail delivery protocol",
    "6": "the message's content or format",
    "7": "a security or policy decision",
}


@dataclass(frozen=True)
class Report:
    """What one recipient's line in a report says."""

    recipient: str
    action: str  # failed, delayed, delivered or relayed (RFC 3464 §2.3.3)
    status: str  # an enhanced status code: 5.1.1, 4.4.7, 2.0.0
    original: str | None = None  # ORCPT as given: "rfc822;bob@example.com"


@dataclass(frozen=True)
class Original:
    """The message a report is about."""

    sender: str
    header: bytes
    body: bytes
    arrived: datetime
    envid: str | None = None  # ENVID
    ret: str | None = None  # RET: FULL or HDRS


def generic_reason(status: str) -> str:
    """A sentence for `status` that names nothing but its class and subject."""
    klass, _, rest = status.partition(".")
    subject = rest.partition(".")[0]
    where = _MEANING.get(subject, "the delivery")
    if klass == "2":
        return "delivered"
    if klass == "4":
        return f"a temporary problem with {where}"
    return f"a permanent problem with {where}"


def build(
    kind: str,
    original: Original,
    reports: Sequence[Report],
    *,
    stage: str,
    hostname: str,
    now: datetime,
) -> NewMessage:
    """The report of `kind` about `reports`, from the null sender to `original.sender`."""
    boundary = f"{secrets.token_hex(8)}/{hostname}"
    message_id = f"<{secrets.token_hex(12)}@{hostname}>"
    header = "".join(
        f"{name}: {value}\r\n"
        for name, value in (
            ("From", f"Mail Delivery System <MAILER-DAEMON@{hostname}>"),
            ("To", f"<{original.sender}>"),
            ("Subject", _SUBJECTS[kind]),
            ("Date", format_datetime(now)),
            ("Message-ID", message_id),
            ("Auto-Submitted", "auto-replied"),  # RFC 3834: never answered automatically
            ("MIME-Version", "1.0"),
            (
                "Content-Type",
                f'multipart/report; report-type=delivery-status;\r\n\tboundary="{boundary}"',
            ),
        )
    ).encode("utf-8")
    parts = [
        _part("text/plain; charset=utf-8", _human(kind, reports).encode("utf-8")),
        _part("message/delivery-status", _status(original, reports, hostname).encode("utf-8")),
        _returned(kind, original),
    ]
    body = b"This is a MIME-encapsulated message.\r\n\r\n"
    for part in parts:
        body += f"--{boundary}\r\n".encode() + part + b"\r\n"
    body += f"--{boundary}--\r\n".encode()
    return NewMessage(
        stage,
        header=header,
        body=body,
        sender="",
        recipients=(original.sender,),
        message_id=message_id,
        header_from=f"Mail Delivery System <MAILER-DAEMON@{hostname}>",
        subject=_SUBJECTS[kind],
        content_type="multipart/report",
        state={"dsn": kind},
    )


def _part(content_type: str, payload: bytes) -> bytes:
    encoding = "7bit" if payload.isascii() else "8bit"
    return (
        f"Content-Type: {content_type}\r\nContent-Transfer-Encoding: {encoding}\r\n\r\n"
    ).encode() + payload


def _human(kind: str, reports: Sequence[Report]) -> str:
    lines = [_INTRO[kind], ""]
    for report in reports:
        reason = "" if kind == SUCCESS else f": {generic_reason(report.status)}"
        lines.append(f"<{report.recipient}> ({report.action}, {report.status}){reason}")
    lines += ["", "The details are kept by the mail system's operator.", ""]
    return "\r\n".join(lines)


def _status(original: Original, reports: Sequence[Report], hostname: str) -> str:
    blocks = [f"Reporting-MTA: dns; {hostname}\r\n"]
    if original.envid:
        blocks[0] += f"Original-Envelope-Id: {xtext_encode(original.envid)}\r\n"
    blocks[0] += f"Arrival-Date: {format_datetime(original.arrived)}\r\n"
    for report in reports:
        block = f"Final-Recipient: rfc822; {report.recipient}\r\n"
        if report.original:
            kind, _, address = report.original.partition(";")
            block += f"Original-Recipient: {kind}; {xtext_encode(address)}\r\n"
        block += f"Action: {report.action}\r\nStatus: {report.status}\r\n"
        blocks.append(block)
    return "\r\n".join(blocks)


def _returned(kind: str, original: Original) -> bytes:
    whole = (
        kind == FAILURE
        and original.ret != "HDRS"
        and len(original.header) + len(original.body) <= RETURN_WHOLE_LIMIT
    )
    if whole:
        content = original.header + b"\r\n" + original.body
        return _part("message/rfc822", content)
    return _part("text/rfc822-headers", original.header)
