"""The mail transaction of an SMTP or LMTP session: EHLO, MAIL, RCPT, DATA and the reply.

Pepsi's own answers to what the confirm and the policy need: EHLO (the
extensions offered), MAIL and RCPT (DSN parameters, relay control, limits),
and DATA: read to <CR><LF>.<CR><LF> only, bounded by MAX_SIZE, made into
one message (`message.py`) and committed before the reply, `250` only once
the commit is confirmed. The decisions are in `policy`, `envelope`,
`content` and `message`; `connection.py` and `auth.py` are the rest of the
session.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from typing import Any

from aiosmtpd.smtp import syntax

from pepsi.addresses import is_address
from pepsi.mail.ingress import policy
from pepsi.mail.ingress.auth import Authenticating
from pepsi.mail.ingress.connection import Ingress
from pepsi.mail.protocol import content, envelope, message, replies
from pepsi.mail.protocol.envelope import MailParameters, ParameterError, RcptParameters
from pepsi.mail.protocol.replies import Reply

log = logging.getLogger("pepsi.ingress")


class SmtpSession(Authenticating):
    """An ESMTP session (RFC 5321); `LmtpSession` is the LMTP one (RFC 2033)."""

    protocol_name = "ESMTP"

    def __init__(self, ingress: Ingress, *, local_user: str | None = None) -> None:
        super().__init__(ingress, local_user=local_user)
        self.mail: MailParameters | None = None
        self.sender = ""
        self.recipients: dict[str, RcptParameters] = {}

    def in_transaction(self) -> bool:
        return self.mail is not None

    def _set_post_data_state(self) -> None:
        super()._set_post_data_state()  # type: ignore[no-untyped-call]
        self.mail = None
        self.sender = ""
        self.recipients = {}

    # -- greeting -------------------------------------------------------------------------

    @syntax("HELO hostname")
    async def smtp_HELO(self, hostname: str | None) -> None:
        if not hostname:
            await self.push("501 Syntax: HELO hostname")
            return
        self._greeted(hostname, extended=False)
        await self._push_lines([f"250 {self.hostname}"])

    @syntax("EHLO hostname")
    async def smtp_EHLO(self, hostname: str | None) -> None:
        if not hostname:
            await self.push("501 Syntax: EHLO hostname")
            return
        await self._extended_greeting(hostname)

    async def _extended_greeting(self, hostname: str) -> None:
        self._greeted(hostname, extended=True)
        offered = [
            self.hostname, "PIPELINING", f"SIZE {self.ingress.options.max_size}", "8BITMIME",
            "SMTPUTF8", "ENHANCEDSTATUSCODES", "DSN",
        ]  # fmt: skip
        if self.tls_context is not None and self._tls_protocol is None:
            offered.append("STARTTLS")
        if self.offers_auth:
            offered.append("AUTH PLAIN LOGIN")
        lines = [f"250-{word}" for word in offered[:-1]]
        await self._push_lines([*lines, f"250 {offered[-1]}"])

    def _greeted(self, hostname: str, *, extended: bool) -> None:
        assert self.session is not None
        self._set_rset_state()  # type: ignore[no-untyped-call]
        self.session.host_name = hostname
        self.session.extended_smtp = extended

    # -- the envelope ---------------------------------------------------------------------

    @syntax("MAIL FROM:<address>", extended=" [SP <mail-parameters>]")
    async def smtp_MAIL(self, arg: str | None) -> None:
        if await self.check_helo_needed():
            return
        if self.mail is not None:
            await self.push(str(replies.NESTED_MAIL))
            return
        path = envelope.split_path(arg[5:]) if arg and arg[:5].upper() == "FROM:" else None
        if path is None:
            await self.push("501 5.5.4 Syntax: MAIL FROM:<address> [parameters]")
            return
        sender, words = path
        try:
            params = envelope.mail_parameters(
                words if self._extended() else _none(words),
                max_size=self.ingress.options.max_size,
            )
        except ParameterError as exc:
            await self.push(str(exc.reply))
            return
        problem = _address_problem(sender, params.smtputf8, null_ok=True)
        if problem is not None:
            await self.push(str(problem))
            return
        self.mail, self.sender = params, sender
        await self.push(str(replies.SENDER_OK))

    @syntax("RCPT TO:<address>", extended=" [SP <rcpt-parameters>]")
    async def smtp_RCPT(self, arg: str | None) -> None:
        if await self.check_helo_needed():
            return
        if self.mail is None:
            await self.push(str(replies.NEED_MAIL))
            return
        path = envelope.split_path(arg[3:]) if arg and arg[:3].upper() == "TO:" else None
        if path is None:
            await self.push("501 5.5.4 Syntax: RCPT TO:<address> [parameters]")
            return
        await self.push(str(self._recipient(*path)))

    def _recipient(self, address: str, words: list[str]) -> Reply:
        assert self.mail is not None
        assert self.session is not None
        options = self.ingress.options
        local_postmaster = address.lower() == "postmaster"  # RFC 5321 §4.5.1: always taken
        if local_postmaster:
            address = f"postmaster@{_served_domain(options.domains, self.hostname)}"
        try:
            params = envelope.rcpt_parameters(words if self._extended() else _none(words))
        except ParameterError as exc:
            return exc.reply
        problem = _address_problem(address, self.mail.smtputf8, null_ok=False)
        if problem is not None:
            return problem
        if address in self.recipients:
            return replies.RECIPIENT_OK  # kept once
        if len(self.recipients) >= options.max_recipients:
            return replies.TOO_MANY_RECIPIENTS
        trusted = self.trusted or bool(self.session.authenticated)
        if not local_postmaster and not policy.may_relay_to(
            address, options.domains, trusted=trusted
        ):
            log.warning("relay denied: %s from %s to <%s>", self.client, self.sender, address)
            return replies.RELAY_DENIED
        self.recipients[address] = params
        return replies.RECIPIENT_OK

    def _extended(self) -> bool:
        assert self.session is not None
        return bool(self.session.extended_smtp)

    # -- DATA -----------------------------------------------------------------------------

    @syntax("DATA")
    async def smtp_DATA(self, arg: str | None) -> None:
        if await self.check_helo_needed():
            return
        if self.mail is None:
            await self.push(str(replies.NEED_MAIL))
            return
        if not self.recipients:
            await self.push(str(replies.NEED_RCPT))
            return
        if arg:
            await self.push("501 5.5.4 Syntax: DATA")
            return
        await self.push(replies.START_DATA)
        data = await self._read_data()
        slots = self._reply_slots()
        if data is None:
            reply = replies.TOO_BIG
        else:
            self.committing = True
            self._pause_timeout()  # the wait is ours, not the client's
            try:
                reply = await self._commit(data)
            finally:
                self.committing = False
                self._reset_timeout()
        self._set_post_data_state()
        await self._push_lines([str(reply)] * slots)

    def _reply_slots(self) -> int:
        """How many replies DATA gets: one (SMTP), one per recipient (LMTP)."""
        return 1

    async def _read_data(self) -> bytes | None:
        """The message, once <CR><LF>.<CR><LF> has come; None if over MAX_SIZE."""
        collector = content.DataCollector(self.ingress.options.max_size)
        reader = self._reader
        while True:
            try:
                chunk = await reader.readuntil(content.END)
            except asyncio.LimitOverrunError as exc:
                chunk = await reader.readexactly(exc.consumed)
            except asyncio.IncompleteReadError:  # the client went away mid-DATA
                self._close()
                raise asyncio.CancelledError from None
            self._reset_timeout()  # progress: a slow but moving client is not cut off
            if collector.feed(chunk):
                return collector.message()

    async def _commit(self, data: bytes) -> Reply:
        assert self.mail is not None
        assert self.session is not None
        authenticated = bool(self.session.authenticated)
        tls = self._tls_protocol is not None
        arrival = message.Arrival(
            helo=self.session.host_name,
            peer=None if self.address is None else str(self.address),
            login=self.local_user or (str(self.session.auth_data) if authenticated else None),
            protocol=message.with_keyword(
                self.protocol_name,
                extended=bool(self.session.extended_smtp),
                tls=tls,
                authenticated=authenticated,
            ),
            tls=message.tls_description(_ssl_object(self.session.ssl)) if tls else None,
        )
        queue_id = content.new_queue_id()
        outgoing = message.build(
            data, stage=self.ingress.stage, sender=self.sender, recipients=self.recipients,
            mail=self.mail, arrival=arrival, hostname=self.hostname, queue_id=queue_id,
            now=datetime.now(UTC),
        )  # fmt: skip
        reply, workqueue_id = await self.ingress.committer.commit(outgoing, queue_id)
        if workqueue_id is not None:
            log.info(
                "id %s: from=<%s> nrcpt=%d size=%d client=%s%s: stored as %d",
                queue_id, self.sender, len(self.recipients), len(data), self.client,
                f" user={arrival.login}" if arrival.login else "", workqueue_id,
            )  # fmt: skip
        return reply


class LmtpSession(SmtpSession):
    """LMTP (RFC 2033): LHLO instead of HELO/EHLO, and a reply per recipient after DATA."""

    greeting = "LMTP Pepsi"
    protocol_name = "LMTP"

    @syntax("LHLO hostname")
    async def smtp_LHLO(self, hostname: str | None) -> None:
        if not hostname:
            await self.push("501 Syntax: LHLO hostname")
            return
        await self._extended_greeting(hostname)

    async def smtp_HELO(self, hostname: str | None) -> None:
        await self.push('500 5.5.1 Error: command "HELO" not recognized (LMTP: use LHLO)')

    async def smtp_EHLO(self, hostname: str | None) -> None:
        await self.push('500 5.5.1 Error: command "EHLO" not recognized (LMTP: use LHLO)')

    def _reply_slots(self) -> int:
        return len(self.recipients)


def _none(words: list[str]) -> list[str]:
    """HELO clients send no parameters: any word is a syntax error."""
    if words:
        raise ParameterError(replies.BAD_SYNTAX.with_text("Parameters need EHLO"))
    return words


def _address_problem(address: str, utf8: bool, *, null_ok: bool) -> Reply | None:
    if address == "" and null_ok:
        return None
    try:
        address.encode("utf-8")  # undecodable bytes arrive as lone surrogates
    except UnicodeEncodeError:
        return replies.BAD_ADDRESS
    if not is_address(address):
        return replies.BAD_ADDRESS
    if not utf8 and not address.isascii():
        return replies.NOT_ASCII
    return None


def _served_domain(domains: tuple[str, ...], hostname: str) -> str:
    return next((d for d in domains if not d.startswith(".")), hostname.lower())


def _ssl_object(info: dict[str, Any] | None) -> Any:
    return (info or {}).get("ssl_object")
