"""Stage functions the tests run inside real worker processes.

Side effects go to the table `test_effects` (created by the tests) so a test
can count how many times each stage ran for each message.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg

from pepsi import Message, PermanentError, stage

_connection: list[psycopg.Connection[Any]] = []


def _effects_connection() -> psycopg.Connection[Any]:
    """One connection per worker process, opened again after the database restarted."""
    if not _connection or _connection[0].broken or _connection[0].closed:
        _connection[:] = [psycopg.connect(os.environ["PEPSI_DSN"], autocommit=True)]
    return _connection[0]


def _effect(msg: Message) -> None:
    _effects_connection().execute(
        "INSERT INTO test_effects (workqueue_id, stage, pid) VALUES (%s, %s, %s)",
        (msg.id, msg.stage, os.getpid()),
    )


@stage()
def noop(msg: Message) -> None:
    """Metadata only: advances to NEXT (or finishes)."""


@stage()
def count(msg: Message) -> None:
    """Metadata only, counts its passes in state."""
    msg.state["passes"] = msg.state.get("passes", 0) + 1
    msg.state.setdefault("stages", []).append(msg.stage)


@stage(needs="body")
def reverse_body_len(msg: Message) -> None:
    msg.state["body_length"] = len(msg.body or b"")


@stage()
def effect(msg: Message) -> None:
    _effect(msg)


@stage()
def slow(msg: Message) -> None:
    time.sleep(float(msg.properties.get("sleep", 0.05)))


@stage()
def permanent(msg: Message) -> None:
    raise PermanentError("cannot parse this")


@stage()
def flaky(msg: Message) -> None:
    raise RuntimeError("service unavailable")


@stage()
def park(msg: Message) -> object:
    return msg.pause(3600, reason="parked by test")


@stage()
def bad_state_then_fail(msg: Message) -> None:
    msg.state["oops"] = object()  # not JSON
    raise PermanentError("and then it fails")


@stage()
def bad_state(msg: Message) -> None:
    msg.state["oops"] = {1, 2}  # not JSON


@stage(needs="header")
def header_only(msg: Message) -> None:
    msg.state["header"] = (msg.header or b"").decode()


@stage()
def faulty(msg: Message) -> None:
    """Does what the message's `fault` property says, then records its effect.

    crash: os._exit; hang: sleep an hour; host: raise a host failure (only
    the first `times` deliveries when `times` is set); permanent: raise
    PermanentError. Without a fault it just records its effect.
    """
    fault = msg.properties.get("fault")
    times = msg.properties.get("times")
    if fault == "crash" and (times is None or msg.state.get("strikes", 0) < times):
        os._exit(3)
    if fault == "hang":
        time.sleep(3600)
    if fault == "host" and (times is None or msg.state.get("temporary_failures", 0) < times):
        raise ConnectionError("upstream service unavailable")
    if fault == "permanent":
        raise PermanentError("malformed input")
    if fault == "slow":
        time.sleep(float(msg.properties.get("sleep", 0.1)))
    _effect(msg)


# The same, in a stage that reads the header block: one message at a time, so
# a crash never re-runs the messages before it (no batch shares its outcome).
@stage(needs="header")
def faulty_serial(msg: Message) -> None:
    faulty(msg)


@stage()
def bad_state_then_error(msg: Message) -> None:
    msg.state["oops"] = object()  # not JSON
    raise RuntimeError("and then it breaks")


@stage()
def overreach(msg: Message) -> None:
    """Issue 34, finding 11: stage code tries, with the DSN it is given, to add a stage
    that runs a program of its choosing, and to read the AMQP users' password hashes;
    it records what PostgreSQL answered in the message's state."""
    with psycopg.connect(os.environ["PEPSI_DSN"], autocommit=True) as conn:
        for name, sql in (
            (
                "overlay",
                "INSERT INTO pepsi.config_override (section, key, value)"
                " VALUES ('stage-evil', 'PROGRAM', '/tmp/x.sh')",
            ),
            ("amqp_user", "SELECT * FROM pepsi.amqp_user"),
        ):
            try:
                conn.execute(sql)
                msg.state[name] = "allowed"
            except psycopg.errors.InsufficientPrivilege:
                msg.state[name] = "refused"
