"""Issue 34, finding 11: a publisher's database role could add a stage whose PROGRAM
the dispatcher then ran. `pepsi setup roles` makes pepsi_publisher and pepsi_worker;
a publisher's login and stage code's ([pepsi-postgres] WORKER_DSN) do their work and
no more: no overlay writes, no password tables, no one else's rows for a publisher."""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import conninfo, sql

from pepsi.config import load_config
from pepsi.publishing import OutgoingMessage, Publisher
from tests.scenarios.conftest import REPO, Pipeline, wait_until

PIPELINE = r"""
[stage-first]
HANDLER = tests.stages:overreach
NEXT = classify
[stage-classify]
PROGRAM = pepsi-stage-set
SET = checked=true
NEXT = route
[stage-route]
PROGRAM = pepsi-stage-if
IF = properties.kind == "order"
THEN = done
ELSE = reject
[stage-done]
PROGRAM = pepsi-stage-discard
[stage-reject]
PROGRAM = pepsi-stage-bounce
REASON = not an order
"""


@pytest.fixture
def logins(pipeline: Pipeline) -> Iterator[dict[str, str]]:
    """`pepsi setup roles`, then a login role in each group; their DSNs by group."""
    done = subprocess.run(
        [sys.executable, "-m", "pepsi", "setup", "roles"],
        env=pipeline.env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "roles pepsi_publisher and pepsi_worker ready" in done.stdout
    password = secrets.token_hex(8)
    made: dict[str, str] = {}
    dsns: dict[str, str] = {}
    for group in ("pepsi_publisher", "pepsi_worker"):
        name = f"t_{group[6:9]}_{secrets.token_hex(4)}"
        pipeline.db.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
                sql.Identifier(name), sql.Literal(password), sql.Identifier(group)
            )
        )
        made[group] = name
        dsns[group] = conninfo.make_conninfo(pipeline.dsn, user=name, password=password)
    yield dsns
    for name in made.values():
        pipeline.db.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        pipeline.db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def refused(dsn: str, statement: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            conn.execute(statement)
        except psycopg.errors.InsufficientPrivilege:
            return True
    return False


def test_a_publisher_publishes_and_can_do_nothing_else(
    pipeline: Pipeline, logins: dict[str, str]
) -> None:
    pipeline.configure(PIPELINE)
    dsn = logins["pepsi_publisher"]
    with Publisher.connect(load_config(pipeline.conf), dsn) as publisher:
        one = publisher.publish(OutgoingMessage("first", b"body", sender="a@shop.example"))
        many = publisher.publish_many([OutgoingMessage("first", b"x")] * 3)
    assert (
        pipeline.scalar(
            "SELECT count(*) FROM pepsi.workqueue WHERE workqueue_id = ANY(%s)", [one, *many]
        )
        == 4
    )
    overlay = (
        "INSERT INTO pepsi.config_override (section, key, value)"
        " VALUES ('stage-evil', 'PROGRAM', '/tmp/x.sh')"
    )
    for statement in (
        overlay,
        "UPDATE pepsi.config_override SET value = '/tmp/x.sh'",
        "SELECT body FROM pepsi.workqueue_body",
        "SELECT * FROM pepsi.workqueue",
        "SELECT * FROM pepsi.amqp_user",
        "SELECT * FROM pepsi.mail_user",
        "DELETE FROM pepsi.workqueue",
        "CREATE TABLE pepsi.mine (x int)",
    ):
        assert refused(dsn, statement), statement


def test_stage_code_runs_with_the_worker_role_and_cannot_add_a_stage(
    pipeline: Pipeline, logins: dict[str, str]
) -> None:
    pipeline.configure(
        PIPELINE + f"[pepsi-postgres]\nWORKER_DSN = {logins['pepsi_worker']}\n",
        POLL_INTERVAL="30s",
    )
    pipeline.start()
    with Publisher.connect(load_config(pipeline.conf), logins["pepsi_publisher"]) as publisher:
        order = publisher.publish(OutgoingMessage("first", properties={"kind": "order"}))
        other = publisher.publish(OutgoingMessage("first", properties={"kind": "ad"}))
    wait_until(pipeline.settled, timeout=60, what="the messages to settle")
    assert pipeline.row(order) is None  # done: discarded
    row: Any = pipeline.row(other)
    assert row[:2] == ("reject", "failed")
    assert row[2]["overlay"] == row[2]["amqp_user"] == "refused"
    assert row[2]["checked"] is True
    assert pipeline.scalar("SELECT count(*) FROM pepsi.config_override") == 0
