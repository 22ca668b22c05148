"""A received message as the row it becomes. Pure.

The header block gets the server's `Received:` on top; Message-ID, From and
Subject are extracted from it; the envelope, the client and the DSN
parameters go into the row's columns and `properties.smtp`
(docs/mail.md, "What a message becomes").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pepsi.mail.protocol import content, envelope
from pepsi.mail.protocol.envelope import MailParameters, RcptParameters
from pepsi.publishing import OutgoingMessage


@dataclass(frozen=True)
class Arrival:
    """Who handed the message over, and how."""

    helo: str | None  # the client's HELO/EHLO/LHLO name
    peer: str | None  # its IP address; None on a UNIX socket
    login: str | None  # its AUTH login, or a local peer's user: the row's origin_user
    protocol: str  # RFC 3848's WITH keyword (`with_keyword`)
    tls: str | None  # "TLSv1.3 with cipher …", None without TLS


def with_keyword(base: str, *, extended: bool, tls: bool, authenticated: bool) -> str:
    """RFC 3848: SMTP (HELO), ESMTP, ESMTPS, ESMTPA, ESMTPSA; LMTP likewise."""
    if not extended:
        return "SMTP"
    return base + ("S" if tls else "") + ("A" if authenticated else "")


def tls_description(ssl_object: Any) -> str | None:
    """The protocol and cipher of a TLS session (an `ssl.SSLObject`), for Received:."""
    if ssl_object is None:
        return None
    version, cipher = ssl_object.version(), ssl_object.cipher()
    if version and cipher:
        return f"{version} with cipher {cipher[0]}"
    return str(version or "TLS")


def build(
    data: bytes,
    *,
    stage: str,
    sender: str,
    recipients: Mapping[str, RcptParameters],
    mail: MailParameters,
    arrival: Arrival,
    hostname: str,
    queue_id: str,
    now: datetime,
) -> OutgoingMessage:
    """The message `data` (as received) with its envelope, as one row at `stage`."""
    header, body = content.split_message(data)
    extracted = content.extract(header)
    received = content.received(
        helo=arrival.helo,
        peer=arrival.peer,
        hostname=hostname,
        protocol=arrival.protocol,
        queue_id=queue_id,
        recipients=list(recipients),
        tls=arrival.tls,
        when=now,
    )
    return OutgoingMessage(
        stage,
        body,
        received + header,
        sender=sender,
        recipients=tuple(recipients),
        origin_user=arrival.login,
        origin_peer=arrival.peer,
        message_id=extracted.message_id,
        header_from=extracted.header_from,
        subject=extracted.subject,
        properties={"smtp": envelope.smtp_properties(mail, recipients, queue_id=queue_id)},
    )
