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
