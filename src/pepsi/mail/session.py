"""One SMTP or LMTP session, on aiosmtpd's protocol: the commands, the DATA, the reply.

aiosmtpd reads command lines, dispatches them, and does STARTTLS, AUTH's
challenges, HELO, NOOP, RSET, VRFY, HELP and QUIT. Pepsi's session replaces
what the confirm and the policy need: EHLO (the extensions offered), MAIL and
RCPT (DSN parameters, relay control, limits), DATA (read to
<CR><LF>.<CR><LF> only, bounded, committed before the reply), the checks of
an AUTH login (off the event loop, slowed down after failures), enhanced
status codes on every reply, and a 421 before a timeout or a refusal closes
the connection. The decisions are in `policy`, `envelope` and `content`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import math
import ssl
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiosmtpd.smtp import SMTP, AuthResult, _AuthMechAttr

from pepsi.config.model import IngressOptions
from pepsi.mail import content, envelope, policy, replies
from pepsi.mail.committer import Committer
from pepsi.mail.envelope import MailParameters, ParameterError, RcptParameters
from pepsi.mail.replies import Reply
from pepsi.publishing import OutgoingMessage
from pepsi.publishing.message import is_address

log = logging.getLogger("pepsi.ingress")

# The reader's buffer: command lines are still held to command_size_limits, but
# DATA arrives in chunks of up to this much.
READ_LIMIT = 64 * 1024
COMMAND_LIMITS = {"MAIL": 1024, "RCPT": 1024, "AUTH": 2048}  # with ESMTP parameters
DEFAULT_COMMAND_LIMIT = 512  # RFC 5321 §4.5.3.1.4
TEMPORARY_AUTH_FAILURE = "454 4.7.0 Temporary authentication failure, try again later"


@dataclass
class Ingress:
    """What every session of one server shares."""

    options: IngressOptions
    stage: str
    hostname: str
    committer: Committer
    check_login: Callable[[str, bytes], Awaitable[bool]]  # raises on a database failure
    tls: ssl.SSLContext | None = None
    admission: policy.Admission = field(init=False)
    throttle: policy.AuthThrottle = field(init=False)
    sessions: set[SmtpSession] = field(default_factory=set)

    def __post_init__(self) -> None:
        options = self.options
        self.admission = policy.Admission(options.max_connections, options.client_connection_limit)
        self.throttle = policy.AuthThrottle(asyncio.get_running_loop().time)


class SmtpSession(SMTP):
    """An ESMTP session (RFC 5321); `LmtpSession` is the LMTP one (RFC 2033)."""

    line_length_limit = READ_LIMIT
    greeting = "ESMTP Pepsi"
    protocol_name = "ESMTP"

    def __init__(self, ingress: Ingress, *, local_user: str | None = None) -> None:
        # What SMTP.__init__ sets, without its per-connection reflection (inspect.getmembers
        # of the session and dir() of the handler: a fifth of the server's CPU under
        # smtp-source). The tables it built are built once per class (`_commands`).
        loop = asyncio.get_running_loop()
        asyncio.StreamReaderProtocol.__init__(
            self,
            asyncio.StreamReader(loop=loop, limit=READ_LIMIT),
            client_connected_cb=self._cb_client_connected,
            loop=loop,
        )
        self.__ident__ = self.greeting
        self.loop = loop
        self.event_handler = _NO_HOOKS
        self.data_size_limit = ingress.options.max_size
        self.enable_SMTPUTF8 = True
        self._decode_data = False
        self.hostname = ingress.hostname
        self.tls_context = ingress.tls
        self.require_starttls = False
        self._timeout_duration = ingress.options.timeout
        self._timeout_handle: asyncio.TimerHandle | None = None
        self._deadline = math.inf
        self._tls_handshake_okay = True
        self._tls_protocol = None
        self._original_transport = None
        self.session = None
        self.envelope = None
        self.transport = None
        self._handler_coroutine = None
        self._auth_require_tls = True
        self._proxy_timeout = None
        self._authenticator = None
        self._auth_callback = None
        self._auth_required = False
        self._handle_hooks = {}
        self._ehlo_hook_ver = None
        self._enforce_call_limit = False
        commands, mechanisms = _commands(type(self))
        self._smtp_methods = {verb: getattr(self, name) for verb, name in commands.items()}
        self._auth_methods = {
            mechanism: _AuthMechAttr(getattr(self, name), True)
            for mechanism, name in mechanisms.items()
        }
        self.ingress = ingress
        self.command_size_limits = defaultdict(lambda: DEFAULT_COMMAND_LIMIT, COMMAND_LIMITS)
        self.local_user = local_user  # a UNIX socket's peer, known by its credentials
        self.address: policy.IPAddress | None = None
        self.client = "local"
        self.admitted = False
        self.trusted = local_user is not None
        self.committing = False
        self.mail: MailParameters | None = None
        self.sender = ""
        self.recipients: dict[str, RcptParameters] = {}

    # -- connection -----------------------------------------------------------------------

    async def _handle_client(self) -> None:
        assert self.session is not None
        options = self.ingress.options
        self.address = policy.peer_address(_host(self.session.peer))
        self.client = policy.client_key(self.address)
        loopback = self.address is not None and self.address.is_loopback
        self.trusted = self.trusted or policy.in_networks(self.address, options.relay_networks)
        self._auth_require_tls = not (loopback or self.local_user is not None)
        refusal = self.ingress.admission.admit(
            self.client, exempt=self.trusted or self.local_user is not None
        )
        if refusal is not None:
            log.warning("refused a connection from %s: %s", self.client, refusal.text)
            await self.push(str(refusal))
            self._close()
            return
        self.admitted = True
        self.ingress.sessions.add(self)
        await super()._handle_client()

    def connection_lost(self, error: Exception | None) -> None:
        if self.admitted:
            self.admitted = False
            self.ingress.admission.release(self.client)
            self.ingress.sessions.discard(self)
        super().connection_lost(error)

    def _reset_timeout(self, duration: float | None = None) -> None:
        """Move the deadline; one timer per session, rearmed only when it fires early.

        aiosmtpd cancels and schedules a timer for every command.
        """
        self._deadline = self.loop.time() + (duration or self._timeout_duration)
        if self._timeout_handle is None or self._timeout_handle.cancelled():
            self._timeout_handle = self.loop.call_at(self._deadline, self._timeout_cb)

    def _pause_timeout(self) -> None:
        """No deadline while the server, not the client, is the one being waited for."""
        self._deadline = math.inf

    def _timeout_cb(self) -> None:
        now = self.loop.time()
        if now < self._deadline:  # moved since: wait for the new deadline
            when = self._deadline if self._deadline < math.inf else now + self._timeout_duration
            self._timeout_handle = self.loop.call_at(when, self._timeout_cb)
            return
        if self.transport is not None and not self.transport.is_closing():
            self._writer.write(f"{replies.TIMEOUT}\r\n".encode())
        super()._timeout_cb()  # type: ignore[no-untyped-call]  # aiosmtpd's, untyped

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def goodbye(self, reply: Reply) -> None:
        """Close an idle session with `reply` (at shutdown)."""
        if self.transport is not None and not self.transport.is_closing():
            self._writer.write(f"{reply}\r\n".encode())
            self._close()

    async def handle_exception(self, error: Exception) -> str:
        """A bug in a command's handling: logged; the client is told to try again later."""
        log.error("session with %s failed", self.client, exc_info=error)
        self._set_rset_state()  # type: ignore[no-untyped-call]
        return str(replies.NOT_STORED.with_text("Internal error, try again later"))

    async def push(self, status: str | bytes) -> None:
        if isinstance(status, str):
            await super().push(replies.enhance(status))
        else:
            await super().push(status)

    async def _push_lines(self, lines: list[str]) -> None:
        """A multi-line reply as it is (EHLO's carries no enhanced code), in one write."""
        text = "".join(f"{line}\r\n" for line in lines)
        self._writer.write(text.encode("utf-8"))
        await self._writer.drain()

    def _set_post_data_state(self) -> None:
        super()._set_post_data_state()  # type: ignore[no-untyped-call]
        self.mail = None
        self.sender = ""
        self.recipients = {}

    # -- greeting -------------------------------------------------------------------------

    async def smtp_HELO(self, hostname: str | None) -> None:
        if not hostname:
            await self.push("501 Syntax: HELO hostname")
            return
        self._greeted(hostname, extended=False)
        await self._push_lines([f"250 {self.hostname}"])

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
        if self._auth_offered():
            offered.append("AUTH PLAIN LOGIN")
        lines = [f"250-{word}" for word in offered[:-1]]
        await self._push_lines([*lines, f"250 {offered[-1]}"])

    def _greeted(self, hostname: str, *, extended: bool) -> None:
        assert self.session is not None
        self._set_rset_state()  # type: ignore[no-untyped-call]
        self.session.host_name = hostname
        self.session.extended_smtp = extended

    def _auth_offered(self) -> bool:
        assert self.session is not None
        tls_ok = not self._auth_require_tls or self._tls_protocol is not None
        return tls_ok and not self.session.authenticated and self.local_user is None

    # -- AUTH -----------------------------------------------------------------------------

    async def smtp_AUTH(self, arg: str) -> None:
        if self.mail is not None:  # RFC 4954 §4: not within a mail transaction
            await self.push("503 5.5.1 AUTH not permitted during a mail transaction")
            return
        await super().smtp_AUTH(arg)

    async def auth_PLAIN(self, _: SMTP, args: list[str]) -> AuthResult:
        response = await (self.challenge_auth("") if len(args) == 1 else self._decode(args[1]))
        if not isinstance(response, bytes):  # aborted or undecodable: answered already
            return AuthResult(success=False, handled=True)
        parts = response.split(b"\0")
        if len(parts) != 3:
            await self.push("501 5.5.2 Cannot split the PLAIN response")
            return AuthResult(success=False, handled=True)
        return await self._login(parts[1], parts[2])

    async def auth_LOGIN(self, _: SMTP, args: list[str]) -> AuthResult:
        login = await (
            self.challenge_auth("Username:") if len(args) == 1 else self._decode(args[1])
        )
        if not isinstance(login, bytes):
            return AuthResult(success=False, handled=True)
        password = await self.challenge_auth("Password:")
        if not isinstance(password, bytes):
            return AuthResult(success=False, handled=True)
        return await self._login(login, password)

    async def _decode(self, text: str) -> bytes | None:
        """An initial response in base64; None (after a 501) if it is not."""
        try:
            return base64.b64decode(text.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError):
            await self.push("501 5.5.2 Cannot decode base64")
            return None

    async def _login(self, login: bytes, password: bytes) -> AuthResult:
        try:
            name = login.decode("utf-8")
            valid = "\0" not in name and await self.ingress.check_login(name, password)
        except UnicodeDecodeError:
            valid = False
        except Exception as exc:  # noqa: BLE001  # the database, not the client: try later
            log.warning("AUTH for %s could not be checked: %s", self.client, exc)
            return AuthResult(success=False, handled=False, message=TEMPORARY_AUTH_FAILURE)
        throttle = self.ingress.throttle
        if valid:
            throttle.succeeded(self.client)
            return AuthResult(success=True, auth_data=name, message=str(replies.AUTH_OK))
        throttle.failed(self.client)
        delay = throttle.delay(self.client)
        log.warning("AUTH failed from %s (next answer in %.1fs)", self.client, delay)
        await asyncio.sleep(delay)
        return AuthResult(success=False, handled=False, message=str(replies.AUTH_FAILED))

    # -- the envelope ---------------------------------------------------------------------

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
                utf8_offered=True,
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
        message = await self._read_data()
        slots = self._reply_slots()
        if message is None:
            reply = replies.TOO_BIG
        else:
            self.committing = True
            self._pause_timeout()  # the wait is ours, not the client's
            try:
                reply = await self._commit(message)
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

    async def _commit(self, message: bytes) -> Reply:
        assert self.mail is not None
        assert self.session is not None
        header, body = content.split_message(message)
        extracted = content.extract(header)
        queue_id = content.new_queue_id()
        recipients = list(self.recipients)
        login = self.local_user or (self.session.auth_data if self.session.authenticated else None)
        received = content.received(
            helo=self.session.host_name,
            peer=None if self.address is None else str(self.address),
            hostname=self.hostname,
            protocol=self._protocol(bool(self.session.authenticated)),
            queue_id=queue_id,
            recipients=recipients,
            tls=_tls_version(self._tls_protocol is not None, self.session.ssl),
            when=datetime.now(UTC),
        )
        outgoing = OutgoingMessage(
            self.ingress.stage,
            body,
            received + header,
            sender=self.sender,
            recipients=tuple(recipients),
            origin_user=login,
            origin_peer=None if self.address is None else str(self.address),
            message_id=extracted.message_id,
            header_from=extracted.header_from,
            subject=extracted.subject,
            properties={
                "smtp": envelope.smtp_properties(self.mail, self.recipients, queue_id=queue_id)
            },
        )
        reply, workqueue_id = await self.ingress.committer.commit(outgoing, queue_id)
        if workqueue_id is not None:
            log.info(
                "id %s: from=<%s> nrcpt=%d size=%d client=%s%s: stored as %d",
                queue_id, self.sender, len(recipients), len(message), self.client,
                f" user={login}" if login else "", workqueue_id,
            )  # fmt: skip
        return reply

    def _protocol(self, authenticated: bool) -> str:
        """RFC 3848's WITH keyword: ESMTP, ESMTPS, ESMTPA, ESMTPSA (LMTP likewise)."""
        assert self.session is not None
        if not self.session.extended_smtp:
            return "SMTP"
        suffix = ("S" if self._tls_protocol is not None else "") + ("A" if authenticated else "")
        return self.protocol_name + suffix


class LmtpSession(SmtpSession):
    """LMTP (RFC 2033): LHLO instead of HELO/EHLO, and a reply per recipient after DATA."""

    greeting = "LMTP Pepsi"
    protocol_name = "LMTP"

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


class _NoHooks:
    """aiosmtpd's handler: the session itself answers every command."""


_NO_HOOKS = _NoHooks()


_COMMANDS: dict[type, tuple[dict[str, str], dict[str, str]]] = {}


def _commands(kind: type) -> tuple[dict[str, str], dict[str, str]]:
    """A session class's commands (`smtp_VERB`) and AUTH mechanisms (`auth_MECHANISM`)."""
    found = _COMMANDS.get(kind)
    if found is None:
        names = dir(kind)
        commands = {name[5:]: name for name in names if name.startswith("smtp_")}
        mechanisms = {name[5:]: name for name in names if name.startswith("auth_")}
        found = _COMMANDS[kind] = (commands, mechanisms)
    return found


def _host(peer: Any) -> str | None:
    """The address part of a socket's peer name (a tuple for TCP; '' for a UNIX socket)."""
    return str(peer[0]) if isinstance(peer, tuple) and peer else None


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


def _tls_version(on: bool, info: dict[str, Any] | None) -> str | None:
    if not on:
        return None
    ssl_object = (info or {}).get("ssl_object")
    version = ssl_object.version() if ssl_object is not None else None
    cipher = ssl_object.cipher() if ssl_object is not None else None
    if version and cipher:
        return f"{version} with cipher {cipher[0]}"
    return version or "TLS"
