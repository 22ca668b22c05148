"""The ingress's AUTH users: `pepsi mail user`, and the server's check of a login.

Stored in pepsi.mail_user with scrypt hashes, as the AMQP users are (the
same name and password rules, the same hash). A mistake changes nothing and
raises a PepsiError with one line to print; a password never appears in an
error or a log.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from pepsi.admin.accounts.amqp_users import check_name, check_password
from pepsi.amqp.auth import passwords
from pepsi.db.queries import query
from pepsi.errors import EX_ERROR, EX_NOUSER, PepsiError

Connection = psycopg.Connection[Any]
AsyncConnection = psycopg.AsyncConnection[Any]


class MailUserError(PepsiError):
    exit_code = EX_ERROR


class UnknownMailUser(MailUserError):
    exit_code = EX_NOUSER

    def __init__(self, name: str) -> None:
        super().__init__(f"no mail user {name!r}")


@dataclass(frozen=True)
class MailUser:
    name: str
    created: datetime
    updated: datetime

    def as_dict(self) -> dict[str, str]:
        return {
            "name": self.name,
            "created": self.created.isoformat(),
            "updated": self.updated.isoformat(),
        }


def add_user(conn: Connection, name: str, password: str) -> MailUser:
    check_name(name, "user")
    stored = passwords.hash_password(check_password(password))
    row = conn.execute(
        query("mail_user_insert"), {"name": name, "password_hash": stored}
    ).fetchone()
    if row is None:
        raise MailUserError(f"mail user {name!r} already exists")
    return MailUser(*row)


def change_password(conn: Connection, name: str, password: str) -> None:
    stored = passwords.hash_password(check_password(password))
    row = conn.execute(
        query("mail_user_set_password"), {"name": name, "password_hash": stored}
    ).fetchone()
    if row is None:
        raise UnknownMailUser(name)


def delete_user(conn: Connection, name: str) -> None:
    if conn.execute(query("mail_user_delete"), {"name": name}).fetchone() is None:
        raise UnknownMailUser(name)


def user_exists(conn: Connection, name: str) -> bool:
    return conn.execute(query("mail_user_get"), {"name": name}).fetchone() is not None


def list_users(conn: Connection) -> list[MailUser]:
    return [MailUser(*row) for row in conn.execute(query("mail_user_list"))]


async def stored_hash(conn: AsyncConnection, name: str) -> str | None:
    """The user's password hash, or None if there is no such user."""
    cursor = await conn.execute(query("mail_user_get"), {"name": name})
    row = await cursor.fetchone()
    return None if row is None else str(row[0])
