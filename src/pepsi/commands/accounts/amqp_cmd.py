"""`pepsi amqp`: users, vhosts and permissions of the AMQP listener (issue 16).

    user add NAME [--tags T,...] [--password-stdin]   create a user (no permissions yet)
    user passwd NAME [--password-stdin]               change a user's password
    user delete NAME                                  delete a user and its permissions
    user list [--json]
    permissions set USER [--vhost V] CONF WRITE READ  RabbitMQ's three patterns (regexes)
    permissions clear USER [--vhost V]
    permissions list [--vhost V] [--user U] [--json]
    vhost add NAME | vhost delete NAME | vhost list [--json]

The password is asked twice on the terminal, or read from standard input
with --password-stdin (one trailing newline removed); it is never printed.
Patterns are searched in resource names as RabbitMQ does: ".*" allows all,
"" nothing, "^orders$" only `orders`. --vhost defaults to "/". There is no
default user: `pepsi amqp user add guest` and `pepsi amqp permissions set
guest ".*" ".*" ".*"` give RabbitMQ's guest (loopback only). Deleting a
vhost deletes its queues and their messages. See docs/amqp.md.
"""

from __future__ import annotations

import argparse

from pepsi.admin.accounts import amqp_users
from pepsi.admin.connection import open_current
from pepsi.commands import Context, summary
from pepsi.commands.accounts.passwords import dump_json, password_option, read_password
from pepsi.errors import EX_OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "amqp",
        help=summary("amqp"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    groups = parser.add_subparsers(dest="group", metavar="GROUP", required=True)

    user = groups.add_parser("user", help="AMQP users").add_subparsers(
        dest="action", metavar="ACTION", required=True
    )
    add = user.add_parser("add", help="create a user (no permissions until granted)")
    add.add_argument("name", metavar="NAME")
    add.add_argument("--tags", default="", help="comma-separated tags, e.g. administrator")
    password_option(add)
    add.set_defaults(handler=run_user_add)
    passwd = user.add_parser("passwd", help="change a user's password")
    passwd.add_argument("name", metavar="NAME")
    password_option(passwd)
    passwd.set_defaults(handler=run_user_passwd)
    delete = user.add_parser("delete", help="delete a user and its permissions")
    delete.add_argument("name", metavar="NAME")
    delete.set_defaults(handler=run_user_delete)
    listing = user.add_parser("list", help="every user with its tags")
    _json_option(listing)
    listing.set_defaults(handler=run_user_list)

    perms = groups.add_parser("permissions", help="users' permissions per vhost").add_subparsers(
        dest="action", metavar="ACTION", required=True
    )
    put = perms.add_parser("set", help="set a user's configure, write and read patterns")
    put.add_argument("user", metavar="USER")
    _vhost_option(put)
    put.add_argument("configure", metavar="CONFIGURE", help="regex: declare, delete")
    put.add_argument("write", metavar="WRITE", help="regex: publish, bind to a queue")
    put.add_argument("read", metavar="READ", help="regex: consume, get, purge, bind from")
    put.set_defaults(handler=run_permissions_set)
    clear = perms.add_parser("clear", help="remove a user's permissions in a vhost")
    clear.add_argument("user", metavar="USER")
    _vhost_option(clear)
    clear.set_defaults(handler=run_permissions_clear)
    listing = perms.add_parser("list", help="permissions, by vhost and user")
    listing.add_argument("--vhost", help="only this vhost")
    listing.add_argument("--user", help="only this user")
    _json_option(listing)
    listing.set_defaults(handler=run_permissions_list)

    vhost = groups.add_parser("vhost", help="virtual hosts").add_subparsers(
        dest="action", metavar="ACTION", required=True
    )
    vadd = vhost.add_parser("add", help="create a vhost with the standard exchanges")
    vadd.add_argument("name", metavar="NAME")
    vadd.set_defaults(handler=run_vhost_add)
    vdelete = vhost.add_parser("delete", help="delete a vhost, its queues and their messages")
    vdelete.add_argument("name", metavar="NAME")
    vdelete.set_defaults(handler=run_vhost_delete)
    vlist = vhost.add_parser("list", help="every vhost with its queue count")
    _json_option(vlist)
    vlist.set_defaults(handler=run_vhost_list)


def _vhost_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vhost", default=amqp_users.DEFAULT_VHOST, help="the vhost (default %(default)s)"
    )


def _json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run_user_add(args: argparse.Namespace, ctx: Context) -> int:
    amqp_users.check_name(args.name, "user")  # mistakes before asking for a password
    tags = amqp_users.check_tags(t for t in args.tags.split(",") if t.strip())
    password = read_password(args.password_stdin)
    with open_current(ctx.config()) as conn:
        user = amqp_users.add_user(conn, args.name, password, tags)
    print(f"added AMQP user {user.name!r} (no permissions: see `pepsi amqp permissions set`)")
    return EX_OK


def run_user_passwd(args: argparse.Namespace, ctx: Context) -> int:
    with open_current(ctx.config()) as conn:
        if not amqp_users.user_exists(conn, args.name):  # before asking for a password
            raise amqp_users.UnknownUser(args.name)
        amqp_users.change_password(conn, args.name, read_password(args.password_stdin))
    print(f"changed the password of AMQP user {args.name!r}")
    return EX_OK


def run_user_delete(args: argparse.Namespace, ctx: Context) -> int:
    with open_current(ctx.config()) as conn:
        amqp_users.delete_user(conn, args.name)
    print(f"deleted AMQP user {args.name!r}")
    return EX_OK


def run_user_list(args: argparse.Namespace, ctx: Context) -> int:
    with open_current(ctx.config()) as conn:
        users = amqp_users.list_users(conn)
    if args.json:
        dump_json(users)
    else:
        for user in users:
            print(f"{user.name}\t[{', '.join(user.tags)}]")
    return EX_OK


def run_permissions_set(args: argparse.Namespace, ctx: Context) -> int:
    with open_current(ctx.config()) as conn:
        amqp_users.set_permissions(
            conn, args.user, args.configure, args.write, args.read, vhost=args.vhost
        )
    print(f"set permissions of AMQP user {args.user!r} in vhost {args.vhost!r}")
    return EX_OK


def run_permissions_clear(args: argparse.Namespace, ctx: Context) -> int:
    with open_current(ctx.config()) as conn:
        cleared = amqp_users.clear_permissions(conn, args.user, vhost=args.vhost)
    where = f"AMQP user {args.user!r} in vhost {args.vhost!r}"
    print(f"cleared the permissions of {where}" if cleared else f"{where} had no permissions")
    return EX_OK


def run_permissions_list(args: argparse.Namespace, ctx: Context) -> int:
    with open_current(ctx.config()) as conn:
        rows = amqp_users.list_permissions(conn, vhost=args.vhost, username=args.user)
    if args.json:
        dump_json(rows)
    else:
        for row in rows:
            print(f"{row.vhost}\t{row.username}\t{row.configure!r}\t{row.write!r}\t{row.read!r}")
    return EX_OK


def run_vhost_add(args: argparse.Namespace, ctx: Context) -> int:
    amqp_users.check_name(args.name, "vhost")
    with open_current(ctx.config()) as conn:
        vhost = amqp_users.add_vhost(conn, args.name)
    print(f"added AMQP vhost {vhost.name!r}")
    return EX_OK


def run_vhost_delete(args: argparse.Namespace, ctx: Context) -> int:
    with open_current(ctx.config()) as conn:
        gone = amqp_users.delete_vhost(conn, args.name)
    print(f"deleted AMQP vhost {gone.name!r} ({gone.queues} queues, {gone.messages} messages)")
    return EX_OK


def run_vhost_list(args: argparse.Namespace, ctx: Context) -> int:
    with open_current(ctx.config()) as conn:
        vhosts = amqp_users.list_vhosts(conn)
    if args.json:
        dump_json(vhosts)
    else:
        for vhost in vhosts:
            print(f"{vhost.name}\t{vhost.queues} queues")
    return EX_OK
