"""Who may log in and what they may touch, as RabbitMQ decides it (pure).

- Permissions: per user and vhost, three regular expressions (configure,
  write, read). A user may open a vhost if it has a permission row there at
  all. A resource is allowed if the pattern for the access is *found* in its
  name (RabbitMQ searches, it does not anchor: write `^orders$` to mean
  exactly `orders`); the empty pattern allows nothing. The default exchange
  '' is checked under the name `amq.default`.
- SASL: the PLAIN (`[authzid]\\0user\\0password`) and AMQPLAIN (a field table
  with LOGIN and PASSWORD) responses of connection.start-ok. A response that
  cannot be read is a `SaslError`, never another exception.
- Loopback users (`guest`): accepted only from 127.0.0.0/8 and ::1.

docs/amqp.md has which AMQP method needs which access to which resource.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache

from pepsi.amqp.auth import passwords
from pepsi.amqp.wire import replies, tables
from pepsi.errors import PepsiError

DEFAULT_EXCHANGE_RESOURCE = "amq.default"
LOOPBACK_USERS = frozenset({"guest"})
MECHANISMS = ("PLAIN", "AMQPLAIN")


class Access(Enum):
    CONFIGURE = "configure"
    WRITE = "write"
    READ = "read"


@dataclass(frozen=True)
class Permission:
    """One user's patterns in one vhost."""

    configure: str
    write: str
    read: str

    def pattern(self, access: Access) -> str:
        match access:
            case Access.CONFIGURE:
                return self.configure
            case Access.WRITE:
                return self.write
            case Access.READ:
                return self.read


def exchange_resource(name: str) -> str:
    """The name an exchange is checked under: the default exchange '' is `amq.default`."""
    return name or DEFAULT_EXCHANGE_RESOURCE


def pattern_problem(pattern: str) -> str | None:
    """Why `pattern` cannot be used as a permission (None: it can)."""
    try:
        re.compile(pattern)
    except re.error as exc:
        return f"invalid regular expression {pattern!r}: {exc}"
    return None


@lru_cache(maxsize=1024)
def _compiled(pattern: str) -> re.Pattern[str] | None:
    try:
        return re.compile(pattern or "^$")  # '' would match everything: RabbitMQ means nothing
    except re.error:
        return None  # a pattern written by hand that does not compile grants nothing


def can_open_vhost(permission: Permission | None) -> bool:
    """Whether a user with `permission` (None: no row) may open the vhost."""
    return permission is not None


def allowed(permission: Permission | None, access: Access, resource: str) -> bool:
    """Whether `access` to the resource named `resource` is granted.

    For an exchange pass `exchange_resource(name)`, so that '' is `amq.default`.
    """
    if permission is None:
        return False
    compiled = _compiled(permission.pattern(access))
    return compiled is not None and compiled.search(resource) is not None


# -- SASL ----------------------------------------------------------------------------------


class SaslError(PepsiError):
    """A SASL response that cannot be read: the login is refused."""


@dataclass(frozen=True)
class Credentials:
    """What a client logged in with; the password is kept out of repr and logs."""

    username: str
    password: bytes = field(repr=False)


def _raw(response: str | bytes) -> bytes:
    # pamqp hands a long string over as str when it decodes as UTF-8; that decoding
    # is undone exactly by encoding again.
    return response.encode("utf-8") if isinstance(response, str) else response


def _username(raw: bytes) -> str:
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SaslError("user name is not UTF-8") from None
    if not name:
        raise SaslError("empty user name")
    return name


def parse_plain(response: str | bytes) -> Credentials:
    """PLAIN (RFC 4616): `authzid \\0 authcid \\0 password`; the authzid is ignored."""
    parts = _raw(response).split(b"\0")
    if len(parts) != 3:
        raise SaslError("PLAIN response is not [authzid]\\0user\\0password")
    return Credentials(_username(parts[1]), parts[2])


def parse_amqplain(response: str | bytes) -> Credentials:
    """AMQPLAIN: a field table (without its length, as clients send it) of LOGIN and PASSWORD.

    A table with its 4-byte length in front is accepted too.
    """
    data = _raw(response)
    if len(data) >= 4 and int.from_bytes(data[:4], "big") == len(data) - 4:
        data = data[4:]  # a key's length byte (>0) makes this impossible for a bare table
    try:
        table = tables.decode_table(data)
    except replies.FrameError as error:
        raise SaslError(f"AMQPLAIN response is not a field table: {error}") from None
    # pamqp gives a long string as str (bytes if not UTF-8), a byte array ('x') as bytearray.
    login, password = (
        bytes(v) if isinstance(v, bytearray) else v
        for v in (table.get("LOGIN"), table.get("PASSWORD"))
    )
    if not isinstance(login, str | bytes) or not isinstance(password, str | bytes):
        raise SaslError("AMQPLAIN response lacks LOGIN or PASSWORD as strings")
    return Credentials(_username(_raw(login)), _raw(password))


def parse_response(mechanism: str, response: str | bytes) -> Credentials:
    """The credentials in a connection.start-ok response for `mechanism`."""
    if mechanism == "PLAIN":
        return parse_plain(response)
    if mechanism == "AMQPLAIN":
        return parse_amqplain(response)
    raise SaslError(f"unsupported mechanism {mechanism!r} (offered: {' '.join(MECHANISMS)})")


# -- loopback-only users, and the login decision ------------------------------------------

Peer = str | ipaddress.IPv4Address | ipaddress.IPv6Address | None


def is_loopback(peer: Peer) -> bool:
    """Whether `peer` (an address, as text or parsed) is 127.0.0.0/8 or ::1.

    An IPv4 address mapped into IPv6 (a dual-stack socket) counts as itself;
    None or anything unparsable is not loopback.
    """
    if peer is None:
        return False
    try:
        address = ipaddress.ip_address(peer) if isinstance(peer, str) else peer
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def login_allowed_from(
    username: str, peer: Peer, loopback_users: frozenset[str] = LOOPBACK_USERS
) -> bool:
    """RabbitMQ's `loopback_users`: those users may log in only from this machine."""
    return username not in loopback_users or is_loopback(peer)


def login_refusal(
    credentials: Credentials,
    stored_hash: str | None,
    peer: Peer,
    loopback_users: frozenset[str] = LOOPBACK_USERS,
) -> str | None:
    """Why this login is refused, for the log (None: accepted).

    `stored_hash` is the user's password_hash, None when there is no such
    user; the password is checked even then, so the time taken does not
    say whether the user exists. The client is told only ACCESS_REFUSED.
    """
    password_ok = passwords.verify(credentials.password, stored_hash)
    if stored_hash is None:
        return f"user {credentials.username!r}: no such user"
    if not password_ok:
        return f"user {credentials.username!r}: invalid credentials"
    if not login_allowed_from(credentials.username, peer, loopback_users):
        return f"user {credentials.username!r} can only connect via localhost (loopback_users)"
    return None
