"""One connection to the ingress, on aiosmtpd's protocol: everything but the mail commands.

aiosmtpd reads command lines, dispatches them, and does STARTTLS, HELO, NOOP,
RSET, VRFY, HELP and QUIT. `Connection` is the plumbing Pepsi puts under it:
a constructor without aiosmtpd's per-connection reflection, admission (a 421
when the server or this client has too many sessions), one timer per session
with a 421 before a timeout closes it, an enhanced status code on every
reply, and a bug answered 451 rather than with its traceback. `auth.py` adds
AUTH, `session.py` the mail transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import ssl
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiosmtpd.smtp
from aiosmtpd.smtp import SMTP, TLSSetupException, _AuthMechAttr

from pepsi.config.model import IngressOptions
from pepsi.mail.ingress import policy
from pepsi.mail.ingress.committer import Committer
from pepsi.mail.protocol import replies
from pepsi.mail.protocol.replies import Reply

log = logging.getLogger("pepsi.ingress")

# The reader's buffer: command lines are still held to command_size_limits, but
# DATA arrives in chunks of up to this much.
READ_LIMIT = 64 * 1024
COMMAND_LIMITS = {"MAIL": 1024, "RCPT": 1024, "AUTH": 2048}  # with ESMTP parameters
DEFAULT_COMMAND_LIMIT = 512  # RFC 5321 §4.5.3.1.4


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
    sessions: set[Connection] = field(default_factory=set)

    def __post_init__(self) -> None:
        options = self.options
        self.admission = policy.Admission(options.max_connections, options.client_connection_limit)
        self.throttle = policy.AuthThrottle(asyncio.get_running_loop().time)


class Connection(SMTP):
    """A client's connection: admitted, timed, answered with enhanced codes."""

    line_length_limit = READ_LIMIT
    greeting = "ESMTP Pepsi"

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
        self._smtp_methods = _BoundCommands(self, commands)  # type: ignore[assignment]
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
            with contextlib.suppress(ConnectionError):
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
        """A bug in a command's handling: logged; the client is told to try again later.

        A failed TLS handshake is the client's business: one line (aiosmtpd closes).
        """
        if isinstance(error, TLSSetupException):
            log.info("TLS handshake with %s failed: %s", self.client, error.__cause__)
            return str(replies.TLS_FAILED)
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


class _BoundCommands(Mapping[str, Any]):
    """The session's `smtp_VERB` methods by verb, each bound when asked for: aiosmtpd's
    dict binds all thirteen for every connection (6 µs), which uses five or six."""

    __slots__ = ("names", "session")

    def __init__(self, session: Connection, names: dict[str, str]) -> None:
        self.session = session
        self.names = names

    def __getitem__(self, verb: str) -> Any:
        return getattr(self.session, self.names[verb])

    def get(self, verb: str, default: Any = None) -> Any:  # aiosmtpd's look-up, per command
        name = self.names.get(verb)
        return default if name is None else getattr(self.session, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_SANITIZED_LOG = aiosmtpd.smtp.sanitized_log


def _sanitized_log(func: Callable[..., None], msg: Any, *args: Any, **kwargs: Any) -> None:
    """aiosmtpd's `sanitized_log`, skipped when its logger would drop the line."""
    logger = getattr(func, "__self__", None)
    level = _LEVELS.get(getattr(func, "__name__", ""))
    if isinstance(logger, logging.Logger) and level is not None and not logger.isEnabledFor(level):
        return
    _SANITIZED_LOG(func, msg, *args, **kwargs)


def skip_dropped_command_logs() -> None:
    """aiosmtpd hides AUTH secrets in every command line it reads before it hands the
    line to `mail.log`'s debug and info, which drop it unless --verbose: 1.9 µs twice a
    command, 0.7 with the check first (about 2 % of the ingress's CPU under smtp-source).
    Installs the check, in this process; idempotent."""
    aiosmtpd.smtp.sanitized_log = _sanitized_log


def _host(peer: Any) -> str | None:
    """The address part of a socket's peer name (a tuple for TCP; '' for a UNIX socket)."""
    return str(peer[0]) if isinstance(peer, tuple) and peer else None
