"""One delivery attempt's values, and what its replies say of each recipient. Pure.

`Peer` is a host to try and how to speak to it, `Outgoing` what one attempt
sends. `recipient_results` reads the replies to MAIL, the RCPTs and DATA (as
far as they came, pipelined or one by one) and the reply to the data into a
`Result` for each recipient whose fate they tell; `pepsi.mail.relay.delivery`
decides from those. The SMTP client that gets the replies is
`pepsi.mail.relay.outbound`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pepsi.mail.relay.delivery import Result


@dataclass(frozen=True)
class Peer:
    """One host to try, and how to speak to it."""

    name: str  # its host name: for TLS and the logs
    address: str  # what to connect to (an IP address, or the name)
    port: int
    tls: str = "may"  # none, may, starttls, implicit
    ca_file: Path | None = None  # starttls/implicit: verify against this, else the system's
    login: tuple[str, str] | None = None  # AUTH user and secret

    def __str__(self) -> str:
        where = self.name if self.name == self.address else f"{self.name}[{self.address}]"
        return f"{where}:{self.port}"


@dataclass(frozen=True)
class Outgoing:
    """What one attempt sends."""

    sender: str  # '' for the null sender
    recipients: tuple[str, ...]
    data: bytes  # the whole message: header block, empty line, body
    smtp: Mapping[str, Any] = field(default_factory=dict)  # properties.smtp


def recipient_results(
    peer: Peer,
    message: Outgoing,
    replies: list[tuple[int, bytes]],
    final: tuple[int, bytes] | None,
    *,
    dsn: bool,
) -> dict[str, Result]:
    """A result for each recipient whose fate the replies tell: `replies` are MAIL's, then
    the RCPTs' and DATA's as far as they came; `final` is the reply to the data."""
    code, text = replies[0]
    if code != 250:
        return {r: _result(peer, code, text) for r in message.recipients}
    results: dict[str, Result] = {}
    accepted = []
    for recipient, (code, text) in zip(message.recipients, replies[1:], strict=False):
        if code in (250, 251):
            accepted.append(recipient)
        else:
            results[recipient] = _result(peer, code, text)
    data = replies[1 + len(message.recipients) :]
    if data and data[0][0] != 354:  # DATA refused
        results.update((r, _result(peer, *data[0])) for r in accepted)
    elif final is not None:
        rcpt = message.smtp.get("rcpt", {})
        for recipient in accepted:
            asked = dsn and bool(rcpt.get(recipient, {}).get("notify"))
            results[recipient] = _result(peer, *final, dsn_passed=asked)
    return results


def _result(peer: Peer, code: int, reply: bytes | str, *, dsn_passed: bool = False) -> Result:
    return Result(code, f"{peer}: {code} {reply_text(reply)}", dsn_passed=dsn_passed)


def reply_text(reply: bytes | str) -> str:
    text = reply.decode("utf-8", "replace") if isinstance(reply, bytes) else str(reply)
    return " ".join(text.split())
