"""Sending one message to the next hop over SMTP: one attempt, a result per recipient.

A worker's `Client` keeps its connections open between messages and reuses
them for the next message to the same host (as Postfix's connection cache
does); a connection it finds closed on reuse is opened again once. A
destination (a recipient domain, or a smarthost) takes at most LIMIT
connections at once from all the workers of this machine: each open
connection holds one of LIMIT lock files of its destination (`pepsi.mail.relay.slots`).

TLS: `none`; `starttls` (required, the certificate verified); `implicit`
(TLS from the first byte, verified); `may` (opportunistic, as Postfix's
default: STARTTLS when offered, unverified, and plain text again if the
handshake fails). The message goes with its DSN parameters when the next
hop has the extension, with BODY=8BITMIME as it came in, and with SMTPUTF8
when an address needs it. With PIPELINING (RFC 2920), MAIL, the RCPTs and
DATA go in one write and their replies are read together: two round trips a
message instead of three plus one per recipient. Built on the standard
library's smtplib (its connection, TLS, AUTH and reply reading). What the
replies say of each recipient is read apart (`pepsi.mail.relay.attempt`),
as is what DATA sends (`pepsi.mail.protocol.content.stuff`): both pure.
"""

from __future__ import annotations

import contextlib
import functools
import smtplib
import socket
import ssl
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pepsi.mail.protocol.content import stuff
from pepsi.mail.protocol.envelope import xtext_encode
from pepsi.mail.relay.attempt import Outgoing, Peer, recipient_results, reply_text
from pepsi.mail.relay.delivery import Result
from pepsi.mail.relay.slots import Slots

IDLE_LIMIT = 30.0  # a cached connection unused this long is closed, not reused
COMMAND_TIMEOUT = 300.0  # RFC 5321 §4.5.3.2's shortest: a reply must come within


class Unreachable(Exception):
    """No SMTP session with this host (refused, timed out, a 4xx/5xx greeting, TLS, AUTH)."""

    def __init__(self, text: str, code: int = 0) -> None:
        super().__init__(text)
        self.code = code  # 0: no reply; a 5xx greeting is still a host problem: temporary


@dataclass
class _Open:
    smtp: smtplib.SMTP
    slot: int
    used: float


class Client:
    """One worker's SMTP client, its open connections and their slots."""

    def __init__(
        self, *, helo: str, connect_timeout: float, slots: Slots, idle_limit: float = IDLE_LIMIT
    ) -> None:
        self.helo = helo
        self.connect_timeout = connect_timeout
        self.slots = slots
        self.idle_limit = idle_limit
        self.open: dict[tuple[str, int], _Open] = {}

    def send(self, destination: str, peers: Sequence[Peer], message: Outgoing) -> dict[str, Result]:
        """Try `peers` in order until one answers; a result per recipient of `message`."""
        problems: list[str] = []
        for peer in peers:
            try:
                session = self._session(destination, peer)
            except Unreachable as exc:
                problems.append(str(exc))
                continue
            try:
                return self._transaction(session, peer, message)
            except _Stale:  # a cached connection the server had closed: once more, anew
                self._drop(peer)
                try:
                    session = self._session(destination, peer)
                    return self._transaction(session, peer, message)
                except Unreachable as exc:
                    problems.append(str(exc))
                except _Stale as exc:
                    problems.append(f"{peer}: connection lost: {exc.__cause__}")
        text = "; ".join(problems) or f"{destination}: no host to try"
        return {r: Result(0, text) for r in message.recipients}

    def close(self) -> None:
        for key in list(self.open):
            self._drop_key(key)

    # -- sessions --------------------------------------------------------------------------

    def _session(self, destination: str, peer: Peer) -> _Open:
        key = (peer.address, peer.port)
        cached = self.open.get(key)
        if cached is not None:
            if time.monotonic() - cached.used <= self.idle_limit:
                return cached
            self._drop_key(key)
        slot = self.slots.take(destination)
        if slot is None:
            raise Unreachable(
                f"{destination}: {self.slots.limit} connections open already (the limit)"
            )
        try:
            smtp = self._connect(peer)
        except BaseException:
            self.slots.give_back(slot)
            raise
        opened = _Open(smtp, slot, time.monotonic())
        self.open[key] = opened
        return opened

    def _connect(self, peer: Peer, *, plain: bool = False) -> smtplib.SMTP:
        tls = "none" if plain else peer.tls
        smtp: smtplib.SMTP
        try:
            if tls == "implicit":
                smtp = smtplib.SMTP_SSL(
                    peer.address, peer.port, local_hostname=self.helo,
                    timeout=self.connect_timeout, context=_context(peer, verify=True),
                )  # fmt: skip
            else:
                smtp = smtplib.SMTP(
                    peer.address, peer.port, local_hostname=self.helo, timeout=self.connect_timeout
                )
        except smtplib.SMTPConnectError as exc:
            raise Unreachable(
                f"{peer}: greeting {exc.smtp_code} {reply_text(exc.smtp_error)}"
            ) from None
        except (OSError, smtplib.SMTPException) as exc:
            raise Unreachable(f"{peer}: {_oserror(exc)}") from None
        try:
            if smtp.sock is not None:
                smtp.sock.settimeout(COMMAND_TIMEOUT)
            _ehlo(smtp, peer)
            if tls in ("starttls", "may") and smtp.has_extn("starttls"):
                smtp.starttls(context=_context(peer, verify=tls == "starttls"))
                _ehlo(smtp, peer)
            elif tls == "starttls":
                raise Unreachable(f"{peer}: STARTTLS is required but not offered")
            if peer.login is not None:
                smtp.login(*peer.login)
        except ssl.SSLError as exc:
            _quit(smtp)
            if tls == "may":  # opportunistic: the message goes in plain text instead
                return self._connect(peer, plain=True)
            raise Unreachable(f"{peer}: TLS failed: {exc}") from None
        except smtplib.SMTPAuthenticationError as exc:
            _quit(smtp)
            refused = f"{exc.smtp_code} {reply_text(exc.smtp_error)}"
            raise Unreachable(f"{peer}: AUTH refused: {refused}") from None
        except (OSError, smtplib.SMTPException) as exc:
            _quit(smtp)
            raise Unreachable(f"{peer}: {_oserror(exc)}") from None
        return smtp

    def _drop(self, peer: Peer) -> None:
        self._drop_key((peer.address, peer.port))

    def _drop_key(self, key: tuple[str, int]) -> None:
        opened = self.open.pop(key, None)
        if opened is not None:
            _quit(opened.smtp)
            self.slots.give_back(opened.slot)

    # -- one message -----------------------------------------------------------------------

    def _transaction(self, session: _Open, peer: Peer, message: Outgoing) -> dict[str, Result]:
        smtp = session.smtp
        dsn = smtp.has_extn("dsn")
        problem = _utf8_problem(smtp, message)
        if problem is not None:
            return {r: Result(553, f"{peer}: {problem}", "5.6.7") for r in message.recipients}
        commands = _envelope(smtp, message, dsn=dsn)  # MAIL, a RCPT per recipient, DATA
        replies: list[tuple[int, bytes]] = []
        final: tuple[int, bytes] | None = None  # the reply to the data
        try:
            if smtp.has_extn("pipelining"):  # RFC 2920: the whole envelope in one write
                smtp.send(b"".join(commands))
                replies.extend(smtp.getreply() for _ in commands)
            else:  # one command at a time, and no further than useful
                for command in commands:
                    if command is commands[-1] and not _accepted(message, replies):
                        break
                    smtp.send(command)
                    replies.append(smtp.getreply())
                    if replies[0][0] != 250:
                        break
            if replies[-1][0] == 354:  # DATA may go ahead (if nobody was accepted: empty)
                smtp.send(stuff(message.data) if _accepted(message, replies) else b".\r\n")
                final = smtp.getreply()
            if final is None or final[0] != 250:
                smtp.rset()
        except (OSError, smtplib.SMTPException) as exc:
            if not replies:
                raise _Stale from exc  # not even MAIL was answered: safe to try again
            # The connection went in the middle: whoever has no final reply is tried
            # again. After the data was sent, that may deliver twice (SMTP cannot tell).
            self._drop(peer)
            lost = Result(0, f"{peer}: connection lost: {_oserror(exc)}")
            ended = recipient_results(peer, message, replies, final, dsn=dsn)
            return {r: ended.get(r, lost) for r in message.recipients}
        session.used = time.monotonic()
        return recipient_results(peer, message, replies, final, dsn=dsn)


class _Stale(Exception):
    """A reused connection was closed by the server before anything was sent."""


def _ehlo(smtp: smtplib.SMTP, peer: Peer) -> None:
    code, reply = smtp.ehlo()
    if not 200 <= code < 300:
        code, reply = smtp.helo()
        if not 200 <= code < 300:
            raise Unreachable(f"{peer}: HELO refused: {code} {reply_text(reply)}", code)


def _context(peer: Peer, *, verify: bool) -> ssl.SSLContext:
    return _tls_context(verify, peer.ca_file if verify else None)


@functools.cache
def _tls_context(verify: bool, ca_file: Path | None) -> ssl.SSLContext:
    """One context per kind, reused by every connection (loading the CAs takes ~20 ms)."""
    if not verify:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    return ssl.create_default_context(cafile=str(ca_file) if ca_file else None)


def _mail_options(smtp: smtplib.SMTP, message: Outgoing, *, dsn: bool) -> list[str]:
    options = []
    if smtp.has_extn("size"):
        options.append(f"SIZE={len(message.data)}")
    eight_bit = message.smtp.get("body") == "8BITMIME" or not message.data.isascii()
    if eight_bit and smtp.has_extn("8bitmime"):
        options.append("BODY=8BITMIME")
    if _needs_utf8(message) and smtp.has_extn("smtputf8"):
        options.append("SMTPUTF8")
    if dsn:
        if message.smtp.get("ret"):
            options.append(f"RET={message.smtp['ret']}")
        if message.smtp.get("envid"):
            options.append(f"ENVID={xtext_encode(message.smtp['envid'])}")
    return options


def _rcpt_options(params: Mapping[str, Any]) -> list[str]:
    options = []
    if params.get("notify"):
        options.append("NOTIFY=" + ",".join(params["notify"]))
    if params.get("orcpt"):
        kind, _, address = str(params["orcpt"]).partition(";")
        options.append(f"ORCPT={kind};{xtext_encode(address)}")
    return options


def _envelope(smtp: smtplib.SMTP, message: Outgoing, *, dsn: bool) -> list[bytes]:
    """MAIL, a RCPT per recipient and DATA, each a command line."""
    rcpt = message.smtp.get("rcpt", {})
    lines = [_command("MAIL FROM:", message.sender, _mail_options(smtp, message, dsn=dsn))]
    for recipient in message.recipients:
        options = _rcpt_options(rcpt.get(recipient, {})) if dsn else []
        lines.append(_command("RCPT TO:", recipient, options))
    lines.append(b"DATA\r\n")
    return lines


def _command(verb: str, address: str, options: list[str]) -> bytes:
    # UTF-8 only reaches here with SMTPUTF8 (_utf8_problem)
    return " ".join([f"{verb}<{address}>", *options]).encode() + b"\r\n"


def _accepted(message: Outgoing, replies: list[tuple[int, bytes]]) -> bool:
    """Whether a RCPT among `replies` (MAIL's first) was accepted."""
    return any(code in (250, 251) for code, _ in replies[1 : 1 + len(message.recipients)])


def _needs_utf8(message: Outgoing) -> bool:
    """An address beyond ASCII can only go with SMTPUTF8 (RFC 6531), flagged or not."""
    return not (message.sender.isascii() and all(r.isascii() for r in message.recipients))


def _utf8_problem(smtp: smtplib.SMTP, message: Outgoing) -> str | None:
    if _needs_utf8(message) and not smtp.has_extn("smtputf8"):
        return "the next hop does not take SMTPUTF8, which this message's addresses need"
    return None


def _oserror(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout | TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _quit(smtp: smtplib.SMTP) -> None:
    with contextlib.suppress(OSError, smtplib.SMTPException):
        smtp.quit()
    with contextlib.suppress(OSError):
        smtp.close()
