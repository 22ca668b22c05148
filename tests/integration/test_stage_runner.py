"""`StageRunner` in-process against a real database: rows in, row updates and status lines out.

Each test puts rows in `running` at a stage (as a claim leaves them), runs one
batch and reads back what became of the rows and what the dispatcher would
have been told.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import conninfo, sql

from pepsi.config import Config, load_config
from pepsi.protocol import Pass, StatusLine, parse_status
from pepsi.stage import Message, PermanentError, stage
from pepsi.worker.runner import StageRunner, ended_by_server
from pepsi.worker.runtime import connect_worker
from tests.rows import NOW, running

Conn = psycopg.Connection[tuple[Any, ...]]
UNTIL = datetime(2030, 1, 1, tzinfo=UTC)

CONF = """
[stage-a]
HANDLER = tests.stages:noop
NEXT = b
QUEUE_LIMIT = 8
RETRY_DELAY = 10s
RETRY_MAX_DELAY = 30s
MAX_LIFETIME = 1h
[stage-b]
HANDLER = tests.stages:noop
[stage-dead]
HANDLER = tests.stages:noop
[stage-bounced]
HANDLER = tests.stages:noop
NEXT = b
MAX_LIFETIME = 1h
BOUNCE_STAGE = dead
"""


@pytest.fixture
def config(tmp_path: Path) -> Config:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF)
    return load_config(path)


def row_of(conn: Conn, wid: int) -> tuple[str, str, dict[str, Any], datetime | None] | None:
    """(stage, status, state, timeout), or None once the row is deleted (finished)."""
    row = conn.execute(
        "SELECT stage, status::text, state, timeout FROM pepsi.workqueue WHERE workqueue_id = %s",
        (wid,),
    ).fetchone()
    return None if row is None else (row[0], row[1], row[2], row[3])


def lines(out: bytes) -> list[StatusLine]:
    assert out.endswith(b"\n")
    return [parse_status(line) for line in out.splitlines()]


def outcomes(out: bytes) -> list[tuple[int, str | None]]:
    """(status, outcome) per line; a line without a report has outcome None."""
    result = []
    for line in lines(out):
        report = line.report or (Pass("", 0, None),)
        result.append((line.status, report[0].outcome))
    return result


@stage()
def by_property(msg: Message) -> object:
    """Does what the message's `do` property says."""
    do = msg.properties.get("do")
    msg.state["ran"] = msg.state.get("ran", 0) + 1
    match do:
        case "finish":
            return msg.finish()
        case "pause":
            return msg.pause(until=UNTIL, reason="waiting")
        case "advance":
            return msg.advance(msg.properties["to"])
        case "permanent":
            raise PermanentError("cannot parse this")
        case "host":
            raise ConnectionError("upstream unavailable")
        case "bad-state":
            msg.state["oops"] = {1, 2}
        case "bad-state-then-error":
            msg.state["oops"] = object()
            raise RuntimeError("and then it breaks")
    return None


# --- outcomes -------------------------------------------------------------------


def test_a_batch_records_every_outcome_in_order(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    ids = [
        running(conn),  # None: advance to NEXT
        running(conn, properties={"do": "finish"}),
        running(conn, properties={"do": "pause"}),
        running(conn, properties={"do": "advance", "to": "dead"}, state={"strikes": 1}),
        running(conn, properties={"do": "permanent"}),
        running(conn, properties={"do": "host"}),
    ]
    runner = make_runner(by_property)
    assert runner.batch_limit == 8  # metadata only: every buffered id at once
    out = runner.run_batch(ids)
    assert outcomes(out) == [
        (0, "advance"),
        (0, "finish"),
        (0, "pause"),
        (0, "advance"),
        (1, "fail"),
        (0, "retry"),
    ]
    assert all(line.report and line.report[0].stage == "a" for line in lines(out))

    advanced, finished, paused, moved, failed, retried = (row_of(conn, wid) for wid in ids)
    assert advanced == ("b", "pending", {"ran": 1}, None)
    assert finished is None
    assert paused == ("a", "paused", {"ran": 1, "pause_reason": "waiting"}, UNTIL)
    assert moved == ("dead", "pending", {"ran": 1}, None)  # strikes start again at a new stage
    assert failed == (
        "a",
        "failed",
        {
            "ran": 1,
            "last_error": "cannot parse this",
            "failed_stage": "a",
            "failure_class": "permanent",
        },
        None,
    )
    assert retried == (
        "a",
        "paused",
        {"ran": 1, "last_error": "ConnectionError: upstream unavailable", "temporary_failures": 1},
        NOW + timedelta(seconds=10),  # RETRY_DELAY, from the injected clock
    )


def test_failures_are_logged_under_the_stage(
    conn: Conn, make_runner: Callable[..., StageRunner], caplog: pytest.LogCaptureFixture
) -> None:
    permanent = running(conn, properties={"do": "permanent"})
    host = running(conn, properties={"do": "host"}, state={"temporary_failures": 5})
    late = running(conn, "bounced", properties={"do": "host"})
    with caplog.at_level(logging.INFO, logger="pepsi.stage"):
        make_runner(by_property).run_batch([permanent, host])
        make_runner(by_property, "bounced", at=NOW + timedelta(hours=2)).run_batch([late])
    logged = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert logged == [
        ("pepsi.stage.a", "ERROR", f"message {permanent} failed permanently: cannot parse this"),
        (
            "pepsi.stage.a",
            "WARNING",
            f"message {host}: ConnectionError: upstream unavailable; retry 6 at "
            f"{NOW + timedelta(seconds=30)}",  # capped at RETRY_MAX_DELAY
        ),
        (
            "pepsi.stage.bounced",
            "ERROR",
            f"message {late}: ConnectionError: upstream unavailable; giving up after retries",
        ),
    ]
    stage_name, status, state, _ = row_of(conn, late) or ("", "", {}, None)
    assert (stage_name, status) == ("dead", "pending")
    assert state["failure_class"] == "retries-exhausted"


def test_past_max_lifetime_without_bounce_stage_fails(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    wid = running(conn, properties={"do": "host"})
    out = make_runner(by_property, at=NOW + timedelta(hours=2)).run_batch([wid])
    assert outcomes(out) == [(1, "fail")]
    stage_name, status, state, _ = row_of(conn, wid) or ("", "", {}, None)
    assert (stage_name, status, state["failure_class"]) == ("a", "failed", "retries-exhausted")


def test_a_state_that_is_not_json_never_breaks_the_batch(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    returned = running(conn, properties={"do": "bad-state"}, state={"kept": True})
    raised = running(conn, properties={"do": "bad-state-then-error"})
    fine = running(conn)
    out = make_runner(by_property).run_batch([returned, raised, fine])
    assert outcomes(out) == [(0, "retry"), (0, "retry"), (0, "advance")]
    _, status, state, _ = row_of(conn, returned) or ("", "", {}, None)
    assert status == "paused"
    assert state["kept"] is True  # the state as it was loaded
    assert "ran" not in state
    assert state["last_error"].startswith("TypeError: state is not JSON:")
    _, status, state, _ = row_of(conn, raised) or ("", "", {}, None)
    assert (status, state["last_error"]) == ("paused", "RuntimeError: and then it breaks")
    assert row_of(conn, fine) == ("b", "pending", {"ran": 1}, None)


def test_an_id_no_longer_running_here_is_answered_zero_without_a_report(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    moved, kept = running(conn), running(conn)
    conn.execute("UPDATE pepsi.workqueue SET stage = 'b' WHERE workqueue_id = %s", (moved,))
    out = make_runner(by_property).run_batch([moved, kept])
    assert outcomes(out) == [(0, None), (0, "advance")]
    assert row_of(conn, moved) == ("b", "running", {}, None)  # untouched


def test_an_async_stage_runs_on_the_runners_loop(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    @stage()
    async def later(msg: Message) -> object:
        msg.state["async"] = True
        return msg.finish() if msg.properties.get("do") == "finish" else None

    ids = [running(conn), running(conn, properties={"do": "finish"})]
    runner = make_runner(later)
    assert runner.loop is not None
    assert outcomes(runner.run_batch(ids)) == [(0, "advance"), (0, "finish")]
    assert row_of(conn, ids[0]) == ("b", "pending", {"async": True}, None)
    assert row_of(conn, ids[1]) is None


@stage(needs="body")
def measure(msg: Message) -> None:
    msg.state["header"] = (msg.header or b"").decode()
    msg.state["length"] = len(msg.body or b"")


def test_a_stage_that_reads_bodies_takes_its_batch_with_the_bodies(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    ids = [running(conn, body=b"hello"), running(conn, body=b"hi")]
    runner = make_runner(measure)
    assert runner.batch_limit == 8  # as a metadata stage: every buffered id, up to QUEUE_LIMIT
    assert outcomes(runner.run_batch(ids)) == [(0, "advance"), (0, "advance")]
    assert row_of(conn, ids[0]) == ("b", "pending", {"header": "Subject: hi", "length": 5}, None)
    assert row_of(conn, ids[1]) == ("b", "pending", {"header": "Subject: hi", "length": 2}, None)


def test_a_large_body_is_fetched_on_its_own_when_read(
    conn: Conn, make_runner: Callable[..., StageRunner], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pepsi.worker.messages.INLINE", 4)  # 'hello' is over it, 'hi' is not
    ids = [running(conn, body=b"hello"), running(conn, body=b"hi")]
    assert outcomes(make_runner(measure).run_batch(ids)) == [(0, "advance"), (0, "advance")]
    assert row_of(conn, ids[0]) == ("b", "pending", {"header": "Subject: hi", "length": 5}, None)
    assert row_of(conn, ids[1]) == ("b", "pending", {"header": "Subject: hi", "length": 2}, None)


def test_slow_messages_are_answered_as_they_finish(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    """A batch of slow metadata-only messages (a stage waiting on a remote service) is
    written and answered every FLUSH_AFTER, so that the dispatcher hears of each in
    time (a stage that reads bodies answers each message anyway)."""

    @stage()
    def slow(msg: Message) -> None:
        time.sleep(0.15)  # longer than FLUSH_AFTER: the stage's own work, not a wait on a test

    ids = [running(conn, body=b"x") for _ in range(3)]
    answers = make_runner(slow).answers(ids)
    assert len(lines(next(answers))) == 1  # metadata only, yet slow: the first on its own
    # ... written before it was answered, while the others wait their turn
    assert [(row_of(conn, wid) or ("", ""))[:2] for wid in ids] == [
        ("b", "pending"),
        ("a", "running"),
        ("a", "running"),
    ]
    assert [len(lines(chunk)) for chunk in answers] == [1, 1]


def test_a_metadata_stage_loads_the_body_on_first_access(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    @stage()
    def peek(msg: Message) -> None:
        if msg.properties.get("peek"):
            msg.state["body"] = (msg.body or b"").decode()

    ids = [running(conn, body=b"one"), running(conn, body=b"two", properties={"peek": True})]
    assert outcomes(make_runner(peek).run_batch(ids)) == [(0, "advance"), (0, "advance")]
    assert row_of(conn, ids[0]) == ("b", "pending", {}, None)
    assert row_of(conn, ids[1]) == ("b", "pending", {"body": "two"}, None)


# --- the worker's own connection ----------------------------------------------------


def terminate(conn: Conn, runner: StageRunner) -> None:
    """End the runner's backend from another session, and wait until it is gone."""
    row = conn.execute(
        "SELECT pg_terminate_backend(%s, 10000)", (runner.conn.info.backend_pid,)
    ).fetchone()
    assert row == (True,)


def wait_readable(worker: Conn, timeout: float = 10.0) -> None:
    """Until the server's goodbye has reached the worker's idle socket."""
    deadline = time.monotonic() + timeout
    while not ended_by_server(worker):
        assert time.monotonic() < deadline, "the terminated session's socket never spoke"
        time.sleep(0.01)


def test_a_connection_ended_while_idle_is_replaced_before_the_batch(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    # A restart or failover between batches: the worker sees the server's goodbye on
    # the idle socket and reconnects first, so it answers no 74 (no DB_ERROR_PAUSE).
    ids = [running(conn), running(conn)]
    runner = make_runner(by_property)
    before = runner.conn.info.backend_pid
    terminate(conn, runner)
    wait_readable(runner.conn)
    assert outcomes(runner.run_batch(ids)) == [(0, "advance"), (0, "advance")]
    assert runner.conn.info.backend_pid != before
    assert [row_of(conn, wid) for wid in ids] == [("b", "pending", {"ran": 1}, None)] * 2


def test_a_connection_lost_inside_the_stage_answers_74_for_the_batch(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    holder: list[StageRunner] = []

    @stage()
    def loses_it(msg: Message) -> None:
        if msg.properties.get("lose"):
            terminate(conn, holder[0])
            msg.state["body"] = msg.body  # the lazy load on the lost connection
        msg.state["ran"] = True

    ids = [running(conn), running(conn, body=b"x", properties={"lose": True}), running(conn)]
    holder.append(make_runner(loses_it))
    assert holder[0].run_batch(ids) == b"74\n74\n74\n"  # nothing of the batch was written
    assert [row_of(conn, wid) for wid in ids] == [("a", "running", {}, None)] * 3


def test_a_read_only_session_answers_74_and_is_not_reused(
    conn: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    # A node demoted to a standby keeps its sessions open and refuses their writes
    # (25006): the batch answers 74 and the next one runs on a new connection.
    ids = [running(conn), running(conn)]
    runner = make_runner(by_property)
    runner.conn.execute("SET default_transaction_read_only = on")
    assert runner.run_batch(ids) == b"74\n74\n"
    assert [row_of(conn, wid) for wid in ids] == [("a", "running", {}, None)] * 2
    assert runner.conn.closed
    assert outcomes(runner.run_batch(ids)) == [(0, "advance"), (0, "advance")]


def test_without_a_way_to_reconnect_every_batch_answers_74(
    dsn: str, conn: Conn, config: Config
) -> None:
    wid = running(conn)
    worker = connect_worker(dsn, "a", synchronous_commit=False)
    runner = StageRunner(config, config.stages["a"], by_property, worker)
    terminate(conn, runner)
    assert runner.run_batch([wid]) == b"74\n"
    assert runner.run_batch([wid]) == b"74\n"
    worker.close()


@pytest.fixture
def limited_role(dsn: str, conn: Conn) -> Iterator[str]:
    """A DSN as a role that may hold one connection at a time."""
    role = f"worker_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(role)
    # a password: the embedded server accepts SCRAM logins only
    conn.execute(
        sql.SQL("CREATE ROLE {} LOGIN CONNECTION LIMIT 1 PASSWORD 'limited'").format(ident)
    )
    conn.execute(sql.SQL("GRANT USAGE ON SCHEMA pepsi TO {}").format(ident))
    conn.execute(sql.SQL("GRANT ALL ON ALL TABLES IN SCHEMA pepsi TO {}").format(ident))
    yield conninfo.make_conninfo(dsn, user=role, password="limited")
    conn.execute(sql.SQL("DROP OWNED BY {}").format(ident))
    conn.execute(sql.SQL("DROP ROLE {}").format(ident))


def test_a_reconnect_refused_for_the_connection_limit_answers_75(
    conn: Conn, make_runner: Callable[..., StageRunner], limited_role: str
) -> None:
    wid = running(conn)
    runner = make_runner(by_property, worker_dsn=limited_role)
    terminate(conn, runner)
    wait_readable(runner.conn)
    with psycopg.connect(limited_role):  # takes the role's one connection
        assert runner.run_batch([wid]) == b"75\n"  # its reconnect: too many connections
        assert runner.run_batch([wid]) == b"75\n"
    assert row_of(conn, wid) == ("a", "running", {}, None)
    # The server frees the slot when that backend has exited, a moment after
    # the client closed: wait for it rather than race it.
    role = conninfo.conninfo_to_dict(limited_role)["user"]
    deadline = time.monotonic() + 10
    while conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE usename = %s", (role,)
    ).fetchone() != (0,):
        assert time.monotonic() < deadline, "the role's connection never went away"
        time.sleep(0.01)
    assert outcomes(runner.run_batch([wid])) == [(0, "advance")]
