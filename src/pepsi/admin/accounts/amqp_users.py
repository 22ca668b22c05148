"""AMQP users, vhosts and permissions (issue 16): `pepsi amqp`, and later the console.

Stored in pepsi.amqp_user, pepsi.amqp_vhost and pepsi.amqp_permission (see
docs/amqp.md). Every change is one transaction and is announced with
NOTIFY amqp_changed, so that a running listener can drop what it no longer
allows. A mistake (bad name, empty password, invalid pattern) changes
nothing and raises an `AmqpAdminError` with one line to print; passwords are
hashed before any database work and never appear in an error or a log.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from pepsi.amqp.auth import passwords
from pepsi.amqp.auth.permissions import Access, pattern_problem
from pepsi.db.queries import query
from pepsi.errors import EX_ERROR, EX_NOUSER, EX_USAGE, PepsiError

Connection = psycopg.Connection[Any]

DEFAULT_VHOST = "/"
_MAX_NAME_BYTES = 255  # an AMQP short string


class AmqpAdminError(PepsiError):
    """A request about AMQP users or vhosts that cannot be done; nothing was changed."""

    exit_code = EX_ERROR


class InvalidValue(AmqpAdminError):
    """A name, password, tag or pattern that cannot be used (exit 2, as a bad argument)."""

    exit_code = EX_USAGE


class UnknownUser(AmqpAdminError):
    exit_code = EX_NOUSER

    def __init__(self, name: str) -> None:
        super().__init__(f"no AMQP user {name!r}")


class UnknownVhost(AmqpAdminError):
    exit_code = EX_NOUSER

    def __init__(self, name: str) -> None:
        super().__init__(f"no AMQP vhost {name!r}")


class AlreadyExists(AmqpAdminError):
    """A user or vhost of that name is there already."""


@dataclass(frozen=True)
class User:
    name: str
    tags: tuple[str, ...]
    created: datetime
    updated: datetime

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tags": list(self.tags),
            "created": self.created.isoformat(),
            "updated": self.updated.isoformat(),
        }


@dataclass(frozen=True)
class Vhost:
    name: str
    created: datetime
    queues: int
    exchanges: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "created": self.created.isoformat(),
            "queues": self.queues,
            "exchanges": self.exchanges,
        }


@dataclass(frozen=True)
class UserPermission:
    username: str
    vhost: str
    configure: str
    write: str
    read: str

    def as_dict(self) -> dict[str, str]:
        return {
            "user": self.username,
            "vhost": self.vhost,
            "configure": self.configure,
            "write": self.write,
            "read": self.read,
        }


@dataclass(frozen=True)
class VhostDeleted:
    name: str
    queues: int
    messages: int


# -- checks (before any database work) ---------------------------------------------------


def check_name(name: str, what: str) -> str:
    """`name` if it can name a user or vhost: 1-255 bytes of UTF-8, no control characters."""
    if not name:
        raise InvalidValue(f"{what} name is empty")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidValue(f"{what} name is not valid UTF-8") from None
    if size > _MAX_NAME_BYTES:
        raise InvalidValue(f"{what} name is longer than {_MAX_NAME_BYTES} bytes")
    if any(unicodedata.category(char) == "Cc" for char in name):
        raise InvalidValue(f"{what} name contains a control character")
    return name


def check_password(password: str) -> str:
    """`password` if it can be used: not empty, no NUL (PLAIN could not carry it)."""
    if not password:
        raise InvalidValue("empty password")
    if "\0" in password:
        raise InvalidValue("password contains a NUL character")
    try:
        password.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidValue("password is not valid UTF-8") from None
    return password


def check_tags(tags: Iterable[str]) -> tuple[str, ...]:
    """Tags as stored: stripped, no empties or duplicates, in the order given."""
    result: list[str] = []
    for tag in (t.strip() for t in tags):
        if not tag or any(c.isspace() or c == "," for c in tag):
            raise InvalidValue(f"bad tag {tag!r}: tags are words separated by commas")
        if tag not in result:
            result.append(tag)
    return tuple(result)


def check_pattern(pattern: str, access: Access) -> str:
    problem = pattern_problem(pattern)
    if problem is not None:
        raise InvalidValue(f"{access.value} pattern: {problem}")
    return pattern


def _notify(conn: Connection, kind: str, name: str, vhost: str | None = None) -> None:
    payload: dict[str, str] = {"kind": kind, "name": name}
    if vhost is not None:
        payload["vhost"] = vhost
    conn.execute(query("amqp_notify_changed"), {"payload": json.dumps(payload)})


# -- users --------------------------------------------------------------------------------


def add_user(conn: Connection, name: str, password: str, tags: Iterable[str] = ()) -> User:
    """Create a user with no permissions (grant them with `set_permissions`)."""
    check_name(name, "user")
    stored = passwords.hash_password(check_password(password))
    with conn.transaction():
        row = conn.execute(
            query("amqp_user_insert"),
            {"name": name, "password_hash": stored, "tags": list(check_tags(tags))},
        ).fetchone()
        if row is None:
            raise AlreadyExists(f"AMQP user {name!r} already exists")
        _notify(conn, "user", name)
    return User(row[0], tuple(row[1]), row[2], row[3])


def delete_user(conn: Connection, name: str) -> None:
    """Delete a user and its permissions."""
    with conn.transaction():
        if conn.execute(query("amqp_user_delete"), {"name": name}).fetchone() is None:
            raise UnknownUser(name)
        _notify(conn, "user", name)


def list_users(conn: Connection) -> list[User]:
    return [User(r[0], tuple(r[1]), r[2], r[3]) for r in conn.execute(query("amqp_user_list"))]


def change_password(conn: Connection, name: str, password: str) -> None:
    stored = passwords.hash_password(check_password(password))
    with conn.transaction():
        row = conn.execute(
            query("amqp_user_set_password"), {"name": name, "password_hash": stored}
        ).fetchone()
        if row is None:
            raise UnknownUser(name)
        _notify(conn, "user", name)


def user_exists(conn: Connection, name: str) -> bool:
    return conn.execute(query("amqp_user_get"), {"name": name}).fetchone() is not None


def check_credentials(conn: Connection, name: str, password: str) -> bool:
    """Whether `password` is the user's (False for an unknown user, after the same work)."""
    row = conn.execute(query("amqp_user_get"), {"name": name}).fetchone()
    return passwords.verify(password, None if row is None else str(row[1]))


# -- permissions --------------------------------------------------------------------------


def set_permissions(
    conn: Connection,
    username: str,
    configure: str,
    write: str,
    read: str,
    *,
    vhost: str = DEFAULT_VHOST,
) -> UserPermission:
    """Set (replace) the user's three patterns in `vhost`."""
    patterns = {
        "configure": check_pattern(configure, Access.CONFIGURE),
        "write": check_pattern(write, Access.WRITE),
        "read": check_pattern(read, Access.READ),
    }
    with conn.transaction():
        row = conn.execute(
            query("amqp_permission_set"), {"username": username, "vhost": vhost, **patterns}
        ).fetchone()
        assert row is not None
        user_found, vhost_found, _written = row
        if not user_found:
            raise UnknownUser(username)
        if not vhost_found:
            raise UnknownVhost(vhost)
        _notify(conn, "permissions", username, vhost)
    return UserPermission(username, vhost, configure, write, read)


def clear_permissions(conn: Connection, username: str, *, vhost: str = DEFAULT_VHOST) -> bool:
    """Remove the user's permissions in `vhost`; False if it had none there."""
    with conn.transaction():
        row = conn.execute(
            query("amqp_permission_delete"), {"username": username, "vhost": vhost}
        ).fetchone()
        if row is None:
            if not user_exists(conn, username):
                raise UnknownUser(username)
            if not vhost_exists(conn, vhost):
                raise UnknownVhost(vhost)
            return False
        _notify(conn, "permissions", username, vhost)
    return True


def list_permissions(
    conn: Connection, *, vhost: str | None = None, username: str | None = None
) -> list[UserPermission]:
    rows = conn.execute(query("amqp_permission_list"), {"vhost": vhost, "username": username})
    return [UserPermission(*(str(value) for value in row)) for row in rows]


# -- vhosts -------------------------------------------------------------------------------


def add_vhost(conn: Connection, name: str) -> Vhost:
    """Create a vhost with RabbitMQ's predeclared exchanges (the database adds them)."""
    check_name(name, "vhost")
    with conn.transaction():
        row = conn.execute(query("amqp_vhost_insert"), {"name": name}).fetchone()
        if row is None:
            raise AlreadyExists(f"AMQP vhost {name!r} already exists")
        _notify(conn, "vhost", name)
    return next(v for v in list_vhosts(conn) if v.name == name)


def vhost_exists(conn: Connection, name: str) -> bool:
    row = conn.execute(query("amqp_vhost_exists"), {"name": name}).fetchone()
    return bool(row and row[0])


def list_vhosts(conn: Connection) -> list[Vhost]:
    return [Vhost(r[0], r[1], int(r[2]), int(r[3])) for r in conn.execute(query("amqp_vhost_list"))]


def delete_vhost(conn: Connection, name: str) -> VhostDeleted:
    """Delete a vhost with its exchanges, queues, bindings, permissions and messages."""
    with conn.transaction():
        row = conn.execute(query("amqp_vhost_delete"), {"name": name}).fetchone()
        assert row is not None
        if not row[0]:
            raise UnknownVhost(name)
        _notify(conn, "vhost", name)
    return VhostDeleted(name, int(row[1]), int(row[2]))
