"""`pepsi queue`: inspection and repair on a real queue."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pepsi.cli import main

CONF = "[stage-a]\nHANDLER = tests.stages:noop\n[stage-b]\nHANDLER = tests.stages:noop\n"


@pytest.fixture
def queue(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[psycopg.Connection[Any]]:
    (tmp_path / "pepsi.conf").write_text(CONF)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PEPSI_DSN", dsn)
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute(
        "INSERT INTO pepsi.workqueue (workqueue_id, stage, status, timeout, state, origin_user)"
        " VALUES (1, 'a', 'pending', NULL, '{}', 'alice'),"
        " (2, 'a', 'paused', now() + interval '1 hour', '{\"temporary_failures\": 2}', 'bob'),"
        ' (3, \'b\', \'failed\', NULL, \'{"failed_stage": "a", "failure_class": "crashed",'
        "  \"strikes\": 3}', 'bob'),"
        " (4, 'b', 'running', NULL, '{}', 'carol'),"
        " (5, 'b', 'timeout', NULL, '{\"failure_class\": \"timed-out\", \"strikes\": 3}', 'dave')"
    )
    yield conn
    conn.close()


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any, str]:
    code = main(["queue", *args])
    captured = capsys.readouterr()
    out = captured.out
    return code, (json.loads(out) if "--json" in args and code == 0 else out), captured.err


def test_status_and_listings(queue: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, data, _ = run(capsys, "status", "--json")
    assert code == 0
    stages = {s["stage"]: s for s in data["stages"]}
    assert stages["a"]["pending"] == 1
    assert stages["a"]["paused"] == 1
    assert stages["a"]["next_retry"] is not None
    assert stages["a"]["oldest_pending_s"] >= 0
    assert {(f["status"], f["failure_class"]) for f in data["failures"]} == {
        ("failed", "crashed"), ("timeout", "timed-out"),
    }  # fmt: skip
    code, rows, _ = run(capsys, "list", "--stage", "b", "--json")
    assert [r["id"] for r in rows] == [3, 4, 5]
    _, rows, _ = run(capsys, "list", "--sender-key", "user:bob", "--status", "failed", "--json")
    assert [r["id"] for r in rows] == [3]
    code, shown, _ = run(capsys, "show", "3", "--json")
    assert shown["state"]["strikes"] == 3
    code, out, _ = run(capsys, "status")
    assert "failures" in out
    code, _, err = run(capsys, "show", "99")
    assert code == 1
    assert "no message 99" in err


def test_resume_retry_move_delete(queue: Any, capsys: pytest.CaptureFixture[str]) -> None:
    listener = psycopg.connect(queue.info.dsn, autocommit=True)
    listener.execute("LISTEN workqueue")
    assert run(capsys, "resume", "2", "--json")[1] == {"action": "resume", "ids": [2]}
    assert len(list(listener.notifies(timeout=1))) == 1
    row = queue.execute("SELECT status::text, timeout FROM pepsi.workqueue WHERE workqueue_id = 2")
    assert row.fetchone() == ("pending", None)
    assert run(capsys, "retry", "--all", "--json")[1]["ids"] == [3, 5]
    retried = queue.execute(
        "SELECT workqueue_id, stage, status::text, state FROM pepsi.workqueue"
        " WHERE workqueue_id IN (3, 5) ORDER BY 1"
    ).fetchall()
    assert retried == [(3, "a", "pending", {}), (5, "b", "pending", {})]
    assert run(capsys, "move", "1", "--to", "b", "--json")[1]["ids"] == [1]
    code, _, err = run(capsys, "delete", "1")
    assert code == 1
    assert "--yes" in err
    assert run(capsys, "delete", "1", "--yes", "--json")[1]["ids"] == [1]
    listener.close()


def test_refusals(queue: Any, capsys: pytest.CaptureFixture[str]) -> None:
    for args, message in (
        (["retry"], "say which messages"),
        (["move", "1", "--to", "nowhere"], "no stage named 'nowhere'"),
        (["resume", "1"], "not in a state it applies to"),
        (["retry", "42"], "no such message"),
        (["resume", "--stage", "zz"], "no stage named 'zz'"),
    ):
        code, _, err = run(capsys, *args)
        assert code == 1, args
        assert message in err
        assert err.count("\n") == 1


def test_running_rows_only_without_a_dispatcher(
    queue: Any, dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with psycopg.connect(dsn, autocommit=True) as dispatcher:
        dispatcher.execute("SELECT pg_advisory_lock(1885696115)")  # as the dispatcher holds it
        code, _, err = run(capsys, "delete", "4", "--yes")
        assert code == 1
        assert "running and the dispatcher is up" in err
    assert run(capsys, "delete", "4", "--yes", "--json")[1]["ids"] == [4]  # lock is free now


def test_ids_beyond_bigint_are_one_line(queue: Any, capsys: pytest.CaptureFixture[str]) -> None:
    huge = str(2**70)
    for args, message in (
        (["resume", huge], f"no such message, or not in a state it applies to (paused): {huge}"),
        (["delete", "1", huge, "--yes"], f"(pending/paused/failed/timeout/running): {huge}"),
        (["show", huge], f"no message {huge} in the queue"),
    ):
        code, _, err = run(capsys, *args)
        assert code == 1, args
        assert message in err
        assert err.count("\n") == 1
    code, rows, _ = run(capsys, "list", "--limit", huge, "--json")
    assert (code, [r["id"] for r in rows]) == (0, [1, 2, 3, 4, 5])
    assert queue.execute("SELECT count(*) FROM pepsi.workqueue").fetchone() == (5,)


# Issue 13, defect 5: a transaction holding back vacuum is shown, past a threshold.
def test_status_warns_of_a_transaction_holding_back_vacuum(
    queue: psycopg.Connection[Any],
    dsn: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import re  # noqa: PLC0415
    import time  # noqa: PLC0415

    from pepsi.admin.horizon import WARN_AFTER_ENV, read_oldest  # noqa: PLC0415

    def status() -> tuple[int, str, str]:
        code, out, err = run(capsys, "status")
        return code, re.sub(r"\d+\.\ds", "AGE", out), err  # the oldest pending row ages

    code, quiet, _ = status()
    assert (code, "warning" in quiet) == (0, False)
    with psycopg.connect(dsn, application_name="psql") as idle:  # not autocommit: BEGIN
        idle.execute("SELECT txid_current()")
        pid = idle.info.backend_pid
        deadline = time.monotonic() + 10
        while (held := read_oldest(queue)) is None or held.age_s <= 0.2:  # a shortened threshold
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # Under the default threshold (60s): the same output as without the session.
        assert status() == (0, quiet, "")
        monkeypatch.setenv(WARN_AFTER_ENV, "200ms")
        code, out, err = status()
        assert (code, err) == (0, "")
        assert out.startswith(quiet)  # every other line unchanged
        (line,) = out[len(quiet) :].splitlines()
        assert line.startswith(f"warning: transaction of pid {pid} (user ")
        assert ", app psql, idle in transaction) has held back vacuum for " in line
        assert line.endswith("end it or set idle_in_transaction_session_timeout")
        code, data, _ = run(capsys, "status", "--json")
        held = data["oldest_transaction"]
        assert (held["pid"], held["state"], held["late"]) == (pid, "idle in transaction", True)
        monkeypatch.setenv(WARN_AFTER_ENV, "soon")
        code, out, err = run(capsys, "status")
        assert (code, out) == (1, "")
        assert err.count("\n") == 1
        assert "PEPSI_HORIZON_WARN_AFTER='soon': expected a duration" in err
        idle.rollback()
    monkeypatch.delenv(WARN_AFTER_ENV)
    assert run(capsys, "status", "--json")[1]["oldest_transaction"] is None


@pytest.mark.parametrize("huge", [str(2**63), str(-(2**63) - 1), str(10**40)])
@pytest.mark.parametrize(
    "args",
    [
        ("retry", "{}"),
        ("resume", "{}"),
        ("move", "{}", "--to", "b"),
        ("delete", "{}", "--yes"),
        ("retry", "3", "{}"),
        ("show", "{}"),
    ],
)
def test_an_id_just_beyond_bigint_is_not_a_database_error(
    queue: Any, capsys: pytest.CaptureFixture[str], huge: str, args: tuple[str, ...]
) -> None:
    """Issue 13: `pepsi queue retry 9223372036854775808` raised NumericValueOutOfRange."""
    code, out, err = run(capsys, *(a.format(huge) for a in args))
    assert code == 1, err
    assert out == ""
    assert huge in err
    assert err.count("\n") == 1
    assert "SQLSTATE" not in err
    assert "out of range" not in err
    assert queue.execute("SELECT count(*) FROM pepsi.workqueue").fetchone() == (5,)
