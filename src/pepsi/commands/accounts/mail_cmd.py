"""`pepsi mail`: the users who may log in to the SMTP/LMTP ingress (AUTH PLAIN, LOGIN).

    user add NAME [--password-stdin]      create a user
    user passwd NAME [--password-stdin]   change a user's password
    user delete NAME
    user list [--json]

The password is asked twice on the terminal, or read from standard input
with --password-stdin (one trailing newline removed); it is never printed.
It is stored as a scrypt hash in pepsi.mail_user. A user who logs in may
send to any domain, and is the mail's fair key (`user:NAME`). See docs/mail.md.
"""

from __future__ import annotations

import argparse

from pepsi.admin.accounts import mail_users
from pepsi.admin.accounts.amqp_users import check_name
from pepsi.admin.connection import open_current
from pepsi.commands import Context, summary
from pepsi.commands.accounts.passwords import dump_json, password_option, read_password
from pepsi.errors import EX_OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "mail",
        help=summary("mail"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    groups = parser.add_subparsers(dest="group", metavar="GROUP", required=True)
    user = groups.add_parser("user", help="users of the ingress's AUTH").add_subparsers(
        dest="action", metavar="ACTION", required=True
    )
    add = user.add_parser("add", help="create a user")
    add.add_argument("name", metavar="NAME")
    password_option(add)
    add.set_defaults(handler=run_user_add)
    passwd = user.add_parser("passwd", help="change a user's password")
    passwd.add_argument("name", metavar="NAME")
    password_option(passwd)
    passwd.set_defaults(handler=run_user_passwd)
    delete = user.add_parser("delete", help="delete a user")
    delete.add_argument("name", metavar="NAME")
    delete.set_defaults(handler=run_user_delete)
    listing = user.add_parser("list", help="every user")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(handler=run_user_list)


def run_user_add(args: argparse.Namespace, ctx: Context) -> int:
    check_name(args.name, "user")  # a mistake before asking for a password
    password = read_password(args.password_stdin)
    with open_current(ctx.config()) as conn:
        user = mail_users.add_user(conn, args.name, password)
    print(f"added mail user {user.name!r}")
    return EX_OK


def run_user_passwd(args: argparse.Namespace, ctx: Context) -> int:
    with open_current(ctx.config()) as conn:
        if not mail_users.user_exists(conn, args.name):
            raise mail_users.UnknownMailUser(args.name)  # before asking for a password
        mail_users.change_password(conn, args.name, read_password(args.password_stdin))
    print(f"changed the password of mail user {args.name!r}")
    return EX_OK


def run_user_delete(args: argparse.Namespace, ctx: Context) -> int:
    with open_current(ctx.config()) as conn:
        mail_users.delete_user(conn, args.name)
    print(f"deleted mail user {args.name!r}")
    return EX_OK


def run_user_list(args: argparse.Namespace, ctx: Context) -> int:
    with open_current(ctx.config()) as conn:
        users = mail_users.list_users(conn)
    if args.json:
        dump_json(users)
    else:
        for user in users:
            print(user.name)
    return EX_OK
