"""The durable AMQP catalogue (schema 0011) and its users, vhosts and permissions."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from pepsi.admin.accounts import amqp_users
from pepsi.admin.accounts.amqp_users import AlreadyExists, InvalidValue, UnknownUser, UnknownVhost
from pepsi.db import schema
from pepsi.errors import EX_NOUSER, EX_USAGE

Conn = psycopg.Connection[Any]
PREDECLARED = [
    ("", "direct"),
    ("amq.direct", "direct"),
    ("amq.fanout", "fanout"),
    ("amq.headers", "headers"),
    ("amq.match", "headers"),
    ("amq.topic", "topic"),
]


def _exchanges(conn: Conn, vhost: str) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT name, type FROM pepsi.amqp_exchange WHERE vhost = %s ORDER BY name", (vhost,)
    ).fetchall()


def test_install_has_the_default_vhost_and_exchanges(conn: Conn) -> None:
    assert [v.name for v in amqp_users.list_vhosts(conn)] == ["/"]
    assert _exchanges(conn, "/") == PREDECLARED
    assert amqp_users.list_users(conn) == []  # no default guest: docs/amqp.md says why


def test_schema_file_and_migrations_install_the_same_rows(
    empty_dsn: str, other_empty_dsn: str
) -> None:
    with (
        psycopg.connect(empty_dsn, autocommit=True) as from_file,
        psycopg.connect(other_empty_dsn, autocommit=True) as from_migrations,
    ):
        schema.install(from_file)
        schema.install(from_migrations, from_migrations=True)
        # pg_dump --schema-only (test_schema.py) compares no rows: these, without timestamps.
        rows = (
            "SELECT e.vhost, e.name, e.type, e.durable, e.auto_delete, e.internal, e.arguments"
            " FROM pepsi.amqp_vhost v JOIN pepsi.amqp_exchange e ON e.vhost = v.name"
            " ORDER BY 1, 2"
        )
        assert from_file.execute(rows).fetchall() == from_migrations.execute(rows).fetchall()
        assert _exchanges(from_file, "/") == PREDECLARED


def test_queue_stage_names_are_deterministic_and_never_collide(conn: Conn) -> None:
    for vhost in ("a:b", "a", "50%", "50%3A"):
        amqp_users.add_vhost(conn, vhost)
    pairs = [("/", "orders"), ("a:b", "c"), ("a", "b:c"), ("50%", "x"), ("50%3A", "x")]
    for vhost, name in pairs:
        conn.execute("INSERT INTO pepsi.amqp_queue (vhost, name) VALUES (%s, %s)", (vhost, name))
    rows = conn.execute("SELECT vhost, name, stage FROM pepsi.amqp_queue").fetchall()
    stages = {(vhost, name): stage for vhost, name, stage in rows}
    assert stages[("/", "orders")] == "amqp:/:orders"
    assert stages[("a:b", "c")] == "amqp:a%3Ab:c"
    assert stages[("a", "b:c")] == "amqp:a:b:c"
    assert stages[("50%", "x")] == "amqp:50%25:x"
    assert stages[("50%3A", "x")] == "amqp:50%253A:x"
    assert len(set(stages.values())) == len(pairs)
    row = conn.execute("SELECT pepsi.amqp_queue_stage('/', 'orders')").fetchone()
    assert row == ("amqp:/:orders",)
    with pytest.raises(psycopg.errors.GeneratedAlways):
        conn.execute("INSERT INTO pepsi.amqp_queue (vhost, name, stage) VALUES ('/', 'q', 'x')")


def test_bindings_go_with_their_queue_or_exchange(conn: Conn) -> None:
    conn.execute("INSERT INTO pepsi.amqp_queue (vhost, name) VALUES ('/', 'q1'), ('/', 'q2')")
    conn.execute("INSERT INTO pepsi.amqp_exchange (vhost, name, type) VALUES ('/', 'x', 'topic')")
    conn.execute(
        "INSERT INTO pepsi.amqp_binding (vhost, source, destination, destination_kind,"
        " routing_key, arguments) VALUES"
        " ('/', 'amq.topic', 'q1', 'queue', 'a.#', '{}'),"
        " ('/', 'amq.topic', 'q1', 'queue', 'a.#', '{\"x-match\": \"all\"}'),"
        " ('/', 'x', 'q2', 'queue', '', '{}'),"
        " ('/', 'amq.topic', 'x', 'exchange', 'b.*', '{}')"
    )

    def count() -> int:
        row = conn.execute("SELECT count(*) FROM pepsi.amqp_binding").fetchone()
        assert row is not None
        return int(row[0])

    assert count() == 4
    with pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute(
            "INSERT INTO pepsi.amqp_binding (vhost, source, destination, destination_kind,"
            " routing_key) VALUES ('/', 'x', 'q2', 'queue', '')"
        )
    with pytest.raises(psycopg.errors.ForeignKeyViolation):  # no such queue
        conn.execute(
            "INSERT INTO pepsi.amqp_binding (vhost, source, destination, destination_kind)"
            " VALUES ('/', 'x', 'nope', 'queue')"
        )
    with pytest.raises(psycopg.errors.CheckViolation):  # nothing binds the default exchange
        conn.execute(
            "INSERT INTO pepsi.amqp_binding (vhost, source, destination, destination_kind)"
            " VALUES ('/', '', 'q1', 'queue')"
        )
    conn.execute("DELETE FROM pepsi.amqp_queue WHERE name = 'q1'")
    assert count() == 2
    conn.execute("DELETE FROM pepsi.amqp_exchange WHERE name = 'x'")  # source of one, dest of one
    assert count() == 0


def test_users(conn: Conn) -> None:
    listener = psycopg.connect(conn.info.dsn, autocommit=True)
    listener.execute("LISTEN amqp_changed")
    user = amqp_users.add_user(conn, "alice", "pw1", ["administrator", "monitoring"])
    assert (user.name, user.tags) == ("alice", ("administrator", "monitoring"))
    notes = [json.loads(n.payload) for n in listener.notifies(timeout=1, stop_after=1)]
    assert notes == [{"kind": "user", "name": "alice"}]
    listener.close()
    stored = conn.execute("SELECT password_hash FROM pepsi.amqp_user").fetchone()
    assert stored is not None
    assert "pw1" not in str(stored[0])
    assert amqp_users.check_credentials(conn, "alice", "pw1")
    assert not amqp_users.check_credentials(conn, "alice", "pw2")
    assert not amqp_users.check_credentials(conn, "bob", "pw1")
    with pytest.raises(AlreadyExists, match="'alice' already exists"):
        amqp_users.add_user(conn, "alice", "other")
    assert amqp_users.check_credentials(conn, "alice", "pw1")  # untouched

    amqp_users.change_password(conn, "alice", "pw2")
    assert amqp_users.check_credentials(conn, "alice", "pw2")
    assert not amqp_users.check_credentials(conn, "alice", "pw1")
    with pytest.raises(UnknownUser, match="no AMQP user 'bob'") as info:
        amqp_users.change_password(conn, "bob", "x")
    assert info.value.exit_code == EX_NOUSER

    amqp_users.add_user(conn, "bob", "pw")
    assert [u.name for u in amqp_users.list_users(conn)] == ["alice", "bob"]
    amqp_users.set_permissions(conn, "alice", ".*", ".*", ".*")
    amqp_users.delete_user(conn, "alice")
    assert [u.name for u in amqp_users.list_users(conn)] == ["bob"]
    assert amqp_users.list_permissions(conn) == []  # went with the user
    with pytest.raises(UnknownUser):
        amqp_users.delete_user(conn, "alice")


@pytest.mark.parametrize(
    ("name", "password", "tags", "problem"),
    [
        ("", "pw", (), "user name is empty"),
        ("x" * 256, "pw", (), "longer than 255 bytes"),
        ("é" * 128, "pw", (), "longer than 255 bytes"),
        ("a\nb", "pw", (), "control character"),
        ("a", "", (), "empty password"),
        ("a", "p\0w", (), "NUL"),
        ("a", "pw", ("ok", "two words"), "bad tag"),
        ("a", "pw", ("",), "bad tag"),
    ],
)
def test_user_mistakes_change_nothing(
    conn: Conn, name: str, password: str, tags: tuple[str, ...], problem: str
) -> None:
    with pytest.raises(InvalidValue, match=problem) as info:
        amqp_users.add_user(conn, name, password, tags)
    assert info.value.exit_code == EX_USAGE
    assert password not in str(info.value) or not password
    assert amqp_users.list_users(conn) == []


def test_permissions(conn: Conn) -> None:
    amqp_users.add_user(conn, "alice", "pw")
    amqp_users.add_vhost(conn, "dev")
    amqp_users.set_permissions(conn, "alice", "^alice-", ".*", "")
    amqp_users.set_permissions(conn, "alice", "", "", ".*", vhost="dev")
    amqp_users.set_permissions(conn, "alice", "^a$", ".*", ".*")  # replaces '/'
    rows = [p.as_dict() for p in amqp_users.list_permissions(conn)]
    assert rows == [
        {"user": "alice", "vhost": "/", "configure": "^a$", "write": ".*", "read": ".*"},
        {"user": "alice", "vhost": "dev", "configure": "", "write": "", "read": ".*"},
    ]
    assert [p.vhost for p in amqp_users.list_permissions(conn, vhost="dev")] == ["dev"]
    assert amqp_users.list_permissions(conn, username="nobody") == []
    got = conn.execute(
        "SELECT configure, write, read FROM pepsi.amqp_permission"
        " WHERE username = 'alice' AND vhost = 'dev'"
    ).fetchone()
    assert got == ("", "", ".*")

    with pytest.raises(UnknownUser):
        amqp_users.set_permissions(conn, "bob", ".*", ".*", ".*")
    with pytest.raises(UnknownVhost, match="no AMQP vhost 'prod'"):
        amqp_users.set_permissions(conn, "alice", ".*", ".*", ".*", vhost="prod")
    with pytest.raises(InvalidValue, match="write pattern: invalid regular expression"):
        amqp_users.set_permissions(conn, "alice", ".*", "(oops", ".*")
    assert len(amqp_users.list_permissions(conn)) == 2  # nothing changed

    assert amqp_users.clear_permissions(conn, "alice", vhost="dev")
    assert not amqp_users.clear_permissions(conn, "alice", vhost="dev")
    with pytest.raises(UnknownUser):
        amqp_users.clear_permissions(conn, "bob")
    with pytest.raises(UnknownVhost):
        amqp_users.clear_permissions(conn, "alice", vhost="prod")


def test_vhosts(conn: Conn) -> None:
    vhost = amqp_users.add_vhost(conn, "shop")
    assert (vhost.name, vhost.queues, vhost.exchanges) == ("shop", 0, len(PREDECLARED))
    assert _exchanges(conn, "shop") == PREDECLARED
    with pytest.raises(AlreadyExists):
        amqp_users.add_vhost(conn, "shop")
    with pytest.raises(InvalidValue):
        amqp_users.add_vhost(conn, "")

    amqp_users.add_user(conn, "alice", "pw")
    amqp_users.set_permissions(conn, "alice", ".*", ".*", ".*", vhost="shop")
    conn.execute("INSERT INTO pepsi.amqp_queue (vhost, name) VALUES ('shop', 'q'), ('/', 'q')")
    conn.execute(
        "INSERT INTO pepsi.amqp_binding (vhost, source, destination, destination_kind)"
        " VALUES ('shop', 'amq.direct', 'q', 'queue')"
    )
    conn.execute(
        "INSERT INTO pepsi.workqueue (stage) VALUES"
        " ('amqp:shop:q'), ('amqp:shop:q'), ('amqp:/:q'), ('a')"
    )
    assert {v.name: v.queues for v in amqp_users.list_vhosts(conn)} == {"/": 1, "shop": 1}

    gone = amqp_users.delete_vhost(conn, "shop")
    assert (gone.queues, gone.messages) == (1, 2)
    assert [v.name for v in amqp_users.list_vhosts(conn)] == ["/"]
    left = conn.execute("SELECT stage FROM pepsi.workqueue ORDER BY stage").fetchall()
    assert left == [("a",), ("amqp:/:q",)]
    for table in ("amqp_exchange", "amqp_queue", "amqp_binding", "amqp_permission"):
        row = conn.execute(f"SELECT count(*) FROM pepsi.{table} WHERE vhost = 'shop'").fetchone()
        assert row == (0,), table
    with pytest.raises(UnknownVhost):
        amqp_users.delete_vhost(conn, "shop")
