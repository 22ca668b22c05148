"""AUTH (RFC 4954, PLAIN and LOGIN) on a connection: the login checked off the loop, slowed down.

aiosmtpd sends the challenges and the reply; `Authenticating` decodes the
responses and checks the login through the server's `check_login` (the
user's scrypt hash, on a thread pool of its own), and a client whose login
fails waits longer before each `535` (`policy.AuthThrottle`). AUTH is offered
over TLS, or to a loopback client, never to a local LMTP peer (it is known).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging

from aiosmtpd.smtp import SMTP, AuthResult, syntax

from pepsi.errors import one_line
from pepsi.mail.ingress.connection import Connection
from pepsi.mail.protocol import replies

log = logging.getLogger("pepsi.ingress")

TEMPORARY_AUTH_FAILURE = "454 4.7.0 Temporary authentication failure, try again later"


class Authenticating(Connection):
    """A connection that takes AUTH PLAIN and LOGIN."""

    def in_transaction(self) -> bool:
        """Between MAIL and the end of DATA (the session says)."""
        return False

    @property
    def offers_auth(self) -> bool:
        """Whether EHLO offers AUTH now, and HELP lists it (not `auth_…`: a mechanism's name)."""
        if self.session is None:
            return False
        tls_ok = not self._auth_require_tls or self._tls_protocol is not None
        return tls_ok and not self.session.authenticated and self.local_user is None

    @syntax("AUTH <mechanism> [initial-response]", when="offers_auth")
    async def smtp_AUTH(self, arg: str) -> None:
        if self.in_transaction():  # RFC 4954 §4: not within a mail transaction
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
            log.warning("AUTH for %s could not be checked: %s", self.client, one_line(exc))
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
