"""`pepsi top`: frames read from a real queue, stats tables and sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pepsi.admin.horizon import WARN_AFTER_ENV, read_oldest
from pepsi.cli import main
from pepsi.publishing import OutgoingMessage, Publisher

CONF = "[stage-a]\nHANDLER = tests.stages:noop\n[stage-b]\nHANDLER = tests.stages:noop\n"
REPO = Path(__file__).resolve().parents[2]
LOCK = 1885696115  # the dispatcher's advisory lock (queries.sql: dispatcher_lock_try)


@pytest.fixture
def queue(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[psycopg.Connection[Any]]:
    conf = tmp_path / "pepsi.conf"
    conf.write_text(CONF)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PEPSI_DSN", dsn)
    with Publisher.connect(conf, dsn) as publisher:
        publisher.publish_many([OutgoingMessage("a", b"x")] * 3 + [OutgoingMessage("b", b"y")] * 2)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pepsi.stage_stats (stage, processed, failed, finished, strikes, retries)"
            " VALUES ('a', 40, 2, 30, 3, 1)"
        )
        yield conn


def top(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["top", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_frames(queue: Any, dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    # A session holding the dispatcher's lock and one named as a worker of stage a,
    # as the real ones are.
    with (
        psycopg.connect(dsn, autocommit=True) as dispatcher,
        psycopg.connect(dsn, autocommit=True, application_name="pepsi-worker:a"),
    ):
        dispatcher.execute("SELECT pg_advisory_lock(%s)", (LOCK,))
        pid = dispatcher.info.backend_pid
        code, out, err = top(capsys, "--count", "2", "--interval", "0.2", "--json")
    assert (code, err) == (0, "")
    first, second = (json.loads(line) for line in out.splitlines())
    for item in (first, second):
        stages = {s["stage"]: s for s in item["stages"]}
        assert list(stages) == ["a", "b"]
        assert (stages["a"]["backlog"], stages["b"]["backlog"]) == (3, 2)  # as published
        assert (stages["a"]["running"], stages["a"]["failed"]) == (0, 0)
        assert (stages["a"]["workers"], stages["b"]["workers"]) == (1, 0)
        assert (stages["a"]["strikes"], stages["a"]["retries"]) == (3, 1)
        assert item["dispatcher"]["running"] is True
        assert item["dispatcher"]["pid"] == pid
        assert item["dispatcher"]["last_flush"] is None  # dispatch_stats is empty
        # no flush ever seen: no rates, however many refreshes
        assert item["rate_window_s"] is None
        assert set(item["stages"][0]["rates"].values()) == {None}
        assert item["dispatcher"]["claims_per_s"] is None


def test_rates_between_two_flushes(
    queue: psycopg.Connection[Any], dsn: str, tmp_path: Path
) -> None:
    """A running `pepsi top` sees a second flush and rates it over the flush window."""
    (now,) = queue.execute("SELECT now()").fetchone() or (None,)
    first_flush, second_flush = now - timedelta(seconds=20), now - timedelta(seconds=10)
    queue.execute(
        "INSERT INTO pepsi.dispatch_stats (claims, claimed, updated) VALUES (5, 50, %s)",
        (first_flush,),
    )
    dispatcher = psycopg.connect(dsn, autocommit=True)  # running: it holds the lock
    dispatcher.execute("SELECT pg_advisory_lock(%s)", (LOCK,))
    with (
        dispatcher,
        subprocess.Popen(
            [sys.executable, "-m", "pepsi", "top", "--json", "--interval", "0.1", "--count", "600"],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            text=True,
        ) as proc,
    ):
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        assert first["rate_window_s"] is None  # one flush seen: nothing to rate yet
        # What the dispatcher's next flush writes, in one transaction.
        with queue.transaction():
            queue.execute("UPDATE pepsi.stage_stats SET processed = processed + 30")
            queue.execute(
                "UPDATE pepsi.dispatch_stats SET claims = claims + 3, claimed = claimed + 30,"
                " updated = %s",
                (second_flush,),
            )
        seen = None
        for line in proc.stdout:  # the frames until top has read the flush
            if json.loads(line)["rate_window_s"] is not None:
                seen = json.loads(line)
                break
        proc.kill()
    assert seen is not None, "top ended without seeing the second flush"
    item = seen
    assert item["rate_window_s"] == 10.0  # flush to flush, not refresh to refresh
    assert item["stages"][0]["rates"]["processed"] == 3.0
    assert item["stages"][0]["rates"]["finished"] == 0.0
    assert (item["dispatcher"]["claims_per_s"], item["dispatcher"]["claimed_per_s"]) == (0.3, 3.0)


def test_dispatch_stats_and_no_dispatcher(
    queue: psycopg.Connection[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    queue.execute("INSERT INTO pepsi.dispatch_stats (claims, claimed) VALUES (5, 50)")
    code, out, _ = top(capsys, "--count", "1", "--json")
    assert code == 0
    (item,) = (json.loads(line) for line in out.splitlines())
    assert item["dispatcher"]["running"] is False
    assert item["dispatcher"]["last_flush"] is not None
    assert item["dispatcher"]["flush_age_s"] >= 0


def test_text_frames_when_not_a_terminal(queue: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = top(capsys, "--count", "2", "--interval", "0.2")
    assert (code, err) == (0, "")
    assert out.count("dispatcher: not running") == 2  # one frame per refresh
    assert out.count("STATS_INTERVAL") == 2
    first_words = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert (first_words.count("a"), first_words.count("b")) == (2, 2)  # a row per stage and frame
    assert "–" in out  # the first frame has no rates


def test_refusals(
    queue: Any, empty_dsn: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    for args, message in (
        (["--interval", "0"], "--interval must be greater than 0"),
        (["--interval", "-1"], "--interval wants a positive number"),
        (["--interval", "soon"], "--interval wants a positive number"),
        (["--count", "0"], "--count must be at least 1"),
    ):
        code, out, err = top(capsys, *args)
        assert code == 2, args
        assert message in err
        assert (out, err.count("\n")) == ("", 1)
    monkeypatch.setenv("PEPSI_DSN", empty_dsn)
    code, _, err = top(capsys, "--count", "1")
    assert code == 78  # schema missing
    assert err.count("\n") == 1
    monkeypatch.setenv("PEPSI_DSN", "postgresql://127.0.0.1:1/nowhere?connect_timeout=1")
    code, _, err = top(capsys, "--count", "1")
    assert code == 1
    assert "cannot connect to the database" in err
    assert err.count("\n") == 1


# Issue 13, defect 5: the oldest transaction holding back vacuum, in the header.
def test_the_oldest_transaction_in_the_header(
    queue: psycopg.Connection[Any],
    dsn: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, out, _ = top(capsys, "--count", "1", "--json")
    assert (code, json.loads(out)["oldest_transaction"]) == (0, None)
    with psycopg.connect(dsn, application_name="psql") as idle:  # not autocommit: BEGIN
        idle.execute("SELECT txid_current()")
        pid = idle.info.backend_pid
        deadline = time.monotonic() + 10
        while (held := read_oldest(queue)) is None or held.age_s <= 0.2:  # a shortened threshold
            assert time.monotonic() < deadline
            time.sleep(0.01)
        code, out, _ = top(capsys, "--count", "1", "--json")
        item = json.loads(out)["oldest_transaction"]
        assert (item["pid"], item["state"], item["late"]) == (pid, "idle in transaction", False)
        assert item["age_s"] >= 0.2
        code, out, err = top(capsys, "--count", "1")
        assert (code, err) == (0, "")
        assert "oldest transaction " in out
        assert f"(pid {pid})" in out
        assert "warning" not in out  # under the default 60s
        monkeypatch.setenv(WARN_AFTER_ENV, "200ms")
        code, out, err = top(capsys, "--count", "1")
        assert (code, err) == (0, "")
        out = " ".join(out.split())  # rich folds long lines at 200 columns when piped
        assert f"warning: transaction of pid {pid} (user " in out
        assert "end it or set idle_in_transaction_session_timeout" in out
        assert json.loads(top(capsys, "--count", "1", "--json")[1])["oldest_transaction"]["late"]
        idle.rollback()
