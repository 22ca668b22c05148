"""Who may use the console and how a request proves it. Pure: no I/O, the clock injected.

- **Sessions** are signed cookies: `payload.signature`, the payload a JSON object
  with an expiry and the session's CSRF token, signed with HMAC-SHA256 under a
  secret drawn when the console starts (so a restart logs everybody out). Nothing
  is stored on the server.
- **CSRF**: every form that changes something carries the session's token, and a
  POST must also come from the console's own origin (`Origin`, else `Referer`).
  With the cookie's SameSite=Strict that makes three independent checks.
- **Access**: every page needs a session. With a password configured, a login
  makes one; without, the console's token does (`pepsi.web.tokens`), the console
  serves only loopback clients, and it repairs nothing.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from pepsi.config.values import is_loopback

COOKIE = "pepsi_session"
CSRF_FIELD = "csrf"


@dataclass(frozen=True)
class Session:
    expires: float
    csrf: str
    user: str = "admin"


class Sessions:
    """Signs and checks session cookies."""

    def __init__(self, ttl: float, clock: Callable[[], float], secret: bytes | None = None):
        self.ttl = ttl
        self.clock = clock
        self._secret = secret if secret is not None else secrets.token_bytes(32)
        # sessions logged out before their expiry, by their CSRF token (unique to each):
        # a copied cookie must not outlive a logout. In memory: a restart draws a new secret,
        # which ends every session anyway.
        self._revoked: dict[str, float] = {}

    def revoke(self, session: Session) -> None:
        """Log `session` out: its cookie reads as no session from now on."""
        now = self.clock()
        self._revoked = {token: exp for token, exp in self._revoked.items() if exp > now}
        self._revoked[session.csrf] = session.expires

    def new(self, user: str = "admin") -> tuple[Session, str]:
        """A fresh session and its cookie value."""
        session = Session(self.clock() + self.ttl, secrets.token_urlsafe(24), user)
        payload = json.dumps(
            {"exp": session.expires, "csrf": session.csrf, "user": user}, separators=(",", ":")
        ).encode()
        encoded = base64.urlsafe_b64encode(payload).decode().rstrip("=")
        return session, f"{encoded}.{self._sign(encoded)}"

    def read(self, cookie: str | None) -> Session | None:
        """The session a cookie holds, or None (absent, forged, expired, malformed)."""
        if not cookie or cookie.count(".") != 1:
            return None
        encoded, signature = cookie.split(".")
        if not hmac.compare_digest(signature, self._sign(encoded)):
            return None
        try:
            data = json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
            session = Session(float(data["exp"]), str(data["csrf"]), str(data["user"]))
        except (ValueError, KeyError, TypeError):
            return None
        if session.expires <= self.clock() or session.csrf in self._revoked:
            return None
        return session

    def _sign(self, encoded: str) -> str:
        digest = hmac.new(self._secret, encoded.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def same_origin(
    origin: str | None,
    referer: str | None,
    host: str | None,
    scheme: str,
    public_url: str | None = None,
) -> bool:
    """Whether a POST comes from the console's own pages: its Origin (or, when a
    browser sends none, its Referer) names this scheme and host, or the console's
    PUBLIC_URL (behind a TLS proxy the browser's scheme is not the console's)."""
    source = origin if origin and origin != "null" else referer
    if not source:
        return False
    parts = urlsplit(source)
    seen = (parts.scheme, parts.netloc.lower())
    if public_url is not None:
        public = urlsplit(public_url)
        if seen == (public.scheme, public.netloc.lower()):
            return True
    return bool(host) and seen == (scheme, (host or "").lower())


def host_allowed(host: str | None, listen_host: str, public_url: str | None = None) -> bool:
    """Whether a request's Host names this console: an IP address, `localhost`, the name
    it listens on, or its PUBLIC_URL's host. A page of another site rebound to this
    address (DNS rebinding) comes with that site's name, and is answered 421."""
    if not host:
        return False
    name = urlsplit(f"//{host}").hostname or ""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        pass
    else:
        return True
    allowed = {"localhost", listen_host.strip("[]").lower()}
    if public_url is not None:
        allowed.add((urlsplit(public_url).hostname or "").lower())
    return name.lower() in allowed


def local_path(target: str | None, default: str = "/") -> str:
    """A same-site path to send a browser to (a login's `next`, a repair's way back), or
    `default`: one `/`, then no second `/` or `\\` (a browser reads both as another
    host), no control character and no whitespace anywhere (a browser drops a tab or a
    newline, which turned `/%09/evil.example` into `//evil.example`)."""
    if (
        not target
        or not target.startswith("/")
        or target[1:2] in ("/", "\\")
        or "\\" in target
        or any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in target)
    ):
        return default
    return target


class LoginThrottle:
    """Failed logins slow their client down: after the n-th failure in a row, the next
    try is refused (429) for 2^(n-1) s, at most MAX_WAIT; a success forgets the client.
    Refused tries hash nothing, so a flood of wrong passwords costs no CPU."""

    MAX_WAIT = 60.0
    FORGET_AFTER = 900.0  # seconds a quiet client's failures are kept

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._clients: dict[str, tuple[int, float]] = {}  # client -> (failures, allowed at)

    def wait(self, client: str | None) -> float:
        """Seconds before `client` may try again (0: now)."""
        entry = self._clients.get(client or "")
        return 0.0 if entry is None else max(0.0, entry[1] - self.clock())

    def failed(self, client: str | None) -> None:
        now = self.clock()
        self._clients = {c: e for c, e in self._clients.items() if now - e[1] < self.FORGET_AFTER}
        failures = self._clients.get(client or "", (0, now))[0] + 1
        self._clients[client or ""] = (failures, now + min(2.0 ** (failures - 1), self.MAX_WAIT))

    def succeeded(self, client: str | None) -> None:
        self._clients.pop(client or "", None)


def csrf_ok(session: Session | None, submitted: str | None) -> bool:
    return (
        session is not None
        and submitted is not None
        and hmac.compare_digest(session.csrf.encode(), submitted.encode())
    )


@dataclass(frozen=True)
class Access:
    """What one request may do."""

    allowed: bool  # may see the console at all
    needs_login: bool  # no session yet: send it to the login page
    can_repair: bool
    user: str | None  # for the log of repairs


def access(
    *, password_set: bool, read_only: bool, session: Session | None, peer: str | None
) -> Access:
    if not password_set and not is_loopback(peer):  # no password: this machine only
        return Access(False, False, False, None)
    if session is None:  # a login, or without a password the token
        return Access(False, True, False, None)
    # without a password, a token's session only looks: repairs need a login
    return Access(True, False, password_set and not read_only, session.user)


def token_ok(expected: str | None, given: object) -> bool:
    return (
        expected is not None
        and isinstance(given, str)
        and hmac.compare_digest(expected.encode(), given.encode())
    )
