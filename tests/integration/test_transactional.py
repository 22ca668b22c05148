"""Transactional stages (issue 18) in-process against a real database.

A `@stage(transactional=True)` stage writes through `msg.db`, in the
transaction that records its outcome: its writes and the outcome commit
together; a failure rolls its writes back; a row handed to someone else
meanwhile (its claim token changed) is left alone and the writes roll back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from pepsi.config import Config, load_config
from pepsi.errors import PepsiError
from pepsi.protocol import Pass, parse_status
from pepsi.stage import Message, PermanentError, stage
from pepsi.worker.runner import StageRunner
from tests.rows import running

Conn = psycopg.Connection[tuple[Any, ...]]
UNTIL = datetime(2030, 1, 1, tzinfo=UTC)

CONF = """
[stage-a]
HANDLER = tests.exactly_once_stages:tx_insert
NEXT = b
QUEUE_LIMIT = 8
RETRY_DELAY = 10s
MAX_LIFETIME = 1h
[stage-b]
HANDLER = tests.exactly_once_stages:tx_insert
FUSION = yes
[stage-dead]
HANDLER = tests.stages:noop
[stage-bounced]
HANDLER = tests.exactly_once_stages:tx_insert
MAX_LIFETIME = 1h
BOUNCE_STAGE = dead
"""


@pytest.fixture
def config(tmp_path: Path) -> Config:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF)
    return load_config(path)


@pytest.fixture
def app(conn: Conn) -> Conn:
    """The application's table, in the same database as the queue."""
    conn.execute("CREATE TABLE effects (workqueue_id bigint, note text)")
    return conn


def row_of(conn: Conn, wid: int) -> tuple[str, str, dict[str, Any]] | None:
    row = conn.execute(
        "SELECT stage, status::text, state FROM pepsi.workqueue WHERE workqueue_id = %s", (wid,)
    ).fetchone()
    return None if row is None else (row[0], row[1], row[2])


def effects(conn: Conn) -> list[tuple[int, str]]:
    return [(int(w), str(n)) for w, n in conn.execute("SELECT * FROM effects ORDER BY 1, 2")]


def outcomes(out: bytes) -> list[tuple[int, str | None]]:
    result = []
    for line in out.splitlines():
        parsed = parse_status(line)
        report = parsed.report or (Pass("", 0, None),)
        result.append((parsed.status, report[0].outcome))
    return result


@stage(transactional=True)
def by_property(msg: Message) -> object:
    """Writes one effect through msg.db, then does what the `do` property says."""
    msg.db.execute("INSERT INTO effects VALUES (%s, %s)", (msg.id, msg.stage))
    msg.state["ran"] = True
    match msg.properties.get("do"):
        case "finish":
            return msg.finish()
        case "pause":
            return msg.pause(until=UNTIL, reason="waiting")
        case "permanent":
            raise PermanentError("cannot parse this")
        case "host":
            raise ConnectionError("upstream unavailable")
        case "unknown-stage":
            return msg.advance("nowhere")
        case "swallow":  # a failed statement the stage catches: the transaction is aborted
            with contextlib.suppress(psycopg.errors.DivisionByZero):
                msg.db.execute("SELECT 1 / 0")
        case "commit":  # the stage may not end the transaction itself
            msg.db.commit()
    return None


def test_writes_and_outcomes_commit_together(
    app: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    advance = running(app, "a")
    finish = running(app, "a", properties={"do": "finish"})
    pause = running(app, "a", properties={"do": "pause"})
    out = make_runner(by_property).run_batch([advance, finish, pause])
    assert outcomes(out) == [(0, "advance"), (0, "finish"), (0, "pause")]
    assert row_of(app, advance) == ("b", "pending", {"ran": True})
    assert row_of(app, finish) is None
    assert row_of(app, pause) == ("a", "paused", {"ran": True, "pause_reason": "waiting"})
    assert effects(app) == [(advance, "a"), (finish, "a"), (pause, "a")]


@pytest.mark.parametrize(
    ("do", "outcome", "status", "failure_class"),
    [
        ("host", "retry", "paused", None),
        ("permanent", "fail", "failed", "permanent"),
        ("unknown-stage", "retry", "paused", None),
        ("swallow", "retry", "paused", None),
        ("commit", "retry", "paused", None),
    ],
)
def test_a_failure_rolls_the_writes_back_and_is_recorded(
    app: Conn,
    make_runner: Callable[..., StageRunner],
    do: str,
    outcome: str,
    status: str,
    failure_class: str | None,
) -> None:
    wid = running(app, "a", properties={"do": do})
    fine = running(app, "a")
    out = make_runner(by_property).run_batch([wid, fine])
    assert outcomes(out) == [(1 if status == "failed" else 0, outcome), (0, "advance")]
    found = row_of(app, wid)
    assert found is not None
    assert found[:2] == ("a", status)
    assert found[2].get("failure_class") == failure_class
    assert found[2]["last_error"]
    assert effects(app) == [(fine, "a")]  # the failed message's write rolled back


def test_past_max_lifetime_goes_to_the_bounce_stage_without_its_writes(
    app: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    wid = running(app, "bounced", properties={"do": "host"})
    later = datetime(2026, 1, 2, 6, tzinfo=UTC)  # 30 hours after arrival
    out = make_runner(by_property, "bounced", at=later).run_batch([wid])
    assert outcomes(out) == [(0, "advance")]
    found = row_of(app, wid)
    assert found is not None
    assert found[:2] == ("dead", "pending")
    assert found[2]["failure_class"] == "retries-exhausted"
    assert effects(app) == []


def test_a_row_claimed_again_meanwhile_is_left_alone(
    app: Conn, dsn: str, make_runner: Callable[..., StageRunner]
) -> None:
    """A restarted dispatcher reset the row and another worker got it: another token."""
    other = psycopg.connect(dsn, autocommit=True)

    @stage(transactional=True)
    def reclaimed_meanwhile(msg: Message) -> None:
        msg.db.execute("INSERT INTO effects VALUES (%s, 'late')", (msg.id,))
        if msg.properties.get("reclaim"):  # reset to pending, claimed again: two UPDATEs
            other.execute("UPDATE pepsi.workqueue SET status = 'pending' WHERE workqueue_id = %s",
                          (msg.id,))  # fmt: skip
            other.execute("UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = %s",
                          (msg.id,))  # fmt: skip

    try:
        lost = running(app, "a", properties={"reclaim": True})
        kept = running(app, "a")
        out = make_runner(reclaimed_meanwhile).run_batch([lost, kept])
    finally:
        other.close()
    assert outcomes(out) == [(0, None), (0, "advance")]  # 0 and no report: not ours
    assert row_of(app, lost) == ("a", "running", {})  # the new holder's, untouched
    assert row_of(app, kept) == ("b", "pending", {})
    assert effects(app) == [(kept, "late")]


def test_a_row_reset_meanwhile_is_left_alone(
    app: Conn, dsn: str, make_runner: Callable[..., StageRunner]
) -> None:
    other = psycopg.connect(dsn, autocommit=True)

    @stage(transactional=True)
    def reset_meanwhile(msg: Message) -> None:
        msg.db.execute("INSERT INTO effects VALUES (%s, 'late')", (msg.id,))
        other.execute("UPDATE pepsi.workqueue SET status = 'pending' WHERE workqueue_id = %s",
                      (msg.id,))  # fmt: skip
        raise ConnectionError("and the failure cannot be recorded either")

    try:
        wid = running(app, "a")
        out = make_runner(reset_meanwhile).run_batch([wid])
    finally:
        other.close()
    assert outcomes(out) == [(0, None)]
    assert row_of(app, wid) == ("a", "pending", {})
    assert effects(app) == []


def test_an_async_stage_gets_the_same_connection(
    app: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    seen: list[object] = []

    @stage(transactional=True)
    async def later(msg: Message) -> None:
        await asyncio.sleep(0)
        seen.append(msg.db)
        msg.db.execute("INSERT INTO effects VALUES (%s, 'async')", (msg.id,))

    runner = make_runner(later)
    wid = running(app, "a")
    assert outcomes(runner.run_batch([wid])) == [(0, "advance")]
    assert seen == [runner.conn]
    assert effects(app) == [(wid, "async")]
    assert row_of(app, wid) == ("b", "pending", {})


def test_msg_db_is_closed_to_other_stages_and_after_the_stage(
    app: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    kept: list[Message] = []

    @stage()
    def plain(msg: Message) -> None:
        kept.append(msg)
        msg.db.execute("SELECT 1")

    wid = running(app, "a")
    assert outcomes(make_runner(plain).run_batch([wid])) == [(0, "retry")]
    found = row_of(app, wid)
    assert found is not None
    assert "only open while a @stage(transactional=True)" in found[2]["last_error"]

    @stage(transactional=True)
    def keep(msg: Message) -> None:
        kept.append(msg)

    assert outcomes(make_runner(keep).run_batch([running(app, "a")])) == [(0, "advance")]
    with pytest.raises(PepsiError):
        kept[-1].db  # noqa: B018  # the property is the test


def test_no_fusion_into_a_transactional_stage(
    app: Conn, make_runner: Callable[..., StageRunner]
) -> None:
    """Stage b is FUSION = yes, but transactional: the advance is written, not fused."""
    wid = running(app, "a")
    out = make_runner(by_property).run_batch([wid])
    assert outcomes(out) == [(0, "advance")]
    assert len(parse_status(out.splitlines()[0]).report or ()) == 1
    assert row_of(app, wid) == ("b", "pending", {"ran": True})


def test_a_split_row_gets_its_new_token(app: Conn, make_runner: Callable[..., StageRunner]) -> None:
    """Per-address overrides split a row (an UPDATE: a new xmin) before the stage runs."""
    app.execute(
        "INSERT INTO pepsi.settings (address, stage, options) VALUES (%s, 'a', %s)",
        ("x@example.org", Jsonb({"RETRY_DELAY": "1s"})),
    )
    wid = running(app, "a", recipients=["x@example.org", "y@example.org"])
    out = make_runner(by_property).run_batch([wid])
    assert outcomes(out) == [(0, "advance")]
    assert row_of(app, wid) == ("b", "pending", {"ran": True})
    assert effects(app) == [(wid, "a")]
    split = app.execute(
        "SELECT count(*) FROM pepsi.workqueue WHERE stage = 'a' AND status = 'pending'"
    ).fetchone()
    assert split == (1,)  # the other group, pending as a row of its own


# --- the SQL function, as an external program calls it ---------------------------


def test_an_external_program_records_its_outcome_in_its_transaction(app: Conn, dsn: str) -> None:
    wid = running(app, "a", state={"strikes": 1})
    stale = running(app, "a")
    with psycopg.connect(dsn) as program:  # not autocommit: one transaction per message
        token = program.execute("SELECT pepsi.workqueue_claim_token(%s, 'a')", (wid,)).fetchone()
        assert token is not None
        assert token[0]
        old = program.execute("SELECT pepsi.workqueue_claim_token(%s, 'a')", (stale,)).fetchone()
        program.commit()
        app.execute(  # a restarted dispatcher resets `stale`; it is claimed again
            "UPDATE pepsi.workqueue SET status = 'pending' WHERE workqueue_id = %s", (stale,)
        )
        app.execute("UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = %s",
                    (stale,))  # fmt: skip
        for message, claim in ((wid, token[0]), (stale, old[0] if old else None)):
            program.execute("INSERT INTO effects VALUES (%s, 'program')", (message,))
            done = program.execute(
                "SELECT pepsi.workqueue_record_outcome(%s, 'a', %s, 'advance', 'b')",
                (message, claim),
            ).fetchone()
            if done == (True,):
                program.commit()
            else:
                program.rollback()
    assert row_of(app, wid) == ("b", "pending", {})  # strikes start again at a new stage
    assert row_of(app, stale) == ("a", "running", {})
    assert effects(app) == [(wid, "program")]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ("'finish'", None),
        ("'pause', NULL, '2030-01-01Z', 'later'", ("a", "paused", {"pause_reason": "later"})),
        (
            "'fail', NULL, NULL, 'bad input'",
            (
                "a",
                "failed",
                {"failed_stage": "a", "failure_class": "permanent", "last_error": "bad input"},
            ),
        ),
        ("'advance', 'b', NULL, NULL, '{\"k\": 1}'", ("b", "pending", {"k": 1})),
    ],
)
def test_the_function_records_each_outcome(
    app: Conn, args: str, expected: tuple[str, str, dict[str, Any]] | None
) -> None:
    wid = running(app, "a")
    found = app.execute(
        f"SELECT pepsi.workqueue_record_outcome(%s, 'a', pepsi.workqueue_claim_token(%s, 'a'),"
        f" {args})",
        (wid, wid),
    ).fetchone()
    assert found == (True,)
    assert row_of(app, wid) == expected
    assert app.execute(  # twice: the row is no longer running here, nothing is written
        f"SELECT pepsi.workqueue_record_outcome(%s, 'a', 'x', {args})", (wid,)
    ).fetchone() == (False,)


def test_the_function_refuses_an_unknown_outcome(app: Conn) -> None:
    wid = running(app, "a")
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        app.execute("SELECT pepsi.workqueue_record_outcome(%s, 'a', 'x', 'explode')", (wid,))
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        app.execute("SELECT pepsi.workqueue_record_outcome(%s, 'a', 'x', 'advance')", (wid,))
